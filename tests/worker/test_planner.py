"""The batch planner without NATS or SQLite: however a run of deliveries is cut into batches,
the log it writes and the way each delivery is settled are those of applying them one by one,
also when each batch commits only after the next was planned, as in a partition's pipeline.

The deliveries are the success paths of a few handoffs (some canceled part-way), interleaved,
with exact duplicates, early inputs (a later input moved before an earlier one), inputs refused
by the coordinator, and bytes that are not an input at all. The log is an in-memory twin that
keeps what each plan's batch commits and loads it back the way `EventLog.load` does, so a
handoff that completes and leaves memory is checked against its log when an input for it comes
again: in one-by-one order that happens after every input, in batches only between batches.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from uuid import UUID

from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from kvhandoff.events.codec import decode_record, encode, join_record
from kvhandoff.events.coordinator import HandoffCoordinator
from kvhandoff.events.messages import (
    NOOP,
    ActionOutcome,
    CancelDestination,
    Canceled,
    CancelSource,
    EngineType,
    Input,
    StartHandoff,
)
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.engines.healthy import success_script
from kvhandoff.worker.log.rows import Batch, HandoffLog, HandoffRow, Loaded, LoggedEvent
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.tier.entries import LoggedRows
from kvhandoff.worker.tier.planner import Planner

SUBJECTS = Subjects()
NOW_MS = 1_700_000_000_000


@dataclass(frozen=True, slots=True)
class Delivery:
    data: bytes
    subject: str
    deliveries: int
    stream_seq: int


@dataclass
class MemoryLog:
    """What the commits wrote: handoff rows, events per handoff, rejections, in order."""

    rows: dict[UUID, HandoffRow] = field(default_factory=dict)
    events: dict[UUID, list[LoggedEvent]] = field(default_factory=dict)
    rejections: list[tuple[str | None, str]] = field(default_factory=list)

    def commit(self, batch: Batch) -> None:
        for hid, seq, code, at_ms, fields in batch.events:
            logged = self.events.setdefault(UUID(hid), [])
            assert seq == len(logged), "sequence numbers must follow the log without gaps"
            record = decode_record(join_record(UUID(hid).bytes, code, at_ms, fields))
            logged.append(LoggedEvent(seq, at_ms, record))
        for handoff_id, row in batch.handoffs.items():
            # A row is the projection of its log as this commit leaves it, not a later state.
            assert row.last_seq == len(self.events[handoff_id]) - 1, (row, "ahead of its log")
            self.rows[handoff_id] = row.copy()
        self.rejections += [(hid, reason) for _, hid, reason, _ in batch.rejections]
        assert not batch.quarantined

    def load(self, handoff_ids: Collection[UUID]) -> dict[UUID, Loaded]:
        return {
            h: HandoffLog(self.rows[h].copy(), list(self.events[h]))
            for h in handoff_ids
            if h in self.rows
        }


def success_inputs(start: StartHandoff, cancel_at: int | None) -> list[Input]:
    """A handoff's inputs as healthy engines send them, answering each action in turn."""
    coordinator = HandoffCoordinator.for_start(start)
    pending: deque[Input] = deque([start])
    sent: list[Input] = []
    while pending:
        message = pending.popleft()
        if len(sent) == cancel_at:
            pending.appendleft(message)
            message = Canceled(start.handoff_id)
        sent.append(message)
        for action in coordinator.handle(message):
            pending.extend(success_script(action))
    return sent


