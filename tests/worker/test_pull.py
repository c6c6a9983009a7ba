"""The lean JetStream pull (`worker.bus.pull.Pull`) against a real nats-server: every status it
reads (100, 404, 408, 409, 423), stream order across many requests, settling (ack, nak),
settling while NATS is down, and a real worker that NATS leaves while it acknowledges.

nats-py plays the other clients: it creates streams and consumers, publishes, reads consumer
state, and (through a second `Bus`) watches the pull requests that reach the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo

from kvhandoff.events.replay import find_divergence
from kvhandoff.worker.bus.connection import Bus, Message
from kvhandoff.worker.bus.pull import Inbound, Pull
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.bus.streams import ack_floor, unpin
from kvhandoff.worker.errors import BusError, ConfigError, PinMismatch
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.eventually import until
from tests.worker.conftest import WorkerProcess, logged
from tests.worker.scripted_engine import ScriptedEngines
from tests.worker.test_faults import make_starts, wait_closed

STREAM = "PULLS"
CONSUMER = "reader"
NEXT = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}"
WITHIN_S = 10.0  # what a step that should take milliseconds may take on a busy machine


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """nats-server with JetStream writing through to disk, as deploy/ runs it, so that a test
    can SIGKILL it without losing what it acknowledged. (Overrides tests/worker's fixture.)"""
    store = tmp_path / "nats"
    store.mkdir()
    with EmbeddedNats(store_dir=store, config="jetstream { sync_interval: always }") as server:
        yield server


@pytest.fixture
async def js(nats_server: EmbeddedNats) -> AsyncIterator[JetStreamContext]:
    """nats-py's JetStream on a stream `PULLS` (subjects `pulls.>`) with a consumer `reader`."""
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    js = nc.jetstream()
    await js.add_stream(name=STREAM, subjects=["pulls.>"])
    await add_consumer(js, CONSUMER)
    yield js
    await nc.close()


async def add_consumer(js: JetStreamContext, name: str, **config: Any) -> None:
    await js.add_consumer(
        STREAM, ConsumerConfig(durable_name=name, ack_policy=AckPolicy.EXPLICIT, **config)
    )


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test-pull")
    yield bus
    await bus.close()


class Requests:
    """The pull requests that reach the server, as another subscriber to their subject sees
    them."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self._arrived = asyncio.Event()

    async def on_request(self, msg: Message) -> None:
        self.bodies.append(json.loads(msg.data))
        self._arrived.set()

    async def wait_for(self, count: int, within: float = WITHIN_S) -> None:
        async with asyncio.timeout(within):
            while len(self.bodies) < count:
                self._arrived.clear()
                await self._arrived.wait()


@pytest.fixture
async def requests(nats_server: EmbeddedNats) -> AsyncIterator[Requests]:
    watcher = await Bus.connect(NatsSettings(url=nats_server.url), "test-pull-watcher")
    seen = Requests()
    await watcher.subscribe(f"{NEXT}.>", seen.on_request)
    await watcher.flush()
    yield seen
    await watcher.close()


async def publish(js: JetStreamContext, numbers: range, size: int = 0) -> None:
    """Store message i on `pulls.<i>`, its payload `i` (padded to `size` bytes)."""
    for i in numbers:
        await js.publish(f"pulls.{i}", str(i).encode().ljust(size))


async def drain(pull: Pull, count: int, max_messages: int) -> list[Inbound]:
    """Fetch until `count` messages came, acknowledging each."""
    got: list[Inbound] = []
    while len(got) < count:
        batch = await pull.fetch(max_messages, timeout_s=WITHIN_S)
        assert batch, f"nothing within {WITHIN_S}s after {len(got)} of {count}"
        assert len(batch) <= max_messages
        for inbound in batch:
            await inbound.ack()
        got += batch
    return got


async def until_consumer(
    js: JetStreamContext, name: str, what: str, check: Any, within: float = WITHIN_S
) -> None:
    """Poll the server's consumer state (another process) until `check(info)` holds."""
    last: list[ConsumerInfo] = []

    async def holds() -> bool:
        last[:] = [await js.consumer_info(STREAM, name)]
        return bool(check(last[0]))

    await until(holds, f"consumer {name} {what}", within=within, every=0.02, context=lambda: last)


class Logged(logging.Handler):
    """Sets `seen` once `worker.bus` (its pull) logs a record containing `text`."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text = text
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


LOST = "nothing heard of the open requests"


@pytest.fixture
def lost() -> Iterator[Logged]:
    """Watches for `worker.bus` counting its open pull requests lost, for the test's length."""
    watcher = Logged(LOST)
    logger = logging.getLogger("kvhandoff.worker.bus")
    logger.addHandler(watcher)
    yield watcher
    logger.removeHandler(watcher)


# --- Order, bounds and settling --------------------------------------------------------------


async def test_messages_come_back_in_stream_order_across_many_requests(
    bus: Bus, js: JetStreamContext, requests: Requests
) -> None:
    await publish(js, range(300))
    async with Pull(bus, STREAM, CONSUMER, max_ahead=64) as pull:
        # More arrive while it pulls, so some requests wait for messages and some are served
        # at once.
        publishing = asyncio.create_task(publish(js, range(300, 600)))
        got = await drain(pull, 600, max_messages=7)
        await publishing

    assert [m.stream_seq for m in got] == list(range(1, 601))
    assert [m.data for m in got] == [str(i).encode() for i in range(600)]
    assert [m.subject for m in got[:2]] == ["pulls.0", "pulls.1"]
    assert {m.deliveries for m in got} == {1}
    # Many requests, none asking for more than two fetches' worth.
    await requests.wait_for(600 // 14)
    assert max(body["batch"] for body in requests.bodies) <= 2 * 7
    await until_consumer(js, CONSUMER, "all acknowledged", lambda i: i.num_ack_pending == 0)


async def test_a_nak_redelivers_after_its_delay_and_an_ack_never_does(
    bus: Bus, js: JetStreamContext
) -> None:
    await publish(js, range(2))
    async with Pull(bus, STREAM, CONSUMER, max_ahead=4) as pull:
        [first] = await pull.fetch(1, timeout_s=WITHIN_S)
        assert (first.stream_seq, first.deliveries) == (1, 1)
        await first.nak()
        again = await until_delivered(pull, 1)
        assert (again.data, again.deliveries) == (b"0", 2)

        naked_at = time.monotonic()
        await again.nak(delay_s=0.5)
        third = await until_delivered(pull, 1)
        assert third.deliveries == 3
        assert time.monotonic() - naked_at >= 0.45  # JetStream held it back as asked

        await third.ack()
    await until_consumer(
        js, CONSUMER, "settled", lambda i: i.num_ack_pending == 0 and i.num_redelivered == 0
    )


async def until_delivered(pull: Pull, stream_seq: int) -> Inbound:
    """Fetch, acknowledging everything else, until the message at `stream_seq` comes."""
    while True:
        batch = await pull.fetch(1, timeout_s=WITHIN_S)
        assert batch, f"stream seq {stream_seq} did not come back"
        if batch[0].stream_seq == stream_seq:
            return batch[0]
        await batch[0].ack()


async def test_fetch_returns_what_is_ready_at_once_and_waits_only_when_nothing_is(
    bus: Bus, js: JetStreamContext
) -> None:
    pull = Pull(bus, STREAM, CONSUMER, max_ahead=1024)
    with pytest.raises(BusError, match="fetch before start"):
        await pull.fetch(4, timeout_s=0)
    await pull.start()
    await publish(js, range(10))

    began = time.monotonic()
    got: list[Inbound] = []
    while len(got) < 10:
        batch = await pull.fetch(4, timeout_s=60)
        assert 1 <= len(batch) <= 4
        got += batch
    assert time.monotonic() - began < WITHIN_S  # not one 60 s wait
    assert [m.data for m in got] == [b"%d" % i for i in range(10)]

    began = time.monotonic()
    assert await pull.fetch(4, timeout_s=0.3) == []
    assert time.monotonic() - began >= 0.3
    await pull.close()


async def test_wake_ends_a_waiting_fetch_at_once_and_a_later_fetch_waits_again(
    bus: Bus, js: JetStreamContext, requests: Requests
) -> None:
    """What an owner that stops calls (worker.tier.owner), so that it does not wait out
    its fetch's timeout: the fetch asked the server and waits for an empty consumer; woken, it
    returns [] well inside its 60 s. Woken between fetches, the next one returns at once, and
    only that one: then what comes is fetched as before."""
    async with Pull(bus, STREAM, CONSUMER, max_ahead=16) as pull:
        waiting = asyncio.ensure_future(pull.fetch(4, timeout_s=60))
        await requests.wait_for(1)  # it asked, and waits for an answer
        assert not waiting.done()
        pull.wake()
        assert await asyncio.wait_for(waiting, WITHIN_S) == []

        pull.wake()
        assert await asyncio.wait_for(pull.fetch(4, timeout_s=60), WITHIN_S) == []
        later = asyncio.ensure_future(pull.fetch(4, timeout_s=60))
        await publish(js, range(2))
        got = await asyncio.wait_for(later, WITHIN_S)
        assert got and got[0].data == b"0"


async def test_fetch_by_bytes_cuts_a_batch_but_always_returns_one(
    bus: Bus, js: JetStreamContext
) -> None:
    await js.publish("pulls.big", b"x" * 300)
    await publish(js, range(5), size=100)
    async with Pull(bus, STREAM, CONSUMER, max_ahead=64) as pull:
        got: list[list[int]] = []
        while sum(map(len, got)) < 6:
            batch = await pull.fetch(10, timeout_s=WITHIN_S, max_bytes=250, overhead=10)
            assert batch, f"nothing within {WITHIN_S}s after {got}"
            got.append([len(m.data) for m in batch])
            for inbound in batch:
                await inbound.ack()
    # One alone over the budget; then at most two of 100 + 10 bytes at a time.
    assert got[0] == [300]
    assert all(sizes in ([100, 100], [100]) for sizes in got[1:]), got
    assert sum(map(len, got)) == 6


def test_a_heartbeat_longer_than_half_the_expiry_is_refused_before_the_server_does(
    bus: Bus,
) -> None:
    with pytest.raises(ConfigError, match="heartbeat_s"):
        Pull(bus, STREAM, CONSUMER, max_ahead=1, expires_s=1.0, heartbeat_s=0.6)


# --- The statuses ----------------------------------------------------------------------------


async def test_100_idle_heartbeats_keep_a_long_pull_alive(
    bus: Bus, js: JetStreamContext, requests: Requests, lost: Logged
) -> None:
    async with Pull(bus, STREAM, CONSUMER, max_ahead=4, heartbeat_s=0.3) as pull:
        # Eight heartbeat intervals with nothing to deliver: one request, kept.
        assert await pull.fetch(1, timeout_s=2.4) == []
        assert [body["idle_heartbeat"] for body in requests.bodies] == [300_000_000]
        await publish(js, range(1))
        [message] = await pull.fetch(1, timeout_s=WITHIN_S)

    assert message.data == b"0"
    assert not lost.seen.is_set()


async def test_missed_heartbeats_make_the_pull_ask_again(
    nats_server: EmbeddedNats, bus: Bus, js: JetStreamContext, requests: Requests, lost: Logged
) -> None:
    async with Pull(bus, STREAM, CONSUMER, max_ahead=4, heartbeat_s=0.1) as pull:
        fetching = asyncio.create_task(pull.fetch(1, timeout_s=30))
        await requests.wait_for(1)
        assert nats_server.pid is not None
        # A stalled server sends no heartbeat; to the Pull, its request may be lost.
        os.kill(nats_server.pid, signal.SIGSTOP)
        try:
            await asyncio.wait_for(lost.seen.wait(), WITHIN_S)
        finally:
            os.kill(nats_server.pid, signal.SIGCONT)
        await requests.wait_for(2)
        await publish(js, range(1))
        [message] = await asyncio.wait_for(fetching, WITHIN_S)
    assert message.data == b"0"


async def test_404_a_no_wait_pull_returns_at_once_from_an_empty_consumer(
    bus: Bus, js: JetStreamContext, requests: Requests
) -> None:
    async with Pull(bus, STREAM, CONSUMER, max_ahead=10, no_wait=True) as pull:
        async with asyncio.timeout(WITHIN_S):
            assert await pull.fetch(10, timeout_s=60) == []
        await publish(js, range(3))
        async with asyncio.timeout(WITHIN_S):
            got = await drain(pull, 3, max_messages=10)
            assert await pull.fetch(10, timeout_s=60) == []

    assert [m.data for m in got] == [b"0", b"1", b"2"]
    assert all(body["no_wait"] and "expires" not in body for body in requests.bodies)


async def test_408_an_expired_request_is_asked_again(
    bus: Bus, js: JetStreamContext, requests: Requests, lost: Logged
) -> None:
    async with Pull(bus, STREAM, CONSUMER, max_ahead=4, expires_s=0.3, heartbeat_s=0) as pull:
        fetching = asyncio.create_task(pull.fetch(1, timeout_s=60))
        # The first request and two more, each after the one before expired.
        await requests.wait_for(3, within=4.0)
        await publish(js, range(1))
        [message] = await asyncio.wait_for(fetching, WITHIN_S)

    assert message.data == b"0"
    assert not lost.seen.is_set()  # asked again on the 408, not after counting it lost
    assert {body["expires"] for body in requests.bodies} == {300_000_000}


async def test_409_a_consumer_deleted_under_a_waiting_pull_is_a_bus_error(
    bus: Bus, js: JetStreamContext
) -> None:
    async with Pull(bus, STREAM, CONSUMER, max_ahead=4) as pull:
        fetching = asyncio.create_task(pull.fetch(1, timeout_s=60))
        await until_consumer(js, CONSUMER, "waited on", lambda i: i.num_waiting == 1)
        await js.delete_consumer(STREAM, CONSUMER)
        with pytest.raises(BusError, match="409 Consumer Deleted: the consumer is gone"):
            await asyncio.wait_for(fetching, WITHIN_S)
        # Asking again finds no consumer at all.
        with pytest.raises(BusError, match="no such consumer"):
            await pull.fetch(1, timeout_s=WITHIN_S)


async def test_409_a_message_larger_than_max_bytes_is_a_bus_error(
    bus: Bus, js: JetStreamContext
) -> None:
    await publish(js, range(1), size=1000)
    async with Pull(bus, STREAM, CONSUMER, max_ahead=4, max_bytes=500) as pull:
        with pytest.raises(BusError, match=r"409 Message Size Exceeds MaxBytes.*max_bytes \(500\)"):
            await pull.fetch(1, timeout_s=WITHIN_S)


async def test_409_a_request_filled_to_max_bytes_is_followed_by_another(
    bus: Bus, js: JetStreamContext, requests: Requests
) -> None:
    await publish(js, range(5), size=200)  # about 240 bytes each with subject and metadata
    async with Pull(bus, STREAM, CONSUMER, max_ahead=10, max_bytes=600) as pull:
        got = await drain(pull, 5, max_messages=5)

    assert [m.stream_seq for m in got] == [1, 2, 3, 4, 5]
    await requests.wait_for(3)  # two messages fit in each request
    assert {body["max_bytes"] for body in requests.bodies} == {600}


async def test_409_exceeded_max_waiting_is_a_bus_error(bus: Bus, js: JetStreamContext) -> None:
    await add_consumer(js, "narrow", max_waiting=1)
    async with (
        Pull(bus, STREAM, "narrow", max_ahead=4) as first,
        # nats-server drops a request with heartbeats without a word when the consumer has no
        # room for it (the Pull then counts it lost); it answers one without them with a 409.
        Pull(bus, STREAM, "narrow", max_ahead=4, heartbeat_s=0) as second,
    ):
        waiting = asyncio.create_task(first.fetch(1, timeout_s=60))
        await until_consumer(js, "narrow", "waited on", lambda i: i.num_waiting == 1)
        with pytest.raises(BusError, match="409 Exceeded MaxWaiting"):
            await second.fetch(1, timeout_s=WITHIN_S)
        waiting.cancel()


async def test_423_a_pull_with_another_clients_pin_id_gets_pin_mismatch(
    nats_server: EmbeddedNats, bus: Bus, js: JetStreamContext, requests: Requests
) -> None:
    # nats-py 2.16 has no priority-group fields in ConsumerConfig: the raw API request.
    create = {
        "stream_name": STREAM,
        "config": {
            "name": "pinned",
            "durable_name": "pinned",
            "ack_policy": "explicit",
            "priority_policy": "pinned_client",
            "priority_groups": ["g"],
            "priority_timeout": 30 * 1_000_000_000,
        },
    }
    nc = await nats.connect(nats_server.url)
    try:
        reply = await nc.request(
            f"$JS.API.CONSUMER.CREATE.{STREAM}.pinned", json.dumps(create).encode(), timeout=5
        )
    finally:
        await nc.close()
    assert "error" not in json.loads(reply.data), reply.data
    await publish(js, range(1))
    # A publisher's own `Nats-Pin-Id` rides along; the server adds its own after it.
    await js.publish("pulls.1", b"1", headers={"Nats-Pin-Id": "forged"})

    async with Pull(bus, STREAM, "pinned", max_ahead=1, group="g") as holder:
        [first] = await holder.fetch(1, timeout_s=WITHIN_S)
        pin = holder.pin_id
        assert pin  # the server pinned the first client to ask, and said so on the message
        async with Pull(bus, STREAM, "pinned", max_ahead=1, group="g", pin_id="not-it") as other:
            with pytest.raises(PinMismatch, match=r"423 .*priority group 'g'"):
                await other.fetch(1, timeout_s=WITHIN_S)
            assert other.pin_id is None  # it asks to be pinned anew next time
        [second] = await holder.fetch(1, timeout_s=WITHIN_S)  # the holder pulls on
        assert holder.pin_id == pin

    assert [first.data, second.data] == [b"0", b"1"]
    await requests.wait_for(3)  # the holder's two and the other's one
    others = [body for body in requests.bodies if body.get("id") == "not-it"]
    holders = [body for body in requests.bodies if body.get("id") != "not-it"]
    assert len(others) == 1 and others[0]["group"] == "g"
    # The holder asked once to be pinned, then with its pin every time.
    assert holders[0]["group"] == "g" and "id" not in holders[0]
    assert {body.get("id") for body in holders[1:]} == {pin}


# --- Settling while NATS is down --------------------------------------------------------------


async def test_settling_while_nats_is_down_is_a_bus_error_and_the_input_comes_back(
    nats_server: EmbeddedNats, bus: Bus, js: JetStreamContext
) -> None:
    await add_consumer(js, "brief", ack_wait=1.0)
    await publish(js, range(1))
    async with Pull(bus, STREAM, "brief", max_ahead=1) as pull:
        [inbound] = await pull.fetch(1, timeout_s=WITHIN_S)
        nats_server.stop()
        await until(lambda: not bus.is_connected, "the bus noticed NATS stop", every=0.02)
        refused = await fill_the_reconnect_buffer(bus)
        assert "publish to filler failed" in str(refused)
        assert isinstance(refused.__cause__, nats.errors.OutboundBufferLimitError)
        settlings: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("ack", inbound.ack),
            ("nak", partial(inbound.nak, 0.1)),
        ]
        for how, settle in settlings:
            with pytest.raises(BusError, match=rf"{how} of input pulls\.0 \(stream seq 1\)") as e:
                await settle()
            assert isinstance(e.value.__cause__, nats.errors.OutboundBufferLimitError)

        nats_server.start()
        # JetStream never heard of the ack: the input comes back once its ack wait is over.
        [again] = await pull.fetch(1, timeout_s=30)
        assert (again.stream_seq, again.deliveries) == (1, 2)
        await again.ack()
    await until_consumer(js, "brief", "acknowledged", lambda i: i.num_ack_pending == 0)


async def fill_the_reconnect_buffer(bus: Bus) -> BusError:
    """While NATS is away, nats-py keeps what is published, up to its buffer's size (2 MiB by
    default); then it refuses, in its own terms, which the bus translates. Publish until not
    one byte more is taken, and return the last refusal."""
    size = 256 * 1024
    refused: BusError | None = None
    while size:
        try:
            await bus.publish("filler", bytes(size))
        except BusError as exc:
            refused = exc
            size //= 2
    assert refused is not None
    return refused


async def test_settling_on_a_closed_bus_is_a_bus_error(
    nats_server: EmbeddedNats, js: JetStreamContext
) -> None:
    await publish(js, range(1))
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test-pull-closed")
    pull = Pull(bus, STREAM, CONSUMER, max_ahead=1)
    await pull.start()
    [inbound] = await pull.fetch(1, timeout_s=WITHIN_S)
    await bus.close()
    with pytest.raises(BusError, match=r"ack of input pulls\.0") as e:
        await inbound.ack()
    assert isinstance(e.value.__cause__, nats.errors.ConnectionClosedError)


async def test_a_refusal_of_the_jetstream_api_reads_alike_through_either_path(
    bus: Bus, js: JetStreamContext
) -> None:
    """The bus asks the JetStream API through nats-py (`ack_floor`) or raw (`unpin`, for what
    nats-py cannot ask): a stream that does not exist is refused in the same words by both."""
    with pytest.raises(BusError) as through_nats_py:
        await ack_floor(bus, "ABSENT", CONSUMER)
    with pytest.raises(BusError) as raw:
        await unpin(bus, "ABSENT", CONSUMER, "owner")
    refusal = "code=404 err_code=10059 description='stream not found'"
    assert str(through_nats_py.value).endswith(refusal), through_nats_py.value
    assert str(raw.value).endswith(refusal), raw.value
    assert isinstance(raw.value.__cause__, nats.js.errors.APIError)


async def test_a_reconnect_makes_the_pull_ask_again_at_once(
    nats_server: EmbeddedNats, bus: Bus, js: JetStreamContext, lost: Logged
) -> None:
    # Heartbeats every 5 s: without the reconnect, it would count its request lost after 10.
    async with Pull(bus, STREAM, CONSUMER, max_ahead=4, heartbeat_s=5.0) as pull:
        assert await pull.fetch(1, timeout_s=0) == []  # asks, and returns at once
        await until_consumer(js, CONSUMER, "waited on", lambda i: i.num_waiting == 1)
        # SIGKILL: no "409 Server Shutdown" says that the request is gone.
        nats_server.stop(kill=True)
        await until_connected(bus, False)
        nats_server.start()
        await until_connected(bus, True)
        await publish(js, range(1))
        [message] = await pull.fetch(1, timeout_s=5.0)
    assert message.data == b"0"
    assert not lost.seen.is_set()


async def until_connected(bus: Bus, connected: bool) -> None:
    await until(
        lambda: bus.is_connected == connected,
        f"the bus {'dis' * (not connected)}connected",
        within=WITHIN_S,
        every=0.02,
    )


@pytest.mark.slow
async def test_the_worker_lives_through_nats_killed_while_it_acknowledges(
    nats_server: EmbeddedNats, engines: ScriptedEngines, tmp_path: Path
) -> None:
    # Small batches, so that the worker always holds inputs it has yet to commit and
    # acknowledge: it acknowledges some of them while NATS is away. SIGKILL, so that no
    # "409 Server Shutdown" tells its Pull that the requests are gone: only the reconnect does.
    worker = WorkerProcess(nats_server.url, tmp_path / "kvhandoff.db", "--batch-size", "8")
    worker.start()
    try:
        starts = make_starts(300, random.Random(11))
        for start in starts:
            await engines.start_handoff(start)
        await engines.until(lambda: len(engines.first) >= 300, "a sixth of the load")
        nats_server.stop(kill=True)
        await until(
            lambda: "disconnected from NATS" in worker.logs(),
            "the worker noticed NATS stop",
            within=WITHIN_S,
            context=worker.logs,
        )
        nats_server.start()

        await wait_closed(worker.db, len(starts))
        assert worker.process is not None and worker.process.poll() is None, worker.logs()
        logs = worker.logs()
        assert "Traceback" not in logs
        assert LOST not in logs  # the reconnect made its Pull ask again at once
        assert not engines.mismatched
        assert set(engines.effects.values()) == {1}
        for start in starts:
            assert find_divergence(logged(worker.db, start.handoff_id).records()) is None
        assert worker.terminate() == 0
    finally:
        worker.stop()
