"""One worker of a tier: membership and the balance rule (`membership`, `balance`), each owned
partition's fenced log (`ownership`), pull-apply-append-act loop (`owner`) and its phases
(`phase`), the partition it drives (`partition`: planner, local file, timers, outbox), engine
leases, and `service`, whose `Worker` wires them to the process as `kvhandoff run`."""
