"""The JetStream model's streams, driven through `JetStream.on_publish` as the simulated core
drives it, and read back through nats-py's own client code.

`ModelClient` is a nats-py `Client` whose `request` publishes to the model and returns what the
model answered on the reply subject (a 503 no-responders when nothing took the request, a
timeout when JetStream took it and answered nothing), so `JetStreamContext` and
`JetStreamManager` run their real parsing (`StreamInfo.from_response`, `PubAck`, `RawStreamMsg`,
direct gets) over the model's answers, with the tier's own requests (worker.bus, the stream
configurations nats-py builds from `StreamConfig`). Time is a `SteppedClock` that a test
advances: expiry runs when the test says time passed, with no sleep.

The partition transform is held to a real nats-server: the test stores ids through the tier's
transform on both and compares the subjects each stored them under.
"""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AccountInfo,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StreamConfig,
    SubjectTransform,
)

from kvhandoff.events.subjects import partition_transform
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.sim.nats.jetstream.api import StreamView
from kvhandoff.worker.sim.nats.jetstream.model import JetStream
from kvhandoff.worker.sim.nats.jetstream.streams import Stream, partition

WALL_START_NS = 1_800_000_000_123_456_789
INBOX = "_INBOX.model"


@dataclass
class Sent:
    subject: str
    payload: bytes
    reply: str
    headers: Mapping[str, str] | None
    status: str


class RecordingHub:
    """The core, as JetStream sees it: every message it was asked to send."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []

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
        self.sent.append(Sent(subject, payload, reply, headers, status))

    def has_interest(self, subject: str) -> bool:
        return True


@dataclass
class _Timer:
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class SteppedClock:
    """Virtual time that moves only when a test advances it, running the timers that come due
    in deadline order; the wall clock moves with it."""

    now: float = 0.0
    _timers: list[tuple[float, int, _Timer, Callable[[], None]]] = field(default_factory=list)
    _count: int = 0

    def time(self) -> float:
        return self.now

    def wall_ns(self) -> int:
        return WALL_START_NS + round(self.now * 1e9)

    def call_at(self, when: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer()
        self._count += 1
        heapq.heappush(self._timers, (when, self._count, timer, callback))
        return timer

    def advance(self, seconds: float) -> None:
        until = self.now + seconds
        while self._timers and self._timers[0][0] <= until:
            when, _, timer, callback = heapq.heappop(self._timers)
            if not timer.cancelled:
                self.now = max(self.now, when)
                callback()
        self.now = until


class ModelClient(Client):
    """A nats-py client whose requests the model answers (see the module docstring)."""

    def __init__(self, model: JetStream, hub: RecordingHub) -> None:
        super().__init__()
        self.model = model
        self.hub = hub

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,  # noqa: ASYNC109 (nats-py's signature, overridden)
        old_style: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> Msg:
        before = len(self.hub.sent)
        taken = self.model.on_publish(subject, INBOX, headers, payload)
        answers = [s for s in self.hub.sent[before:] if s.subject == INBOX]
        if not answers:
            if not taken:
                raise nats.errors.NoRespondersError
            raise nats.errors.TimeoutError
        sent = answers[-1]
        got = dict(sent.headers or {})
        if sent.status:
            code, _, description = sent.status.partition(" ")
            got |= {"Status": code, "Description": description}
        return Msg(_client=self, subject=INBOX, data=sent.payload, headers=got or None)


@dataclass
class Model:
    js: JetStream
    hub: RecordingHub
    clock: SteppedClock
    client: ModelClient
    nats_js: JetStreamContext

    def publish(
        self, subject: str, payload: bytes = b"", headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Publish with a reply subject; the model's one answer, decoded."""
        before = len(self.hub.sent)
        assert self.js.on_publish(subject, INBOX, headers, payload)
        answers = [s for s in self.hub.sent[before:] if s.subject == INBOX]
        assert len(answers) == 1, answers
        answer: dict[str, Any] = json.loads(answers[0].payload)
        return answer

    def stream(self, name: str) -> Stream:
        return self.js.streams[name]

    def watch(self, stream: str) -> Callable[[], list[int]]:
        """A consumer of `stream`, made with a pull request that waits for every message
        before any is stored: what it is delivered, it is delivered because the streams told
        the consumers (`on_stored`), as a KV watch is. The stream sequences delivered so far."""
        inbox = f"_INBOX.watch.{stream}"
        config = {"stream_name": stream, "config": {"name": "watch", "ack_policy": "none"}}
        self.publish(f"$JS.API.CONSUMER.CREATE.{stream}.watch", json.dumps(config).encode())
        request = json.dumps({"batch": 1000, "expires": 3600 * 10**9}).encode()
        assert self.js.on_publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.watch", inbox, None, request)

        def delivered() -> list[int]:
            # The sequence is the ack subject's: $JS.ACK.<stream>.<consumer>.<dc>.<sseq>....
            return [int(s.reply.split(".")[5]) for s in self.hub.sent if s.subject == inbox]

        return delivered


