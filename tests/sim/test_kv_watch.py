"""A watch of the engines' lease bucket (worker.bus.kv `Watch`) resumes after a reconnect even
when JetStream cannot answer at first, on the model only: a real server cannot be made to hold
an election on demand.

Seeds 157 and 283 of `kvhandoff sim` found it: a worker reconnected while JetStream elected a
leader, the consumer that nats-py made again for the watch in a task of its own was refused,
and the watch heard nothing until nats-py missed two heartbeats, 10 to 20 s later. Meanwhile
an engine came back under a new lease and took handoffs, and the tier, still holding the
engine's old lease gone, answered for it: cleanups the live engine never ran, its blocks
leaked.
"""

from __future__ import annotations

import asyncio

from kvhandoff.worker.bus.kv import open_expiring_bucket, put_expiring, watch_bucket
from tests.eventually import until
from tests.sim.contract.backend import Backend, ModelBackend, now

ELECTION_S = 3.0


def test_a_watch_resumes_after_a_reconnect_once_jetstream_answers_again() -> None:
    async def body(backend: Backend) -> None:
        assert isinstance(backend, ModelBackend)
        bus, engine = await backend.connect("worker"), await backend.connect("engine")
        bucket = backend.fresh("LEASES")
        await open_expiring_bucket(engine, bucket, marker_ttl_s=60.0)
        await put_expiring(engine, bucket, "e1", b"before", 60.0, give_up_after_s=5.0)
        seen: list[tuple[str, bytes | None]] = []
        watch = await watch_bucket(bus, bucket, lambda key, value: seen.append((key, value)))
        reconnected = asyncio.Event()
        bus.on_reconnect(reconnected.set)

        answers_at = now() + ELECTION_S
        backend.cluster.jetstream.faults.unavailable_until = answers_at
        await backend.restart_server()
        await until(reconnected.is_set, "the watcher reconnected", within=ELECTION_S)
        await put_expiring(engine, bucket, "e2", b"after", 60.0, give_up_after_s=2 * ELECTION_S)
        assert now() >= answers_at
        await until(lambda: ("e2", b"after") in seen, "the put after the election", within=2.0)
        # Well before nats-py's own check, two idle heartbeats (10 s) after the reconnect.
        assert seen == [("e1", b"before"), ("e2", b"after")]
        await watch.unsubscribe()

    ModelBackend(seed=1).run(body)