@st.composite
def deliveries(draw: st.DrawFn) -> list[Delivery]:
    runs = []
    for _ in range(draw(st.integers(1, 3))):
        start = StartHandoff(
            UUID(int=draw(st.integers(0, 2**64)), version=4),
            draw(st.sampled_from(list(EngineType))),
            "prefill-0",
            "decode-0",
            deadline_ms=60_000,
        )
        cancel_at = draw(st.none() | st.integers(1, 12))
        runs.append(deque(success_inputs(start, cancel_at)))
    stream: list[tuple[str, bytes]] = []
    while any(runs):
        run = draw(st.sampled_from([r for r in runs if r]))
        message = run.popleft()
        stream.append((SUBJECTS.input(message.handoff_id), encode(message)))
    for _ in range(draw(st.integers(0, 4))):  # exact duplicates, later in the stream
        i = draw(st.integers(0, len(stream) - 1))
        stream.insert(draw(st.integers(i, len(stream))), stream[i])
    for _ in range(draw(st.integers(0, 3))):  # early inputs: one moved ahead of its elders
        i = draw(st.integers(1, len(stream) - 1))
        stream.insert(draw(st.integers(0, i - 1)), stream.pop(i))
    for _ in range(draw(st.integers(0, 2))):  # not inputs at all, or on the wrong subject
        subject, data = draw(st.sampled_from(stream))
        wrong = draw(
            st.sampled_from(
                [(subject, b"{"), (SUBJECTS.input(uuid.uuid4()), data), (subject, data[:-1])]
            )
        )
        stream.insert(draw(st.integers(0, len(stream))), wrong)
    return [Delivery(data, subject, 1, seq) for seq, (subject, data) in enumerate(stream)]


def run(
    stream: list[Delivery], cuts: list[int], *, pipelined: bool = False
) -> tuple[MemoryLog, list[str]]:
    """Plan the stream in batches ending at `cuts`; the log and how each delivery was settled.

    Settled as a partition's owner settles it (worker.tier.owner): a deferred input is given
    back ("nak"); every other input is in the batch's rows, applied, a duplicate or rejected,
    and acknowledged once they are appended ("ack", or "rejected: <why>", whose rejection is
    published). `pipelined` commits each batch only after the next one was planned, as
    worker.tier.service's local commits trail its `decide`, except that a batch that must read
    a handoff the previous batch took out of memory waits for the previous commit first (the
    service's `after_previous` and `_all_committed`); other reads overtake it.
    """
    planner = Planner(SUBJECTS, defer_budget=4, ack_wait_s=30.0)
    log = MemoryLog()
    settled: dict[int, str] = {}
    uncommitted: Batch | None = None
    evicted: set[UUID] = set()
    begin = 0
    for end in [*sorted(set(cuts)), len(stream)]:
        batch, begin = stream[begin:end], end
        if not batch:
            continue
        decoded = planner.decode(batch)
        missing = planner.missing(decoded)
        if uncommitted is not None and (evicted.intersection(missing) or not pipelined):
            log.commit(uncommitted)
            uncommitted = None
        plan = planner.plan(batch, decoded, log.load(missing), NOW_MS, 0.0)
        if uncommitted is not None:
            log.commit(uncommitted)
        uncommitted, evicted = plan.batch, set(plan.left_memory)
        rejected = {i: f"rejected: {rejection.reason}" for i, rejection in plan.rejections}
        deferred = {i for i, _ in plan.naks}
        assert not deferred & rejected.keys(), "a delivery is deferred or settled, not both"
        for i, delivery in enumerate(batch):
            settled[delivery.stream_seq] = "nak" if i in deferred else rejected.get(i, "ack")
    if uncommitted is not None:
        log.commit(uncommitted)
    assert sorted(settled) == [d.stream_seq for d in stream], "every delivery settled once"
    return log, [settled[d.stream_seq] for d in stream]


@settings(max_examples=300, deadline=None)
@given(deliveries(), st.data())
def test_any_cut_into_batches_plans_what_one_by_one_does(
    stream: list[Delivery], data: st.DataObject
) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=6))
    pipelined = data.draw(st.booleans())
    one_by_one, settled_singly = run(stream, list(range(len(stream))))
    batched, settled_batched = run(stream, cuts, pipelined=pipelined)
    assert batched.events == one_by_one.events
    assert batched.rows == one_by_one.rows
    assert batched.rejections == one_by_one.rejections
    assert settled_batched == settled_singly


