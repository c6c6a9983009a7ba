"""kvhandoff's IO shell, one folder per concern:

- `bus/`: the NATS transport, the one place that imports nats-py.
- `tier/`: one worker of a tier: membership, the balance rule, each partition's owner (its loop
  and phases) and `Partition` (planner, local file, timers, outbox), the engines' leases, and
  the `kvhandoff run` service that wires them.
- `log/`: the local event log file (SQLite): schema, rows, the writer, the offline reader.
- `engines/`: the mock engines, and what a healthy engine answers.
- `loadgen/`: the load generator, which plays the frontend.
- `conformance/`: holding the core to its reference vectors (`kvhandoff conformance`) and an
  engine to the wire contract (`kvhandoff engine-check`).
- `harness/`: what starts `nats-server`, child processes and containers, for tests and demos.
- `sim/`: the deterministic simulation of the tier: a virtual-time loop, an in-memory network
  and a model of the NATS server, on which the tier's own code runs under one seed.
- `commands/` and `cli.py`: the `kvhandoff` command line; `config.py`, `errors.py`, `clock.py`,
  `ambient.py` (the clocks, ids and chance, as a port the simulation swaps), `stoppable.py`,
  `logging_setup.py`: what they share.
"""
