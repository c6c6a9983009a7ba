"""`Bus.publish_stored` against a real nats-server: each of its acks is resolved by what the
stream answers on the Bus's one inbox (its sequence, its refusal, the server's 503 when no
stream takes the subject), `flush` and `confirm` fail with `BusError` for a refused one, and a
reconnect fails every ack still awaited, so that its caller publishes again.

nats-py plays the other client: it creates the streams and reads what they stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.errors import BusError
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.worker.test_pull import until_connected

STREAM = "STORED"


@pytest.fixture
async def js(nats_server: EmbeddedNats) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=["stored.>"], max_msg_size=64))
    yield js
    await nc.close()


@pytest.fixture
async def bus(nats_server: EmbeddedNats, js: JetStreamContext) -> AsyncIterator[Bus]:
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test-stored")
    yield bus
    await bus.close()


async def test_each_ack_is_the_sequence_its_message_was_stored_at(
    bus: Bus, js: JetStreamContext
) -> None:
    acks = [await bus.publish_stored(f"stored.{i}", str(i).encode()) for i in range(50)]
    await bus.flush()  # awaits every ack
    for i, ack in enumerate(acks):
        stored = await js.get_msg(STREAM, await ack)
        assert (stored.subject, stored.data) == (f"stored.{i}", str(i).encode())


async def test_a_message_no_stream_takes_fails_its_ack_and_the_flush(bus: Bus) -> None:
    ack = await bus.publish_stored("unstored.subject", b"nobody stores this")
    with pytest.raises(BusError, match="flush failed: no stream stored a message: 503"):
        await bus.flush()
    with pytest.raises(BusError, match="503"):
        await ack


async def test_a_message_the_stream_refuses_fails_its_ack_and_the_confirm_but_no_other(
    bus: Bus,
) -> None:
    connection = bus.connection
    fine = await bus.publish_stored("stored.fine", b"small")
    refused = await bus.publish_stored("stored.big", b"x" * 65)  # over the stream's max_msg_size
    refusal = "a stream refused a message: message size exceeds maximum allowed"
    with pytest.raises(BusError, match=f"flush failed: {refusal}"):
        await bus.confirm(connection, [fine, refused])
    assert isinstance(await fine, int)
    with pytest.raises(BusError, match=refusal):
        await refused


async def test_a_reconnect_fails_the_acks_still_awaited(
    nats_server: EmbeddedNats, bus: Bus
) -> None:
    # A core subscriber that never answers stands in for a stream whose ack the reconnect
    # loses: the server sends no 503 (someone listens), so the ack stays awaited.
    silent = await nats.connect(nats_server.url, allow_reconnect=False)
    subscribed = asyncio.Event()
    received = asyncio.Event()

    async def never_answer(msg: Msg) -> None:
        (received if msg.data == b"its ack never comes" else subscribed).set()

    try:
        await silent.subscribe("silent.subject", cb=never_answer)
        # Not `silent.flush()`: nats-py writes its PING ahead of the SUB still in its buffer,
        # so the PONG does not prove that the server has the subscription, and the server may
        # answer the publish below with a 503 (no one listens) before it reads the SUB. A
        # message of `silent`'s own, written behind the SUB, comes back only once it has it.
        await silent.publish("silent.subject", b"subscribed")
        await asyncio.wait_for(subscribed.wait(), timeout=5.0)
        ack = await bus.publish_stored("silent.subject", b"its ack never comes")
        await asyncio.wait_for(received.wait(), timeout=5.0)
        assert not ack.done(), ack  # someone listens: no 503, and no stream answers
        nats_server.stop(kill=True)
        await until_connected(bus, False)
        nats_server.start()
        await until_connected(bus, True)
        with pytest.raises(BusError, match="reconnected before a stream acknowledged"):
            await asyncio.wait_for(ack, timeout=5.0)
        with pytest.raises(BusError, match="flush failed: NATS reconnected before"):
            await bus.flush()  # it covers the lost one
        again = await bus.publish_stored("stored.0", b"published again")
        await bus.flush()
        assert isinstance(await again, int)
    finally:
        await silent.close()