def test_the_generated_traffic_exercises_every_kind_of_settlement() -> None:
    """Guards the property against passing vacuously on traffic that is all accepted."""
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    inputs = success_inputs(start, cancel_at=None)
    subject = SUBJECTS.input(start.handoff_id)
    stream = [
        Delivery(encode(m), subject, 1, i)
        for i, m in enumerate([inputs[1], *inputs, inputs[0], Canceled(start.handoff_id)])
    ]
    stream.append(Delivery(b"{", subject, 1, len(stream)))
    log, settled = run(stream, [])
    assert settled[0] == "nak"  # an outcome before its handoff started
    assert settled[1 : len(inputs) + 1] == ["ack"] * len(inputs)
    assert settled[len(inputs) + 1] == "ack"  # the duplicate start
    assert settled[-2] == "ack"  # a cancel after success reopens cleanup
    assert settled[-1].startswith("rejected: undecodable")
    assert log.rows[start.handoff_id].state == "open"  # cleaning up after the reopen


def test_a_late_input_for_a_handoff_known_by_its_tombstone_is_answered_as_its_log_would() -> None:
    """A handoff that ended and left its rows behind (a file caught up from a snapshot lacks
    them) is known by its tombstone: an exact duplicate of an input it accepted is a duplicate,
    anything else (the same id started differently, a late outcome) is rejected, and nothing
    starts it anew; past --tombstone-ttl the tombstone is forgotten."""
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    inputs = success_inputs(start, cancel_at=None)
    ttl_ms = 300_000
    ended = Planner(SUBJECTS, 8, 1.0, tombstone_ttl_ms=ttl_ms)
    log = MemoryLog()
    stream = [
        Delivery(encode(m), SUBJECTS.input(start.handoff_id), 1, n) for n, m in enumerate(inputs)
    ]
    log.commit(ended.plan(stream, ended.decode(stream), {}, NOW_MS, NOW_MS / 1000).batch)
    tombstone = ended.tombstones[start.handoff_id]
    assert tombstone.state == "succeeded" and len(tombstone.digests) == len(inputs)

    # A new owner whose file has no rows of it: only the tombstone.
    planner = Planner(SUBJECTS, 8, 1.0, tombstone_ttl_ms=ttl_ms)
    planner.tombstones = dict(ended.tombstones)
    restart = StartHandoff(start.handoff_id, EngineType.SGLANG, "prefill-1", "decode-1", 60_000)
    late = [
        Delivery(encode(start), SUBJECTS.input(start.handoff_id), 1, 100),  # a retried start
        Delivery(encode(inputs[-1]), SUBJECTS.input(start.handoff_id), 1, 101),  # a redelivery
        Delivery(encode(restart), SUBJECTS.input(start.handoff_id), 1, 102),
    ]
    plan = planner.plan(late, planner.decode(late), {}, NOW_MS + 1000, NOW_MS / 1000 + 1)
    assert plan.duplicates == 2 and not plan.naks
    assert [index for index, _ in plan.rejections] == [2]
    assert "ended (succeeded)" in plan.rejections[0][1].reason
    assert not plan.publish and not plan.batch.events and not planner.open

    # Past its life, the tombstone is gone: a start is a new handoff (docs/durability.md says so).
    later_ms = NOW_MS + ttl_ms + 1
    again = [Delivery(encode(start), SUBJECTS.input(start.handoff_id), 1, 103)]
    plan = planner.plan(again, planner.decode(again), {}, later_ms, later_ms / 1000)
    assert start.handoff_id not in planner.tombstones
    assert [type(action).__name__ for _, _, action in plan.publish] == ["SubmitPrefill"]