def make_model(*, replicated: bool = False) -> Model:
    hub = RecordingHub()
    clock = SteppedClock()
    js = JetStream(hub, random.Random(1), clock=clock, replicated=replicated)
    client = ModelClient(js, hub)
    return Model(js, hub, clock, client, JetStreamContext(client))


@pytest.fixture
def model() -> Iterator[Model]:
    yield make_model()


# Streams ----------------------------------------------------------------------------------


async def test_create_answers_what_nats_py_parses_and_is_idempotent(model: Model) -> None:
    config = StreamConfig(name="IN", subjects=["in.*"], retention=RetentionPolicy.WORK_QUEUE)
    info = await model.nats_js.add_stream(config)
    assert info.config.name == "IN"
    assert info.config.subjects == ["in.*"]
    assert info.config.retention == "workqueue"
    assert info.config.duplicate_window == 120.0  # the server's default, in seconds
    assert info.config.max_msgs_per_subject == -1
    assert (info.state.messages, info.state.first_seq, info.state.last_seq) == (0, 0, 0)

    again = await model.nats_js.add_stream(config)
    assert again.config == info.config

    with pytest.raises(nats.js.errors.BadRequestError) as refused:
        await model.nats_js.add_stream(config, max_msgs=5)
    assert refused.value.err_code == 10058
    assert refused.value.description == "stream name already in use with a different configuration"


async def test_overlapping_subjects_are_refused(model: Model) -> None:
    await model.nats_js.add_stream(name="A", subjects=["a.*"])
    with pytest.raises(nats.js.errors.BadRequestError) as refused:
        await model.nats_js.add_stream(name="B", subjects=["a.>"])
    assert refused.value.err_code == 10065
    assert await model.nats_js.add_stream(name="C", subjects=["a.b.c"])  # three tokens: apart


async def test_names_by_subject_info_update_and_delete(model: Model) -> None:
    await model.nats_js.add_stream(name="LOG", subjects=["p.log.*"], max_age=60)
    await model.nats_js.add_stream(name="DONE", subjects=["p.done.*"])
    assert await model.nats_js.find_stream_name_by_subject("p.log.3") == "LOG"
    with pytest.raises(nats.js.errors.NotFoundError):
        await model.nats_js.find_stream_name_by_subject("p.in.x")

    info = await model.nats_js.stream_info("LOG")
    assert info.config.max_age == 60.0
    assert info.config.duplicate_window == 60.0  # no longer than the max age
    relaxed = await model.nats_js.update_stream(
        StreamConfig(name="LOG", subjects=["p.log.*"], allow_rollup_hdrs=True, allow_atomic=True)
    )
    assert relaxed.config.max_age == 0
    assert relaxed.config.allow_rollup_hdrs is True
    assert relaxed.config.allow_atomic is True

    model.watch("LOG")
    assert model.js.consumers.consumer_count("LOG") == 1
    assert await model.nats_js.delete_stream("LOG")
    assert model.js.consumers.consumer_count("LOG") == 0  # its consumers went with it
    with pytest.raises(nats.js.errors.NotFoundError) as gone:
        await model.nats_js.stream_info("LOG")
    assert gone.value.err_code == 10059
    account = AccountInfo.from_response(
        json.loads((await model.client.request("$JS.API.INFO")).data)
    )
    assert (account.streams, account.consumers) == (1, 0)


