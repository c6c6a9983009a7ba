"""One worker of a tier: membership and the balance rule (`members`, `membership`, `balance`),
the tier's streams and pinned consumers (`streams`), each owned partition's fenced log and its
entries (`ownership`, `entries`), pull-apply-append-act loop (`owner`) and its phases (`phase`),
the partition it drives (`partition`: `planner`, local file, `timers`, outbox), engine leases
(`leases`), and `service`, whose `Worker` wires them to the process as `kvhandoff run`."""
