"""The contract suite: every behaviour of NATS that the tier relies on, checked against a real
`nats-server` and, with one more backend, against the simulation's model of it (worker.sim).

Why. The simulation runs the tier's own code against a model of the server; its findings are
worth what the model's fidelity is. So the model is held to the real server by one suite, in
the manner of eventsourcing's recorder test cases: each contract states one behaviour through
the tier's own functions (worker.bus: `Bus`, `Pull`, `append_expecting`, `open_bucket`, ...),
asserts what the real server does, exactly, and names the tier code that relies on it (each
module's docstring has the table). A behaviour the model has and no contract checks is a
defect of the suite; a contract that fails on the model is a defect of the model.

How a contract runs. Each contract is an `async def` of a `Backend` (tests.sim.contract.
backend), made a plain pytest test by the `contract` decorator, parametrized by the `backend`
fixture (conftest.py's `BACKENDS`). The backend, not pytest-asyncio, chooses the event loop
and runs the contract to its end on it: the real backend on a fresh asyncio loop of the
machine, the model's on the simulation's deterministic loop with virtual time, where a loop
that pytest-asyncio made would be the wrong one. So a contract:

- reads time only from the running loop (`backend.now()`), never from `time`;
- lets time pass only by `Backend.advance` (the real backend sleeps, the model moves its
  clock); everything else waits for a condition, through the bus's own awaits (a fetch's
  timeout, a flush) or `tests.eventually.until`, which count the running loop's time too;
- makes its own streams, buckets and prefixes (`Backend.fresh`), so contracts share nothing;
- keeps timeouts of a second or two, so the real backend's whole suite takes seconds.

The contracts, by module (each module's docstring maps them to the tier code):

    test_streams    stream create/read/idempotence/refusal, capture, update, the partition
                    transform, one consumer per partition of a work queue
    test_publish    Nats-Msg-Id dedup and its window, compare-and-set appends (Fenced),
                    a retried append, rollups, atomic roll-up batches, reading a subject,
                    stored publishes and their acks
    test_consumers  pull order, acks leaving the work queue, ack floor, unacknowledged,
                    nak (with delay), ack wait redelivery and its order, max pending,
                    waiting and no-wait fetches, consumer re-creation, missing consumers
    test_pins       pinning on delivery, 423, unpin, the priority timeout, keeping a pin
    test_kv         buckets (put/get/delete/keys, TTL), expiring buckets, watches, renewals
    test_core       core pub/sub, scatter-gather, a server restart and the reconnect

Adding the model. One class beside `RealBackend` with `run`, `fresh`, `connect`, `advance`
and `restart_server`, and its name in `BACKENDS`; no contract changes.
"""