# Publishing -------------------------------------------------------------------------------


async def test_msg_id_is_stored_once_within_the_duplicate_window(model: Model) -> None:
    await model.nats_js.add_stream(name="S", subjects=["s.*"], duplicate_window=2.0)
    delivered = model.watch("S")
    first = await model.nats_js.publish("s.1", b"one", headers={"Nats-Msg-Id": "m"})
    again = await model.nats_js.publish("s.1", b"one", headers={"Nats-Msg-Id": "m"})
    assert (first.seq, first.duplicate) == (1, None)
    assert (again.seq, again.duplicate) == (1, True)
    assert model.stream("S").count_after(0, []) == 1

    model.clock.advance(2.0)
    later = await model.nats_js.publish("s.1", b"one", headers={"Nats-Msg-Id": "m"})
    assert (later.seq, later.duplicate) == (2, None)
    assert delivered() == [1, 2]


async def test_expected_last_subject_sequence_fences_a_stale_writer(model: Model) -> None:
    await model.nats_js.add_stream(name="LOG", subjects=["log.*"])
    await model.nats_js.publish("log.1", b"a")
    await model.nats_js.publish("log.2", b"other subject")
    cas = {"Nats-Expected-Last-Subject-Sequence": "1", "Nats-Msg-Id": "append-1"}
    assert (await model.nats_js.publish("log.1", b"b", headers=cas)).seq == 3

    with pytest.raises(nats.js.errors.APIError) as fenced:
        await model.nats_js.publish(
            "log.1", b"c", headers={"Nats-Expected-Last-Subject-Sequence": "1"}
        )
    assert fenced.value.err_code == 10071
    assert fenced.value.description == "wrong last sequence: 3"
    # On one server the expectation is checked before the id: a retried append is refused.
    retried = model.publish("log.1", b"b", cas)
    assert retried["error"]["err_code"] == 10071
    first_on_empty = {"Nats-Expected-Last-Subject-Sequence": "0"}
    assert (await model.nats_js.publish("log.9", b"x", headers=first_on_empty)).seq == 4
    with pytest.raises(nats.js.errors.APIError) as stale:
        await model.nats_js.publish("log.1", b"d", headers={"Nats-Expected-Last-Sequence": "3"})
    assert (stale.value.err_code, stale.value.description) == (10071, "wrong last sequence: 4")


def test_a_replicated_stream_answers_a_retried_append_as_a_duplicate() -> None:
    model = make_model(replicated=True)
    model.publish("$JS.API.STREAM.CREATE.LOG", json.dumps({"subjects": ["log.*"]}).encode())
    cas = {"Nats-Expected-Last-Subject-Sequence": "0", "Nats-Msg-Id": "append-1"}
    assert model.publish("log.1", b"b", cas) == {"stream": "LOG", "seq": 1}
    assert model.publish("log.1", b"b", cas) == {"stream": "LOG", "seq": 1, "duplicate": True}


async def test_rollup_needs_the_stream_to_allow_it_and_replaces_the_subject(model: Model) -> None:
    await model.nats_js.add_stream(name="NO", subjects=["no.*"])
    refused = model.publish("no.1", b"x", {"Nats-Rollup": "sub"})
    assert refused["error"] == {
        "code": 500,
        "err_code": 10111,
        "description": "rollup not permitted",
    }

    await model.nats_js.add_stream(name="LOG", subjects=["log.*"], allow_rollup_hdrs=True)
    for payload in (b"1", b"2", b"3"):
        await model.nats_js.publish("log.1", payload)
    await model.nats_js.publish("log.2", b"kept")
    ack = await model.nats_js.publish("log.1", b"snapshot", headers={"Nats-Rollup": "sub"})
    info = await model.nats_js.stream_info("LOG", subjects_filter=">")
    assert info.state.subjects == {"log.1": 1, "log.2": 1}
    last = await model.nats_js.get_last_msg("LOG", "log.1")
    assert (last.seq, last.data) == (ack.seq, b"snapshot")
    assert (info.state.first_seq, info.state.last_seq, info.state.num_deleted) == (4, 5, None)


