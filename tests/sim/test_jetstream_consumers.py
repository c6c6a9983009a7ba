"""The JetStream model's consumers, driven directly: a hub that records what they send, a
stream in memory, and a loop whose clock moves only when a test advances it."""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVarTuple

import msgspec
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy

from kvhandoff.worker import ambient
from kvhandoff.worker.sim.nats.jetstream.api import Stored
from kvhandoff.worker.sim.nats.jetstream.consumers import Consumers

_Ts = TypeVarTuple("_Ts")
_S = 1_000_000_000
_START = 1000.0
_EPOCH_NS = 1_700_000_000 * _S


class ManualLoop(asyncio.AbstractEventLoop):
    """The loop the consumers see: `time`, `call_at`, `call_later`, and nothing runs until
    `advance` moves the clock past a timer."""

    def __init__(self) -> None:
        self.now = _START
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._order = 0
        self.failures: list[dict[str, Any]] = []

    def time(self) -> float:
        return self.now

    def call_at(
        self,
        when: float,
        callback: Callable[[*_Ts], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(when, callback, args, self, context)
        self._order += 1
        heapq.heappush(self._timers, (when, self._order, handle))
        return handle

    def call_later(
        self,
        delay: float,
        callback: Callable[[*_Ts], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        return self.call_at(self.now + delay, callback, *args, context=context)

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        pass

    def get_debug(self) -> bool:
        return False

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        self.failures.append(context)

    def advance(self, seconds: float) -> None:
        """Run every timer due within `seconds`, in time order, the clock at each."""
        until = self.now + seconds
        while self._timers and self._timers[0][0] <= until:
            when, _, handle = heapq.heappop(self._timers)
            if handle.cancelled():
                continue
            self.now = max(self.now, when)
            handle._run()
            assert not self.failures, self.failures
        self.now = until


class LoopAmbient(ambient.Ambient):
    """A wall clock that is the loop's, from a fixed epoch."""

    def __init__(self, loop: ManualLoop) -> None:
        self._loop = loop

    def wall_ns(self) -> int:
        return _EPOCH_NS + int((self._loop.now - _START) * _S)


@dataclass
class Sent:
    subject: str
    payload: bytes
    reply: str
    headers: dict[str, str]
    status: str
    as_subject: str


@dataclass
class RecordingHub:
    sent: list[Sent] = field(default_factory=list)
    interest: set[str] = field(default_factory=set)

    def send(
        self,
        subject: str,
        payload: bytes = b"",
        *,
        reply: str = "",
        headers: Mapping[str, str] | None = None,
        status: str = "",
        as_subject: str = "",
    ) -> None:
        self.sent.append(Sent(subject, payload, reply, dict(headers or {}), status, as_subject))

    def has_interest(self, subject: str) -> bool:
        return subject in self.interest

    def to(self, subject: str) -> list[Sent]:
        """What went to `subject`, and forget it."""
        found = [s for s in self.sent if s.subject == subject]
        self.sent = [s for s in self.sent if s.subject != subject]
        return found


def _matches(subject: str, pattern: str) -> bool:
    tokens, wanted = subject.split("."), pattern.split(".")
    for i, want in enumerate(wanted):
        if want == ">":
            return len(tokens) > i
        if i >= len(tokens) or (want != "*" and want != tokens[i]):
            return False
    return len(tokens) == len(wanted)


class MemoryStream:
    """A StreamView over a list."""

    def __init__(self, name: str, retention: str = "limits") -> None:
        self._name = name
        self._config = {"name": name, "retention": retention}
        self.messages: dict[int, Stored] = {}
        self._last = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def config(self) -> Mapping[str, Any]:
        return self._config

    def store(self, subject: str, payload: bytes, wall_ns: int) -> Stored:
        self._last += 1
        stored = Stored(self._last, subject, None, payload, wall_ns)
        self.messages[stored.seq] = stored
        return stored

    def first_seq(self) -> int:
        return min(self.messages, default=self._last + 1)

    def last_seq(self) -> int:
        return self._last

    def get(self, seq: int) -> Stored | None:
        return self.messages.get(seq)

    def _after(self, seq: int, filters: Sequence[str]) -> Iterator[Stored]:
        for at in sorted(s for s in self.messages if s > seq):
            stored = self.messages[at]
            if not filters or any(_matches(stored.subject, f) for f in filters):
                yield stored

    def next_after(self, seq: int, filters: Sequence[str]) -> Stored | None:
        return next(self._after(seq, filters), None)

    def count_after(self, seq: int, filters: Sequence[str]) -> int:
        return sum(1 for _ in self._after(seq, filters))

    def remove(self, seq: int) -> bool:
        return self.messages.pop(seq, None) is not None


class World:
    """The consumers, their hub, one stream, the loop: and the calls a client makes."""

    def __init__(self, retention: str = "limits") -> None:
        # Only what the consumers call is there: typeshed calls the rest abstract.
        self.loop = ManualLoop()  # type: ignore[abstract]
        self.hub = RecordingHub()
        self.stream = MemoryStream("S", retention)
        self.consumers = Consumers(self.hub, random.Random(7), {"S": self.stream})
        self._inbox = 0

    def publish(self, subject: str, payload: bytes = b"x") -> Stored:
        stored = self.stream.store(subject, payload, LoopAmbient(self.loop).wall_ns())
        self.consumers.on_stored(self.stream, stored)
        return stored

    def api(self, subject: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        reply = self.inbox()
        payload = b"" if body is None else msgspec.json.encode(body)
        self.consumers.on_publish(f"$JS.API.CONSUMER.{subject}", reply, None, payload)
        (answer,) = self.hub.to(reply)
        decoded: dict[str, Any] = msgspec.json.decode(answer.payload)
        return decoded

    def create(self, name: str, **config: Any) -> dict[str, Any]:
        config = {
            "name": name,
            "durable_name": name,
            "ack_policy": "explicit",
            "deliver_policy": "all",
            "num_replicas": 0,
        } | config
        return self.api(f"CREATE.S.{name}", {"stream_name": "S", "config": config})

    def info(self, name: str) -> ConsumerInfo:
        info: ConsumerInfo = ConsumerInfo.from_response(self.api(f"INFO.S.{name}"))
        return info

    def floors(self, name: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """(ack floor, delivered), each as (stream sequence, consumer sequence)."""
        info = self.info(name)
        assert info.ack_floor is not None and info.delivered is not None
        return (
            (info.ack_floor.stream_seq, info.ack_floor.consumer_seq),
            (info.delivered.stream_seq, info.delivered.consumer_seq),
        )

    def inbox(self) -> str:
        self._inbox += 1
        subject = f"_INBOX.{self._inbox}"
        self.hub.interest.add(subject)
        return subject

    def pull(self, consumer: str, **request: Any) -> str:
        """Publish a pull request; its reply subject."""
        reply = self.inbox()
        body = {"batch": 1} | request
        self.consumers.on_publish(
            f"$JS.API.CONSUMER.MSG.NEXT.S.{consumer}", reply, None, msgspec.json.encode(body)
        )
        return reply

    def settle(self, delivery: Sent, how: bytes = b"+ACK", reply: str = "") -> None:
        self.consumers.on_publish(delivery.reply, reply, None, how)


@pytest.fixture
def world() -> Iterator[World]:
    made = World()
    asyncio._set_running_loop(made.loop)
    try:
        with ambient.using(LoopAmbient(made.loop)):
            yield made
    finally:
        asyncio._set_running_loop(None)


@pytest.fixture
def work_queue() -> Iterator[World]:
    made = World("workqueue")
    asyncio._set_running_loop(made.loop)
    try:
        with ambient.using(LoopAmbient(made.loop)):
            yield made
    finally:
        asyncio._set_running_loop(None)


def _messages(sent: list[Sent]) -> list[Sent]:
    return [s for s in sent if not s.status]


def _seqs(sent: list[Sent]) -> list[tuple[int, int]]:
    """(stream sequence, delivery count) of each message, from its ack subject."""
    found = []
    for delivery in _messages(sent):
        tokens = delivery.reply.split(".")
        found.append((int(tokens[5]), int(tokens[4])))
    return found


_PINNED = {
    "priority_groups": ["owner"],
    "priority_policy": "pinned_client",
    "priority_timeout": 10 * _S,
}


def test_a_created_consumer_parses_in_nats_py_and_echoes_its_config(world: World) -> None:
    created = world.create("C", filter_subject="in.>", ack_wait=7 * _S, **_PINNED)
    info = ConsumerInfo.from_response(created)
    assert info.name == "C" and info.stream_name == "S"
    assert info.config.ack_wait == 7.0 and info.config.filter_subject == "in.>"
    assert info.config.max_ack_pending == 1000 and info.config.max_deliver == -1
    assert info.config.metadata is not None
    assert info.config.metadata["_nats.req.level"] == "1"
    assert created["priority_groups"] == [{"group": "owner", "pinned_ts": "0001-01-01T00:00:00Z"}]
    # The same config again: the same consumer; another deliver policy: refused.
    assert world.create("C", filter_subject="in.>", ack_wait=7 * _S, **_PINNED)["name"] == "C"
    refused = world.create("C", filter_subject="in.>", deliver_policy="new", **_PINNED)
    assert refused["error"]["err_code"] == 10012
    assert "deliver policy" in refused["error"]["description"]
    # A changed ack wait is an update.
    world.create("C", filter_subject="in.>", ack_wait=9 * _S, **_PINNED)
    assert world.info("C").config.ack_wait == 9.0
    assert world.api("NAMES.S")["consumers"] == ["C"]
    assert world.api("INFO.S.D")["error"]["err_code"] == 10014


def test_the_first_client_delivered_to_is_pinned_and_another_id_gets_423(world: World) -> None:
    world.create("C", **_PINNED)
    world.publish("in.1")
    first = world.pull("C", group="owner", expires=30 * _S)
    (delivered,) = world.hub.to(first)
    pin = delivered.headers["Nats-Pin-Id"]
    assert delivered.as_subject == "in.1" and len(pin) == 22
    info = world.api("INFO.S.C")
    assert info["priority_groups"][0]["pinned_client_id"] == pin
    # Another client without an id waits; with another id it is refused at once.
    other = world.pull("C", group="owner", expires=30 * _S)
    refused = world.pull("C", group="owner", id="not-the-pin", expires=30 * _S)
    assert [s.status for s in world.hub.to(refused)] == ["423 Nats-Pin-Id mismatch"]
    world.publish("in.2")
    assert world.hub.to(other) == []
    again = world.pull("C", group="owner", id=pin, expires=30 * _S)
    (second,) = world.hub.to(again)
    assert second.as_subject == "in.2" and second.headers["Nats-Pin-Id"] == pin
    # A request without the group: 400.
    missing = world.pull("C", expires=30 * _S)
    assert [s.status for s in world.hub.to(missing)] == ["400 Bad Request - Priority Group missing"]


def test_the_pin_is_dropped_after_the_priority_timeout_without_a_request(world: World) -> None:
    world.create("C", **_PINNED)
    world.publish("in.1")
    pinned = world.pull("C", group="owner", expires=60 * _S)
    pin = world.hub.to(pinned)[0].headers["Nats-Pin-Id"]
    world.loop.advance(6)
    # A request with the pin restarts its timer: 10 s from now, not from the pin.
    world.pull("C", group="owner", id=pin, expires=60 * _S)
    world.loop.advance(9)
    assert world.api("INFO.S.C")["priority_groups"][0].get("pinned_client_id") == pin
    world.loop.advance(1)
    assert "pinned_client_id" not in world.api("INFO.S.C")["priority_groups"][0]
    # The next puller without an id is pinned anew; the old pin's waiting request gets 423.
    newcomer = world.pull("C", group="owner", expires=60 * _S)
    world.publish("in.2")
    sent = world.hub.sent
    statuses = [s.status for s in sent if s.status]
    assert "423 Nats-Wrong-Pin-Id" in statuses
    (taken,) = world.hub.to(newcomer)
    assert taken.headers["Nats-Pin-Id"] not in ("", pin)


def test_unpin_lets_the_next_puller_be_pinned_at_once(world: World) -> None:
    world.create("C", **_PINNED)
    world.publish("in.1")
    pin = world.hub.to(world.pull("C", group="owner", expires=60 * _S))[0].headers["Nats-Pin-Id"]
    old = world.pull("C", group="owner", id=pin, expires=60 * _S)
    assert world.api("UNPIN.S.C", {"group": "owner"}) == {
        "type": "io.nats.jetstream.api.v1.consumer_unpin_response"
    }
    assert world.api("UNPIN.S.C", {"group": "nobody"})["error"]["err_code"] == 10160
    newcomer = world.pull("C", group="owner", expires=60 * _S)
    world.publish("in.2")
    assert [s.status for s in world.hub.to(old)] == ["423 Nats-Wrong-Pin-Id"]
    (taken,) = world.hub.to(newcomer)
    assert taken.headers["Nats-Pin-Id"] != pin


def test_redelivery_follows_the_order_the_ack_waits_ran_out(world: World) -> None:
    world.create("C", ack_wait=10 * _S)
    for n in range(1, 5):
        world.publish(f"in.{n}")
    first = world.pull("C", batch=4, expires=60 * _S)
    deliveries = _messages(world.hub.to(first))
    assert _seqs(deliveries) == [(1, 1), (2, 1), (3, 1), (4, 1)]
    world.loop.advance(2)
    world.settle(deliveries[3])  # 4, out of order
    world.loop.advance(3)
    world.settle(deliveries[2], b"+WPI")  # 3's wait now runs out at 15
    world.loop.advance(1)
    world.settle(deliveries[0], b"+WPI")  # 1's at 16
    world.publish("in.5")  # newer, and no request waits for it
    world.loop.advance(10)  # now 16: 2, then 3, then 1 ran out
    info = world.info("C")
    assert info.num_ack_pending == 3
    assert world.floors("C")[0] == (0, 0)
    again = world.pull("C", batch=4, expires=60 * _S)
    assert _seqs(world.hub.to(again)) == [(2, 2), (3, 2), (1, 2), (5, 1)]


def test_an_ack_floor_moves_only_over_what_is_settled(world: World) -> None:
    world.create("C", ack_wait=10 * _S)
    for n in range(1, 4):
        world.publish(f"in.{n}")
    deliveries = _messages(world.hub.to(world.pull("C", batch=3, expires=60 * _S)))
    world.settle(deliveries[1])
    assert world.floors("C")[0] == (0, 0)
    world.settle(deliveries[0], reply="_INBOX.ack")
    assert [s.payload for s in world.hub.to("_INBOX.ack")] == [b""]
    assert world.floors("C") == ((2, 2), (3, 3))
    world.settle(deliveries[2], b"+TERM")
    assert world.floors("C")[0] == (3, 3)
    # Settled twice: nothing changes.
    world.settle(deliveries[0])
    assert world.info("C").num_ack_pending == 0


def test_nak_redelivers_at_once_or_after_its_delay(world: World) -> None:
    world.create("C", ack_wait=30 * _S)
    world.publish("in.1")
    world.publish("in.2")
    deliveries = _messages(world.hub.to(world.pull("C", batch=2, expires=60 * _S)))
    world.settle(deliveries[0], b'-NAK {"delay": 3000000000}')
    world.settle(deliveries[1], b"-NAK")
    waiting = world.pull("C", batch=5, expires=60 * _S)
    assert _seqs(world.hub.to(waiting)) == [(2, 2)]
    world.loop.advance(2)
    assert world.hub.to(waiting) == []
    world.loop.advance(1)
    assert _seqs(world.hub.to(waiting)) == [(1, 2)]


def test_an_ack_removes_the_message_from_a_work_queue_stream(work_queue: World) -> None:
    work_queue.create("C", filter_subject="in.>")
    work_queue.publish("in.1")
    work_queue.publish("in.2")
    deliveries = _messages(work_queue.hub.to(work_queue.pull("C", batch=2, expires=60 * _S)))
    work_queue.settle(deliveries[1])
    work_queue.settle(deliveries[0], b"-NAK")
    assert sorted(work_queue.stream.messages) == [1]
    # A second consumer over the same subjects is refused, as the server refuses it.
    overlapping = work_queue.create("D", filter_subject="in.1")
    assert overlapping["error"]["err_code"] == 10100


def test_a_request_expires_with_408_and_what_it_never_got(world: World) -> None:
    world.create("C")
    world.publish("in.1")
    reply = world.pull("C", batch=5, expires=2 * _S)
    assert len(_messages(world.hub.sent)) == 1
    world.loop.advance(2)
    timeout = [s for s in world.hub.to(reply) if s.status]
    assert [(s.status, s.headers["Nats-Pending-Messages"]) for s in timeout] == [
        ("408 Request Timeout", "4")
    ]
    assert world.info("C").num_waiting == 0


def test_heartbeats_come_each_interval_without_a_delivery(world: World) -> None:
    world.create("C")
    reply = world.pull("C", batch=5, expires=5 * _S, idle_heartbeat=1 * _S)
    world.loop.advance(1.5)
    world.publish("in.1")  # a delivery: the next heartbeat is an interval after it
    world.loop.advance(3.5)
    sent = world.hub.to(reply)
    # At 1, then 1.5 (the message), 2.5, 3.5 and 4.5; at 5 the request expires.
    assert [s.status or "message" for s in sent] == [
        "100 Idle Heartbeat",
        "message",
        "100 Idle Heartbeat",
        "100 Idle Heartbeat",
        "100 Idle Heartbeat",
        "408 Request Timeout",
    ]
    assert sent[2].headers["Nats-Last-Consumer"] == "1"
    too_often = world.pull("C", expires=2 * _S, idle_heartbeat=int(1.5 * _S))
    assert [s.status for s in world.hub.to(too_often)] == [
        "400 Bad Request - heartbeat value too large"
    ]


def test_no_wait_ends_with_404_and_a_gone_consumer_with_409(world: World) -> None:
    world.create("C")
    empty = world.pull("C", no_wait=True)
    assert [s.status for s in world.hub.to(empty)] == ["404 No Messages"]
    world.publish("in.1")
    some = world.pull("C", batch=3, no_wait=True)
    assert [s.status or "message" for s in world.hub.to(some)] == ["message", "404 No Messages"]
    waiting = world.pull("C", expires=60 * _S)
    assert world.api("DELETE.S.C") == {
        "type": "io.nats.jetstream.api.v1.consumer_delete_response",
        "success": True,
    }
    assert [s.status for s in world.hub.to(waiting)] == ["409 Consumer Deleted"]
    gone = world.pull("C", expires=60 * _S)
    assert [s.status for s in world.hub.to(gone)] == ["503"]


def test_a_request_whose_inbox_went_away_is_skipped(world: World) -> None:
    world.create("C")
    gone = world.pull("C", expires=60 * _S)
    alive = world.pull("C", expires=60 * _S)
    world.hub.interest.discard(gone)
    world.publish("in.1")
    assert world.hub.to(gone) == [] and len(world.hub.to(alive)) == 1


def test_max_ack_pending_holds_new_messages_back(world: World) -> None:
    world.create("C", max_ack_pending=1)
    world.publish("in.1")
    world.publish("in.2")
    reply = world.pull("C", batch=2, expires=60 * _S)
    (first,) = _messages(world.hub.to(reply))
    world.settle(first)
    assert _seqs(world.hub.to(reply)) == [(2, 1)]


@pytest.mark.parametrize("accepted", [False, True])
def test_an_ack_after_its_ack_wait(world: World, accepted: bool) -> None:
    world.consumers.faults.late_acks_accepted = accepted
    world.create("C", ack_wait=5 * _S)
    world.publish("in.1")
    (delivery,) = _messages(world.hub.to(world.pull("C", expires=60 * _S)))
    world.loop.advance(6)
    world.settle(delivery)
    again = world.pull("C", expires=60 * _S)
    assert _seqs(world.hub.to(again)) == ([] if accepted else [(1, 2)])
    assert world.info("C").num_ack_pending == (0 if accepted else 1)


def test_pins_may_overlap_when_the_fault_is_on(world: World) -> None:
    world.consumers.faults.pin_overlap_s = 5.0
    world.create("C", **_PINNED)
    world.publish("in.1")
    pin = world.hub.to(world.pull("C", group="owner", expires=60 * _S))[0].headers["Nats-Pin-Id"]
    world.api("UNPIN.S.C", {"group": "owner"})
    newcomer = world.pull("C", group="owner", expires=60 * _S)
    world.publish("in.2")
    assert world.hub.to(newcomer)[0].headers["Nats-Pin-Id"] != pin
    stale = world.pull("C", group="owner", id=pin, expires=60 * _S)
    world.publish("in.3")
    (both,) = world.hub.to(stale)
    assert both.headers["Nats-Pin-Id"] == pin


def test_an_ordered_push_consumer_as_nats_py_makes_it(world: World) -> None:
    for key, value in [("a", b"1"), ("b", b"2"), ("a", b"3")]:
        world.publish(f"$KV.B.{key}", value)
    config = ConsumerConfig(
        filter_subject="$KV.B.>",
        deliver_subject="_INBOX.watch",
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        flow_control=True,
        ack_policy=AckPolicy.NONE,
        max_deliver=1,
        ack_wait=22 * 3600,
        idle_heartbeat=5,
        num_replicas=1,
        mem_storage=True,
    )
    reply = world.inbox()
    world.consumers.on_publish(
        "$JS.API.CONSUMER.CREATE.S",
        reply,
        None,
        msgspec.json.encode({"stream_name": "S", "config": config.as_dict()}),
    )
    info = ConsumerInfo.from_response(msgspec.json.decode(world.hub.to(reply)[0].payload))
    assert info.config.inactive_threshold == 5.0 and info.config.flow_control
    # It delivers once the deliver subject has interest (nats-py subscribes after create).
    assert world.hub.to("_INBOX.watch") == []
    world.hub.interest.add("_INBOX.watch")
    world.loop.advance(0.002)
    sent = world.hub.to("_INBOX.watch")
    assert [(s.as_subject, s.payload, int(s.reply.split(".")[8])) for s in sent] == [
        ("$KV.B.b", b"2", 1),
        ("$KV.B.a", b"3", 0),
    ]
    world.publish("$KV.B.c", b"4")
    assert [s.as_subject for s in world.hub.to("_INBOX.watch")] == ["$KV.B.c"]
    world.loop.advance(5)
    (beat,) = world.hub.to("_INBOX.watch")
    assert beat.status == "100 Idle Heartbeat" and beat.headers["Nats-Last-Consumer"] == "3"
    # Without interest for its inactive threshold, it is gone.
    world.hub.interest.discard("_INBOX.watch")
    world.loop.advance(11)
    assert world.api(f"INFO.S.{info.name}")["error"]["err_code"] == 10014


def test_push_flow_control_waits_for_its_answer(world: World) -> None:
    world.hub.interest.add("_INBOX.push")
    world.create(
        "P",
        deliver_subject="_INBOX.push",
        ack_policy="none",
        flow_control=True,
        idle_heartbeat=5 * _S,
    )
    big = b"x" * (600 * 1024)
    for n in range(5):
        world.publish(f"in.{n}", big)
    # Past half of the 2 MiB window, a request; past the window, nothing more.
    sent = world.hub.to("_INBOX.push")
    assert [s.status or "message" for s in sent] == [
        "message",
        "message",
        "100 FlowControl Request",
        "message",
        "message",
    ]
    request = sent[2]
    assert request.reply.startswith("$JS.FC.S.P.")
    world.loop.advance(5)
    (stalled,) = world.hub.to("_INBOX.push")
    assert stalled.headers["Nats-Consumer-Stalled"] == request.reply
    world.consumers.on_publish(request.reply, "", None, b"")
    assert len(_messages(world.hub.to("_INBOX.push"))) == 1


def test_an_idle_ephemeral_pull_consumer_is_deleted(world: World) -> None:
    created = world.api("CREATE.S", {"stream_name": "S", "config": {"ack_policy": "explicit"}})
    name = created["name"]
    assert created["config"]["inactive_threshold"] == 5 * _S
    world.loop.advance(4.9)
    assert "error" not in world.api(f"INFO.S.{name}")
    world.loop.advance(1.2)
    assert world.api(f"INFO.S.{name}")["error"]["err_code"] == 10014
