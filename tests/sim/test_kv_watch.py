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

from tests.sim.contract.backend import Backend, ModelBackend, now
from tests.sim.contract.test_kv import watch_across_a_restart

ELECTION_S = 3.0


def test_a_watch_resumes_after_a_reconnect_once_jetstream_answers_again() -> None:
    async def body(backend: Backend) -> None:
        assert isinstance(backend, ModelBackend)
        faults = backend.cluster.jetstream.faults

        def elect() -> None:
            faults.unavailable_until = now() + ELECTION_S

        stored_at = await watch_across_a_restart(backend, elect)
        assert stored_at >= faults.unavailable_until > 0  # the put waited the election out

    ModelBackend(seed=1).run(body)