async def test_per_subject_history_drops_the_oldest(model: Model) -> None:
    await model.nats_js.add_stream(name="DONE", subjects=["done.*"], max_msgs_per_subject=1)
    await model.nats_js.publish("done.a", b"1")
    await model.nats_js.publish("done.b", b"2")
    await model.nats_js.publish("done.b", b"3")
    info = await model.nats_js.stream_info("DONE")
    assert (info.state.messages, info.state.first_seq, info.state.num_deleted) == (2, 1, 1)


async def test_discard_new_refuses_a_full_stream(model: Model) -> None:
    await model.nats_js.add_stream(
        name="W", subjects=["w.*"], max_msgs=1, discard=DiscardPolicy.NEW
    )
    await model.nats_js.publish("w.1", b"1")
    with pytest.raises(nats.js.errors.ServiceUnavailableError) as full:
        await model.nats_js.publish("w.1", b"2")
    assert (full.value.err_code, full.value.description) == (10077, "maximum messages exceeded")


async def test_a_work_queue_message_leaves_once_removed(model: Model) -> None:
    await model.nats_js.add_stream(
        name="IN", subjects=["in.*"], retention=RetentionPolicy.WORK_QUEUE
    )
    for handoff in ("a", "b", "a"):
        await model.nats_js.publish(f"in.{handoff}", handoff.encode())
    view: StreamView = model.stream("IN")
    assert view.count_after(0, ["in.a"]) == 2
    assert view.remove(1) and not view.remove(1)
    nxt = view.next_after(0, ["in.a"])
    assert nxt is not None and nxt.seq == 3
    assert (view.first_seq(), view.last_seq(), view.count_after(0, [])) == (2, 3, 2)


# Time -------------------------------------------------------------------------------------


def expiring_bucket_config(marker_ttl_s: float) -> bytes:
    """The stream that worker.bus.kv.open_expiring_bucket makes, as nats-py encodes it."""
    config = StreamConfig(
        name="KV_LEASES",
        subjects=["$KV.LEASES.>"],
        retention=RetentionPolicy.LIMITS,
        max_msgs_per_subject=1,
        allow_msg_ttl=True,
        subject_delete_marker_ttl=marker_ttl_s,
        allow_rollup_hdrs=True,
        num_replicas=1,
    )
    return json.dumps(config.as_dict()).encode()


async def test_a_ttl_ends_in_a_delete_marker_that_ends_in_turn(model: Model) -> None:
    model.publish("$JS.API.STREAM.CREATE.KV_LEASES", expiring_bucket_config(5.0))
    delivered = model.watch("KV_LEASES")
    ttl = {"Nats-Msg-Id": "lease-1", "Nats-TTL": "20000ms"}  # as kv.put_expiring sends it
    assert model.publish("$KV.LEASES.engine-1", b"held", ttl)["seq"] == 1

    model.clock.advance(19.9)
    assert (await model.nats_js.get_last_msg("KV_LEASES", "$KV.LEASES.engine-1")).data == b"held"
    model.clock.advance(0.1)
    marker = await model.nats_js.get_last_msg("KV_LEASES", "$KV.LEASES.engine-1")
    assert marker.seq == 2 and not marker.data
    assert marker.headers == {
        "Nats-Marker-Reason": "MaxAge",
        "Nats-TTL": "5s",
        "Nats-Rollup": "sub",
    }
    assert delivered() == [1, 2]  # a watch sees it

    model.clock.advance(5.0)
    with pytest.raises(nats.js.errors.NotFoundError):
        await model.nats_js.get_last_msg("KV_LEASES", "$KV.LEASES.engine-1")
    info = await model.nats_js.stream_info("KV_LEASES")
    assert (info.state.messages, info.state.first_seq, info.state.last_seq) == (0, 3, 2)