def test_a_handoff_that_reopens_is_known_by_no_tombstone_until_it_ends_again() -> None:
    """A late `Canceled` reopens a handoff that succeeded (docs/handoff.md): from then on it is
    open, and its tombstone says an ending it no longer has. A snapshot of the partition takes
    the planner's tombstones: one taken while it was reopened carried the tombstone of its first
    ending beside its open row (seed 200 of `kvhandoff sim`), and a file merged from it kept
    that tombstone after the handoff ended canceled. The tombstone goes at the reopen, and the
    ending after it leaves the tombstone of that ending, the newest, last."""
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    inputs = success_inputs(start, cancel_at=None)
    subject = SUBJECTS.input(start.handoff_id)
    ttl_ms = 300_000
    planner = Planner(SUBJECTS, 8, 1.0, tombstone_ttl_ms=ttl_ms)
    log = MemoryLog()
    other = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    stream = [Delivery(encode(m), subject, 1, n) for n, m in enumerate(inputs)]
    stream += [
        Delivery(encode(m), SUBJECTS.input(other.handoff_id), 1, 100 + n)
        for n, m in enumerate(success_inputs(other, cancel_at=None))
    ]
    log.commit(planner.plan(stream, planner.decode(stream), {}, NOW_MS, NOW_MS / 1000).batch)
    assert planner.tombstones[start.handoff_id].state == "succeeded"

    late = [Delivery(encode(Canceled(start.handoff_id)), subject, 1, 200)]
    decoded = planner.decode(late)
    loaded = log.load(planner.missing(decoded))
    plan = planner.plan(late, decoded, loaded, NOW_MS + 1_000, NOW_MS / 1000 + 1)
    log.commit(plan.batch)
    assert log.rows[start.handoff_id].state == "open" and start.handoff_id in planner.open
    assert start.handoff_id not in planner.tombstones and not plan.ended

    # The engines answer the cleanup: it ends canceled, its tombstone the newest.
    answers = [m for _, _, action in plan.publish for m in success_script(action)]
    done = [Delivery(encode(m), subject, 1, 300 + n) for n, m in enumerate(answers)]
    plan = planner.plan(done, planner.decode(done), {}, NOW_MS + 2_000, NOW_MS / 1000 + 2)
    assert [t.state for t in plan.ended] == ["canceled"]
    assert list(planner.tombstones) == [other.handoff_id, start.handoff_id]


def test_a_handoff_that_takes_an_input_after_it_ended_carries_its_history() -> None:
    """A handoff that ended left memory; a late input that it accepts (a `Canceled` that
    reopens it for cleanup) is applied to it as loaded from the file. A snapshot taken after it
    ended knows it by its tombstone alone, so the batch carries the history the file holds
    (`Batch.carry`): every event before it, as logged, and its outbox mark, for a file caught up
    from that snapshot and the entries after it (seeds 3000 and 3003 of `kvhandoff sim`). A
    handoff in memory carries nothing: the entries since it began, or a snapshot taken while it
    was open, hold its events."""
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    subject = SUBJECTS.input(start.handoff_id)
    planner = Planner(SUBJECTS, 8, 1.0, tombstone_ttl_ms=300_000)
    log = MemoryLog()
    stream = [Delivery(encode(m), subject, 1, n) for n, m in enumerate(success_inputs(start, None))]
    ended = planner.plan(stream, planner.decode(stream), {}, NOW_MS, NOW_MS / 1000)
    log.commit(ended.batch)
    assert start.handoff_id not in planner.open and not ended.batch.history

    late = [Delivery(encode(Canceled(start.handoff_id)), subject, 1, 100)]
    decoded = planner.decode(late)
    loaded = log.load(planner.missing(decoded))
    # Its owner's file marks every action up to its `Complete` published.
    logged = loaded[start.handoff_id]
    assert isinstance(logged, HandoffLog)
    marked_ms = NOW_MS + 500
    events = [replace(e, published_at_ms=marked_ms) if e.seq > 0 else e for e in logged.events]
    loaded = {start.handoff_id: HandoffLog(logged.handoff, events)}
    reopen = planner.plan(late, decoded, loaded, NOW_MS + 1_000, NOW_MS / 1000 + 1)
    last = ended.batch.handoffs[start.handoff_id].last_seq
    assert reopen.batch.history == ended.batch.events  # byte for byte as logged
    assert reopen.batch.published == {start.handoff_id: (last, marked_ms)}
    assert reopen.batch.events[0][1] == last + 1  # its own events go on after them
    rows = LoggedRows.of([100], reopen.batch, [], reopen.ended)
    assert rows.history == ended.batch.events
    assert rows.published == [(start.handoff_id, last, marked_ms)]
    log.commit(reopen.batch)

    answers = [m for _, _, action in reopen.publish for m in success_script(action)]
    done = [Delivery(encode(m), subject, 1, 200 + n) for n, m in enumerate(answers)]
    cleaned = planner.plan(done, planner.decode(done), {}, NOW_MS + 2_000, NOW_MS / 1000 + 2)
    assert [t.state for t in cleaned.ended] == ["canceled"]
    assert cleaned.batch.events and not cleaned.batch.history and not cleaned.batch.published


