"""One worker of a tier: membership and the balance rule (`membership`, `balance`), each owned
partition's fenced log (`ownership`), pull-apply-append-act loop (`owner`), planner, timers and
engine leases, and `service`, which ties them to the real coordinator as `kvhandoff run`."""