async def test_a_refreshed_key_outlives_its_first_ttl(model: Model) -> None:
    model.publish("$JS.API.STREAM.CREATE.KV_LEASES", expiring_bucket_config(5.0))
    delivered = model.watch("KV_LEASES")
    model.publish("$KV.LEASES.e", b"1", {"Nats-TTL": "10s"})
    model.clock.advance(8.0)
    model.publish("$KV.LEASES.e", b"2", {"Nats-TTL": "10s"})  # replaces it: one per key
    model.clock.advance(8.0)
    assert (await model.nats_js.get_last_msg("KV_LEASES", "$KV.LEASES.e")).data == b"2"
    assert delivered() == [1, 2]  # no marker: the key never expired


async def test_max_age_drops_old_messages(model: Model) -> None:
    await model.nats_js.add_stream(name="DONE", subjects=["done.*"], max_age=30.0)
    await model.nats_js.publish("done.a", b"1")
    model.clock.advance(10.0)
    await model.nats_js.publish("done.b", b"2")
    model.clock.advance(20.0)
    info = await model.nats_js.stream_info("DONE", subjects_filter=">")
    assert info.state.subjects == {"done.b": 1}


def test_a_ttl_needs_the_stream_to_allow_it_and_to_be_a_second_or_more(model: Model) -> None:
    model.publish("$JS.API.STREAM.CREATE.S", json.dumps({"subjects": ["s.*"]}).encode())
    assert model.publish("s.1", b"", {"Nats-TTL": "5s"})["error"]["err_code"] == 10166
    model.publish(
        "$JS.API.STREAM.CREATE.T",
        json.dumps({"subjects": ["t.*"], "allow_msg_ttl": True}).encode(),
    )
    assert model.publish("t.1", b"", {"Nats-TTL": "500ms"})["error"]["err_code"] == 10165
    assert model.publish("t.1", b"", {"Nats-TTL": "junk"})["error"]["err_code"] == 10165
    assert model.publish("t.1", b"", {"Nats-TTL": "1s"}) == {"stream": "T", "seq": 1}


# Reads ------------------------------------------------------------------------------------


async def test_message_gets_by_sequence_subject_and_next(model: Model) -> None:
    await model.nats_js.add_stream(name="IN", subjects=["in.*"])
    await model.nats_js.publish("in.a", b"a1", headers={"Nats-Msg-Id": "x"})
    await model.nats_js.publish("in.b", b"b1")
    await model.nats_js.publish("in.a", b"a2")

    by_seq = await model.nats_js.get_msg("IN", 1)
    assert (by_seq.subject, by_seq.data, by_seq.headers) == ("in.a", b"a1", {"Nats-Msg-Id": "x"})
    assert by_seq.time is not None
    assert by_seq.time.timestamp() == pytest.approx(WALL_START_NS / 1e9)
    last = await model.nats_js.get_last_msg("IN", "in.a")
    assert (last.seq, last.data) == (3, b"a2")
    following = await model.nats_js.get_msg("IN", 2, subject="in.a", next=True)
    assert following.seq == 3
    with pytest.raises(nats.js.errors.NotFoundError) as none:
        await model.nats_js.get_msg("IN", 4, subject="in.*", next=True)
    assert none.value.err_code == 10037


async def test_direct_gets_answer_the_message_or_404_and_need_allow_direct(model: Model) -> None:
    kv = await model.nats_js.create_key_value(KeyValueConfig(bucket="MEMBERS", direct=True))
    await kv.put("w1", b"alive")
    entry = await kv.get("w1")
    assert (entry.value, entry.revision) == (b"alive", 1)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("w2")
    raw = await model.nats_js.get_msg("KV_MEMBERS", 1, direct=True)
    assert raw.headers is not None
    assert raw.headers["Nats-Stream"] == "KV_MEMBERS"
    assert raw.headers["Nats-Sequence"] == "1"

    await model.nats_js.add_stream(name="PLAIN", subjects=["plain.*"])
    with pytest.raises(nats.errors.NoRespondersError):
        await model.nats_js.get_msg("PLAIN", 1, direct=True)


