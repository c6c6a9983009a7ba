"""Contracts of core NATS as the bus uses it, and of a server restart.

contract                                        tier code that relies on it
a subscriber gets, in order, what matches its   client.connection (actions by engine id,
  subject (`*`, `>`) and was published after      completions, rejections), the barrier
  its flush                                       (`flush`: a message to our own inbox)
a scatter-gather collects every reply; one      client.connection.gather, engine_listening
  nobody answers collects none                    (presence probes)
a restart keeps what streams stored and what    tier (streams and consumers outlive a
  consumers had acknowledged (once written:       node), bus.connection (`on_reconnect`,
  a consumer's state is written 10 times a        Deliveries.reset), bus.publish "The
  second); the bus reconnects, its Pull pulls     barrier"
  on, and a flush across the reconnect fails
"""

from __future__ import annotations

import asyncio

import pytest

from kvhandoff.worker.bus.connection import Bus, Handler, Message
from kvhandoff.worker.bus.pull import Pull
from kvhandoff.worker.bus.streams import (
    StreamSpec,
    ack_floor,
    create_pull_consumer,
    create_stream,
    unacknowledged,
)
from kvhandoff.worker.errors import BusError
from tests.eventually import until
from tests.sim.contract.backend import Backend, contract
from tests.sim.contract.observe import WITHIN_S, seqs, stream_state, take


@contract
async def test_a_subscriber_gets_in_order_what_matches_and_was_published_after_its_flush(
    backend: Backend,
) -> None:
    """Each subscription's handler is called in publication order (nats-py runs each
    subscription on its own task: between two subscriptions there is no order)."""
    listener, publisher = await backend.connect("frontend"), await backend.connect("worker")
    prefix = backend.fresh("p")
    done: list[tuple[str, bytes]] = []
    actions: list[tuple[str, bytes]] = []

    def into(got: list[tuple[str, bytes]]) -> Handler:
        async def on_message(msg: Message) -> None:
            got.append((msg.subject, msg.data))

        return on_message

    await listener.subscribe(f"{prefix}.done.>", into(done))
    await listener.subscribe(f"{prefix}.engine.*.actions", into(actions))
    await listener.flush()

    sent = [
        (f"{prefix}.done.h1", b"1"),
        (f"{prefix}.engine.e1.actions", b"2"),
        (f"{prefix}.rejected.h1", b"not listened to"),
        (f"{prefix}.done.h2.deeper", b"3"),
        (f"{prefix}.engine.e1.other", b"not listened to"),
        (f"{prefix}.engine.e2.actions", b"4"),
        (f"{prefix}.done.h1", b"5"),
        (f"{prefix}.done", b"not listened to"),
    ]
    for subject, data in sent:
        await publisher.publish(subject, data)
    await publisher.flush()
    await until(lambda: len(done) + len(actions) >= 5, "every message came", within=WITHIN_S)
    assert done == [sent[0], sent[3], sent[6]]
    assert actions == [sent[1], sent[5]]
    # Nothing else comes: the last message to a listened subject, behind the others, came.
    await publisher.publish(f"{prefix}.done.last", b"6")
    await publisher.flush()
    await until(lambda: len(done) == 4, "the last message came", within=WITHIN_S)
    assert done[-1] == (f"{prefix}.done.last", b"6") and len(actions) == 2


def _answering(bus: Bus, reply: bytes) -> Handler:
    async def answer(msg: Message) -> None:
        await bus.publish(msg.reply, reply)

    return answer


@contract
async def test_a_gather_collects_every_reply_and_none_where_nobody_answers(
    backend: Backend,
) -> None:
    asker = await backend.connect("asker")
    subject = f"{backend.fresh('p')}.engines.report"
    for name in (b"a", b"b"):
        responder = await backend.connect(f"engine-{name.decode()}")
        await responder.subscribe(subject, _answering(responder, name))
        await responder.flush()
    replies = await asker.gather(subject, b"", first_reply_s=WITHIN_S, quiet_s=0.3)
    assert sorted(replies) == [b"a", b"b"]
    assert await asker.gather(f"{subject}.nobody", b"", first_reply_s=0.3, quiet_s=0.3) == []


@contract
async def test_a_restart_keeps_what_was_stored_and_acknowledged_and_the_bus_reconnects(
    backend: Backend,
) -> None:
    bus = await backend.connect("worker")
    prefix, stream = backend.fresh("p"), backend.fresh("IN")
    spec = StreamSpec(name=stream, subjects=(f"{prefix}.inp.>",), retention="workqueue")
    assert await create_stream(bus, spec)
    await create_pull_consumer(
        bus, stream, "p0", filter_subject=f"{prefix}.inp.0.*", ack_wait_s=1.0, max_pending=64
    )
    for _ in range(3):
        await bus.publish_durable(f"{prefix}.inp.0.h", b"input")
    reconnected = asyncio.Event()
    bus.on_reconnect(reconnected.set)
    connection = bus.connection

    async with Pull(bus, stream, "p0", max_ahead=3) as pull:
        delivered = await take(pull, 3)
        assert seqs(delivered) == [(1, 1), (2, 1), (3, 1)]
        await delivered[0].ack()

        async def acked() -> bool:
            return await ack_floor(bus, stream, "p0") == 1

        await until(acked, "the ack reached the consumer", within=WITHIN_S)
        # The server writes a consumer's state to disk at most ten times a second (filestore's
        # `flushLoop`): a kill sooner after the ack could lose it. Not what is checked here.
        await backend.advance(0.3)
        await bus.publish(f"{prefix}.events", b"published, never flushed")

        await backend.restart_server()
        await until(reconnected.is_set, "the bus reconnected", within=WITHIN_S)
        assert bus.connection == connection + 1
        # What the old connection carried and no flush covered may be lost: the flush says so.
        with pytest.raises(BusError, match="reconnected"):
            await bus.flush()
        await bus.flush()  # and the next one, on the new connection, holds

        assert (await stream_state(bus, stream))["messages"] == 2
        assert await ack_floor(bus, stream, "p0") == 1
        subject = f"{prefix}.inp.0.h"
        assert await unacknowledged(bus, stream, "p0") == [(2, subject), (3, subject)]
        # The Pull asks again on the new connection; the two come back after the ack wait.
        assert seqs(await take(pull, 2)) == [(2, 2), (3, 2)]
    await bus.publish_durable(f"{prefix}.inp.0.h", b"input")
    assert (await stream_state(bus, stream))["last_seq"] == 4