def test_a_handoff_whose_file_holds_its_log_only_up_to_another_owner_is_not_reopened() -> None:
    """A claim that caught a file up from a snapshot ended what the file held open as the
    snapshot's tombstones say, and kept the prefix of each one's history the file had
    (worker.log.store). Loaded for a late input, that prefix rebuilds the handoff unfinished: it
    is answered by its tombstone instead, as if the file lacked its rows, and never reopened.
    (Seed 5 of `kvhandoff sim` reopened one: an engine's answer to an action that the claim
    published again became the handoff's next event, and its row in the log said open.)"""
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    inputs = success_inputs(start, cancel_at=None)
    subject = SUBJECTS.input(start.handoff_id)
    ttl_ms = 300_000

    def deliveries(messages: list[Input], first_seq: int) -> list[Delivery]:
        return [Delivery(encode(m), subject, 1, first_seq + n) for n, m in enumerate(messages)]

    # The file's owner took the start and lost the partition; another owner ended the handoff.
    held = Planner(SUBJECTS, 8, 1.0, tombstone_ttl_ms=ttl_ms)
    file = MemoryLog()
    stream = deliveries(inputs[:1], 0)
    file.commit(held.plan(stream, held.decode(stream), {}, NOW_MS, NOW_MS / 1000).batch)
    ender = Planner(SUBJECTS, 8, 1.0, tombstone_ttl_ms=ttl_ms)
    stream = deliveries(inputs, 0)
    ender.plan(stream, ender.decode(stream), {}, NOW_MS, NOW_MS / 1000)
    tombstone = ender.tombstones[start.handoff_id]
    # The catch-up from a snapshot that knows it by that tombstone alone.
    row = file.rows[start.handoff_id]
    row.state = HandoffState.SUCCEEDED
    row.completed_at_ms = row.updated_at_ms = tombstone.completed_at_ms
    prefix = {start.handoff_id: HandoffLog(row, list(file.events[start.handoff_id]))}
    assert [e.seq for e in prefix[start.handoff_id].events] == [0, 1]

    restart = StartHandoff(start.handoff_id, EngineType.SGLANG, "prefill-1", "decode-1", 60_000)
    # The answer to the first action (what an engine sends again when that action comes
    # again), a retried start, and the same id started differently.
    late = deliveries([inputs[1], start, restart], 100)
    later_ms = NOW_MS + 1_000
    for tombstones, duplicates in [(dict(ender.tombstones), [0, 1]), ({}, [1])]:
        # With the tombstone the claim read, and past its life without it: then the row's
        # own, which knows the digests of the prefix only.
        planner = Planner(SUBJECTS, 8, 1.0, tombstone_ttl_ms=ttl_ms)
        planner.tombstones = dict(tombstones)
        plan = planner.plan(late, planner.decode(late), prefix, later_ms, later_ms / 1000)
        rejected = [index for index, _ in plan.rejections]
        assert plan.duplicates == len(duplicates) and not plan.naks
        assert sorted([*duplicates, *rejected]) == [0, 1, 2]
        assert all("ended (succeeded)" in r.reason for _, r in plan.rejections)
        assert not plan.batch.events and not plan.batch.handoffs and not plan.publish
        assert not planner.open and planner.tombstones == tombstones