async def test_kv_keys_come_from_the_subjects_filter(model: Model) -> None:
    kv = await model.nats_js.create_key_value(KeyValueConfig(bucket="M", history=1, ttl=30))
    await kv.put("tier.a", b"1")
    await kv.put("tier.b", b"1")
    await kv.put("other.c", b"1")
    info = await model.nats_js.stream_info("KV_M", subjects_filter="$KV.M.tier.*")
    assert info.state.subjects == {"$KV.M.tier.a": 1, "$KV.M.tier.b": 1}


# Atomic batches ---------------------------------------------------------------------------


def batch(
    model: Model, subject: str, payloads: list[bytes], last_seq: int, batch_id: str
) -> dict[str, Any]:
    """What worker.bus.publish.roll_up_batch sends; the commit's answer."""
    for index, payload in enumerate(payloads, start=1):
        headers = {"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(index)}
        if index == 1:
            headers |= {"Nats-Rollup": "sub", "Nats-Expected-Last-Subject-Sequence": str(last_seq)}
        if index == len(payloads):
            headers["Nats-Batch-Commit"] = "1"
            return model.publish(subject, payload, headers)
        before = len(model.hub.sent)
        model.js.on_publish(subject, INBOX if index == 1 else "", headers, payload)
        if index == 1:
            assert [s.payload for s in model.hub.sent[before:]] == [b""]
    raise AssertionError("no payloads")


async def test_an_atomic_batch_is_stored_whole_or_not_at_all(model: Model) -> None:
    await model.nats_js.add_stream(
        name="LOG", subjects=["log.*"], allow_rollup_hdrs=True, allow_atomic=True
    )
    await model.nats_js.publish("log.1", b"entry")
    ack = batch(model, "log.1", [b"s1", b"s2", b"s3"], 1, "b1")
    assert ack == {"stream": "LOG", "seq": 4, "batch": "b1", "count": 3}
    info = await model.nats_js.stream_info("LOG", subjects_filter=">")
    assert (info.state.messages, info.state.first_seq) == (3, 2)

    stale = batch(model, "log.1", [b"t1", b"t2"], 1, "b2")
    assert stale["error"]["err_code"] == 10071
    assert stale["error"]["description"] == "wrong last sequence: 4"
    assert model.stream("LOG").last_seq() == 4

    gap = {"Nats-Batch-Id": "b3", "Nats-Batch-Sequence": "2", "Nats-Batch-Commit": "1"}
    assert model.publish("log.1", b"x", gap)["error"]["err_code"] == 10176


def test_a_batch_idle_past_the_cleanup_is_abandoned(model: Model) -> None:
    body = {"subjects": ["log.*"], "allow_atomic": True, "allow_rollup_hdrs": True}
    model.publish("$JS.API.STREAM.CREATE.LOG", json.dumps(body).encode())
    model.js.on_publish("log.1", "", {"Nats-Batch-Id": "b", "Nats-Batch-Sequence": "1"}, b"1")
    model.clock.advance(11.0)
    commit = {"Nats-Batch-Id": "b", "Nats-Batch-Sequence": "2", "Nats-Batch-Commit": "1"}
    assert model.publish("log.1", b"2", commit)["error"]["err_code"] == 10176
    assert model.stream("LOG").last_seq() == 0


def test_a_stream_without_atomic_publish_refuses_batches(model: Model) -> None:
    model.publish("$JS.API.STREAM.CREATE.S", json.dumps({"subjects": ["s.*"]}).encode())
    first = {"Nats-Batch-Id": "b", "Nats-Batch-Sequence": "1"}
    assert model.publish("s.1", b"1", first)["error"]["err_code"] == 10174


# Faults -----------------------------------------------------------------------------------


async def test_an_unavailable_leader_answers_nothing_and_stores_nothing(model: Model) -> None:
    await model.nats_js.add_stream(name="S", subjects=["s.*"])
    model.js.faults.unavailable_until = 5.0
    with pytest.raises(nats.errors.TimeoutError):
        await model.nats_js.publish("s.1", b"lost")
    with pytest.raises(nats.errors.TimeoutError):
        await model.nats_js.stream_info("S")
    model.clock.advance(5.0)
    assert (await model.nats_js.publish("s.1", b"kept")).seq == 1


async def test_a_lost_ack_leaves_the_message_stored(model: Model) -> None:
    await model.nats_js.add_stream(name="S", subjects=["s.*"])
    model.js.faults.lost_ack_rate = 1.0
    with pytest.raises(nats.errors.TimeoutError):
        await model.nats_js.publish("s.1", b"landed", headers={"Nats-Msg-Id": "m"})
    model.js.faults.lost_ack_rate = 0.0
    retried = await model.nats_js.publish("s.1", b"landed", headers={"Nats-Msg-Id": "m"})
    assert (retried.seq, retried.duplicate) == (1, True)


async def test_consumer_traffic_goes_to_the_consumers(model: Model) -> None:
    await model.nats_js.add_stream(name="S", subjects=["s.*"])
    config = {"stream_name": "S", "config": {"durable_name": "c", "ack_policy": "explicit"}}
    model.publish("$JS.API.CONSUMER.CREATE.S.c", json.dumps(config).encode())
    await model.nats_js.publish("s.1", b"x")
    assert model.js.on_publish("$JS.API.CONSUMER.MSG.NEXT.S.c", "_INBOX.pull", None, b"1")
    (delivery,) = [sent for sent in model.hub.sent if sent.subject == "_INBOX.pull"]

    assert model.js.on_publish(delivery.reply, "", None, b"+ACK")  # $JS.ACK.S.c...
    info = model.publish("$JS.API.CONSUMER.INFO.S.c")
    assert (info["name"], info["ack_floor"]["stream_seq"], info["num_ack_pending"]) == ("c", 1, 0)
    # A flow-control reply is taken, and not stored: the consumers' (whose tests hold what it
    # does); this consumer asked none, so it changes nothing.
    before = len(model.hub.sent)
    assert model.js.on_publish("$JS.FC.S.c.x", "", None, b"")
    assert model.hub.sent[before:] == []
    assert model.stream("S").count_after(0, []) == 1
    assert not model.js.on_publish("nobody.listens", INBOX, None, b"")


# The partition transform, held to the real server -----------------------------------------


async def test_partition_transform_stores_where_the_real_server_does(tmp_path: Any) -> None:
    prefix, partitions = "kvh", 16
    src, dest = partition_transform(prefix, partitions)
    ids = [f"{n:08x}-1f2e-4d3c-8b7a-{n * 7919:012x}" for n in range(64)] + ["a", "zz"]
    config = StreamConfig(
        name="IN",
        subjects=[f"{prefix}.in.*"],
        retention=RetentionPolicy.WORK_QUEUE,
        subject_transform=SubjectTransform(src, dest),
    )
    with EmbeddedNats(store_dir=tmp_path) as server:
        nc = await nats.connect(server.url)
        try:
            real = nc.jetstream()
            await real.add_stream(config)
            for handoff in ids:
                await real.publish(f"{prefix}.in.{handoff}", b"")
            stored_real = [
                (await real.get_msg("IN", seq)).subject for seq in range(1, 1 + len(ids))
            ]
        finally:
            await nc.close()

    model = make_model()
    await model.nats_js.add_stream(config)
    for handoff in ids:
        await model.nats_js.publish(f"{prefix}.in.{handoff}", b"")
    stored_model = [
        (await model.nats_js.get_msg("IN", seq)).subject for seq in range(1, 1 + len(ids))
    ]
    assert stored_model == stored_real
    assert len({str(subject).split(".")[2] for subject in stored_real}) > 8  # spread, not one
    assert partition(b"", 0) == 0