def test_a_file_lacking_the_inputs_a_handoff_took_after_its_end_defers_to_its_tombstone() -> None:
    """A file that held a handoff ended keeps its rows through a catch-up from a snapshot, which
    knows the handoff by its tombstone alone; an owner since may have logged late inputs after
    its end, in entries before that snapshot, which the file never had. Its events still end
    the handoff, but they are a prefix of its history: loaded for a late input, the handoff is
    answered by its tombstone, which holds the digests of every input it took, and logs
    nothing. (Seed 3003 of `kvhandoff sim`: the tier's answer for an engine whose lease was
    gone, given again, was logged a second time, as events 14 to 16 that the log held already
    as others.)"""
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    inputs = success_inputs(start, cancel_at=3)
    subject = SUBJECTS.input(start.handoff_id)
    ttl_ms = 300_000

    def deliveries(messages: list[Input], first_seq: int) -> list[Delivery]:
        return [Delivery(encode(m), subject, 1, first_seq + n) for n, m in enumerate(messages)]

    # The file's owner ended the handoff, canceled, and lost the partition.
    held = Planner(SUBJECTS, 8, 1.0, tombstone_ttl_ms=ttl_ms)
    file = MemoryLog()
    stream = deliveries(inputs, 0)
    ended = held.plan(stream, held.decode(stream), {}, NOW_MS, NOW_MS / 1000)
    file.commit(ended.batch)
    last = ended.batch.handoffs[start.handoff_id].last_seq
    cleanups = [a for _, _, a in ended.publish if isinstance(a, CancelSource | CancelDestination)]
    assert [t.state for t in ended.ended] == ["canceled"] and len(cleanups) == 2
    # The next owner logged the tier's answers for the cleanups after the end (late outcomes).
    answers: list[Input] = [
        ActionOutcome(start.handoff_id, a.action_id, NOOP, by_tier=True) for a in cleanups
    ]
    next_owner = Planner(SUBJECTS, 8, 1.0, tombstone_ttl_ms=ttl_ms)
    next_owner.tombstones = dict(held.tombstones)
    late = deliveries(answers[:1], 100)
    loaded = file.load([start.handoff_id])
    logged = next_owner.plan(late, next_owner.decode(late), loaded, NOW_MS + 1, NOW_MS / 1000)
    assert [e[1] for e in logged.batch.events] == [last + 1]
    tombstone = next_owner.tombstones[start.handoff_id]

    # A claim caught the file up from a snapshot that knows the handoff by that tombstone.
    # The same answer comes again (given again, as identical answers are), and another one.
    again = deliveries(answers, 200)
    later_ms = NOW_MS + 1_000
    claimant = Planner(SUBJECTS, 8, 1.0, tombstone_ttl_ms=ttl_ms)
    claimant.tombstones = {start.handoff_id: tombstone}
    prefix = file.load([start.handoff_id])
    plan = claimant.plan(again, claimant.decode(again), prefix, later_ms, later_ms / 1000)
    assert plan.duplicates == 1 and [index for index, _ in plan.rejections] == [1]
    assert "ended (canceled)" in plan.rejections[0][1].reason
    assert not plan.batch.events and not plan.batch.handoffs and not plan.publish
    assert not claimant.open and claimant.tombstones == {start.handoff_id: tombstone}

    # With its whole history, the file answers as before: the duplicate is dropped by its own
    # digests, and the other answer logged after the first.
    file.commit(logged.batch)
    whole = file.load([start.handoff_id])
    owner = Planner(SUBJECTS, 8, 1.0, tombstone_ttl_ms=ttl_ms)
    owner.tombstones = {start.handoff_id: tombstone}
    plan = owner.plan(again, owner.decode(again), whole, later_ms, later_ms / 1000)
    assert plan.duplicates == 1 and not plan.rejections
    assert [e[1] for e in plan.batch.events] == [last + 2]
