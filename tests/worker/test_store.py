"""The event log's contract, against real SQLite files: what a committed batch leaves behind,
what a colliding batch leaves behind (nothing), and what recovery, the outbox and compaction
read back; and a layout-1 log (a copy of the golden one) migrated to layout 2. Records come from
the real coordinator, written the way the service writes them."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import sqlite3
import stat
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import closing
from pathlib import Path

import msgspec
import pytest

from kvhandoff.events.codec import encode_record, input_digest
from kvhandoff.events.coordinator import HandoffCoordinator
from kvhandoff.events.messages import (
    NOOP,
    SUBMITTED,
    Action,
    ActionOutcome,
    Canceled,
    Complete,
    EngineType,
    HandoffCompletion,
    Input,
    StartHandoff,
    SubmitPrefill,
)
from kvhandoff.events.records import ActionRecord, InputRecord
from kvhandoff.worker.commands.verify import verify_log
from kvhandoff.worker.engines.healthy import success_script
from kvhandoff.worker.errors import StoreConflict, StoreError, StoreLocked
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.log.rows import (
    Batch,
    CorruptHandoff,
    HandoffLog,
    HandoffRow,
    LiveState,
    Loaded,
    LoggedEvent,
    Tombstone,
)
from kvhandoff.worker.log.schema import RECORD_TYPES, HandoffState
from kvhandoff.worker.log.store import Compacted, EventLog, UnpublishedAction, WriterLock
from kvhandoff.worker.tier.entries import LoggedRows, decode_rows, encode_entry
from tests.tools.conftest import IDS, V1
from tests.worker.scripted_engine import Script
from tests.worker.tmpfs import fill, small_filesystem


class Handoff:
    """One handoff driven through the real coordinator, logged as the service logs it.

    `events` is what the log must hold for it once the batches it wrote are committed, with
    the outbox as the log keeps it: one mark per handoff, every action up to `published_seq`
    published by `marked_at_ms`.
    """

    def __init__(self, engine_type: EngineType = EngineType.VLLM, started_at_ms: int = 0) -> None:
        self.start = StartHandoff(uuid.uuid4(), engine_type, "prefill-0", "decode-0", 60_000)
        self.coordinator = HandoffCoordinator.for_start(self.start)
        self.row = HandoffRow(
            handoff_id=self.start.handoff_id,
            engine_type=engine_type.value,
            source=self.start.source,
            destination=self.start.destination,
            started_at_ms=started_at_ms,
            deadline_at_ms=started_at_ms + self.start.deadline_ms,
            state=HandoffState.OPEN,
            completed_at_ms=None,
            last_seq=-1,
            updated_at_ms=started_at_ms,
        )
        self.events: list[LoggedEvent] = []
        self.published_seq = -1
        self.marked_at_ms: int | None = None

    @property
    def id(self) -> uuid.UUID:
        return self.start.handoff_id

    def feed(self, batch: Batch, message: Input, at_ms: int) -> list[Action]:
        """Apply one input and append it, the actions it issued and the projection."""
        actions = self.coordinator.handle(message)
        seq = self.row.last_seq + 1
        batch.append_input(seq, InputRecord(at_ms, message))
        self.events.append(LoggedEvent(seq, at_ms, InputRecord(at_ms, message)))
        for action in actions:
            seq += 1
            batch.append_action(seq, ActionRecord(at_ms, action))
            self.events.append(LoggedEvent(seq, at_ms, ActionRecord(at_ms, action)))
        row = self.row
        row.last_seq, row.updated_at_ms = seq, at_ms
        if self.coordinator.is_complete and row.state is HandoffState.OPEN:
            success = self.coordinator.completion is HandoffCompletion.SUCCESS
            row.state = HandoffState.SUCCEEDED if success else HandoffState.CANCELED
            row.completed_at_ms = at_ms
        batch.upsert_handoff(row)
        return actions

    def drive(
        self, batch: Batch, at_ms: int, *messages: Input, script: Script = success_script
    ) -> None:
        """Feed the messages, then the engines' answers to every action, until quiet."""
        pending = list(messages)
        while pending:
            for action in self.feed(batch, pending.pop(0), at_ms):
                pending.extend(script(action))

    def publish(self, batch: Batch, seq: int, at_ms: int) -> None:
        """Mark the action at `seq`, and so every one before it, published (a mark that does
        not move forward changes nothing)."""
        batch.mark_published(self.id, seq, at_ms)
        if seq > self.published_seq:
            self.published_seq, self.marked_at_ms = seq, at_ms
        self.events = [
            msgspec.structs.replace(e, published_at_ms=self.marked_at_ms)
            if isinstance(e.record, ActionRecord) and e.seq <= self.published_seq
            else e
            for e in self.events
        ]

    def action_seqs(self) -> list[int]:
        return [e.seq for e in self.events if isinstance(e.record, ActionRecord)]

    def backlog(self) -> list[UnpublishedAction]:
        """What a claim publishes again of it: its actions not marked published that no
        logged outcome answers (the Complete of a handoff that succeeded, say)."""
        answered = {
            e.record.input.action_id
            for e in self.events
            if isinstance(e.record, InputRecord) and isinstance(e.record.input, ActionOutcome)
        }
        return [
            UnpublishedAction(self.row, e.seq, e.record)
            for e in self.events
            if isinstance(e.record, ActionRecord)
            and e.published_at_ms is None
            and e.record.action.action_id not in answered
        ]


def completed(at_ms: int, *, engine_type: EngineType = EngineType.VLLM) -> tuple[Handoff, Batch]:
    handoff, batch = Handoff(engine_type, at_ms), Batch()
    handoff.drive(batch, at_ms, handoff.start)
    assert handoff.row.state is HandoffState.SUCCEEDED
    return handoff, batch


def canceled(at_ms: int) -> tuple[Handoff, Batch]:
    """A handoff the frontend cancels while its prefill is still running."""
    handoff, batch = Handoff(started_at_ms=at_ms), Batch()

    def prefill_runs(action: Action) -> list[Input]:
        if isinstance(action, SubmitPrefill):
            return [ActionOutcome(action.handoff_id, action.action_id, SUBMITTED)]
        return success_script(action)

    handoff.drive(batch, at_ms, handoff.start, Canceled(handoff.id), script=prefill_runs)
    assert handoff.row.state is HandoffState.CANCELED
    return handoff, batch


def started(at_ms: int) -> tuple[Handoff, Batch]:
    """A handoff that is open: started, its first action issued and unanswered."""
    handoff, batch = Handoff(started_at_ms=at_ms), Batch()
    handoff.feed(batch, handoff.start, at_ms)
    assert handoff.row.state is HandoffState.OPEN
    return handoff, batch


def merged(*batches: Batch) -> Batch:
    whole = Batch()
    for batch in batches:
        whole.events += batch.events
        whole.handoffs.update(batch.handoffs)
        for handoff_id, (seq, at_ms) in batch.published.items():
            whole.mark_published(handoff_id, seq, at_ms)
        whole.rejections += batch.rejections
    return whole


def batch_of(handoff: Handoff, batch: Batch) -> Batch:
    """Only the part of `batch` that belongs to `handoff`."""
    own = Batch()
    own.events = [e for e in batch.events if e[0] == str(handoff.id)]
    own.handoffs = {handoff.id: batch.handoffs[handoff.id]}
    return own


def readable(loaded: dict[uuid.UUID, Loaded]) -> dict[uuid.UUID, HandoffLog]:
    corrupt = [h for h in loaded.values() if isinstance(h, CorruptHandoff)]
    assert not corrupt, corrupt
    return {h: handoff for h, handoff in loaded.items() if isinstance(handoff, HandoffLog)}


def table(db: Path, sql: str, *parameters: object) -> list[tuple[object, ...]]:
    """Rows read by a separate, plain sqlite3 connection: what is really in the file."""
    with closing(sqlite3.connect(db)) as connection:
        return connection.execute(sql, parameters).fetchall()


def alter(db: Path, sql: str, *parameters: object) -> None:
    """Change the file behind the log's back, and commit."""
    with closing(sqlite3.connect(db)) as connection, connection:
        connection.execute(sql, parameters)


KEY_OF = "(SELECT handoff_key FROM handoffs WHERE handoff_id = ?)"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "kvhandoff.db"


@pytest.fixture
async def log(db: Path) -> AsyncIterator[EventLog]:
    opened = await EventLog.open(db)
    yield opened
    await opened.close()


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """A connection left open keeps its executor's thread, which hangs the process."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before]
    for thread in leaked:
        thread.join(timeout=5)
    assert not [t for t in leaked if t.is_alive()], "a connection was left open"


async def test_commit_then_load_round_trips_records_and_rows(log: EventLog) -> None:
    done, first = completed(1_000, engine_type=EngineType.SGLANG)
    waiting, second = started(2_000)
    await log.commit(merged(first, second))

    loaded = readable(await log.load([done.id, waiting.id, uuid.uuid4()]))

    assert set(loaded) == {done.id, waiting.id}  # an unknown id is simply absent
    for handoff in (done, waiting):
        assert loaded[handoff.id].handoff == handoff.row
        assert loaded[handoff.id].events == handoff.events
    # Spot-check the expectations themselves: seq counts from 0 with no gaps, inputs carry
    # their digest and actions none, and a finished handoff's projection says so.
    events = loaded[done.id].events
    assert [e.seq for e in events] == list(range(len(events))) and len(events) == 15
    assert all((e.digest is None) == isinstance(e.record, ActionRecord) for e in events)
    assert loaded[done.id].handoff.completed_at_ms == 1_000
    assert loaded[done.id].handoff.last_seq == 14


async def test_published_marks_are_loaded_and_never_overwritten(log: EventLog) -> None:
    handoff, batch = completed(1_000)
    await log.commit(batch)
    first_action, _, third_action = handoff.action_seqs()[:3]
    marks = Batch()
    handoff.publish(marks, first_action, 1_100)
    await log.commit(marks)
    # A second mark of the same action (a republish) keeps the first time.
    again = Batch()
    again.mark_published(handoff.id, first_action, 9_999)
    await log.commit(again)

    events = readable(await log.load([handoff.id]))[handoff.id].events
    assert events == handoff.events
    assert [e.seq for e in events if e.published_at_ms is not None] == [first_action]
    assert events[first_action].published_at_ms == 1_100

    # One mark per handoff: a mark further on covers every action before it, and keeps its
    # own time; a mark behind it changes nothing.
    further = Batch()
    handoff.publish(further, third_action, 2_000)
    further.mark_published(handoff.id, first_action, 9_999)
    await log.commit(further)
    events = readable(await log.load([handoff.id]))[handoff.id].events
    assert events == handoff.events
    published = [(e.seq, e.published_at_ms) for e in events if e.published_at_ms is not None]
    assert published == [(seq, 2_000) for seq in handoff.action_seqs()[:3]]


async def test_a_colliding_batch_writes_nothing(log: EventLog, db: Path) -> None:
    existing, batch = started(1_000)
    existing.feed(batch, ActionOutcome(existing.id, 0, SUBMITTED), 1_001)  # seq 2
    await log.commit(batch)

    # A second writer with a stale copy of `existing` (last_seq 1) appends another input at
    # seq 2, in a batch that also starts a new handoff, marks an action and logs a rejection.
    newcomer, stale = started(2_000)
    stale.append_input(2, InputRecord(2_000, Canceled(existing.id)))
    stale.upsert_handoff(msgspec.structs.replace(existing.row, last_seq=3, updated_at_ms=2_000))
    stale.mark_published(existing.id, 1, 2_000)
    stale.reject(2_000, None, "undecodable input", b"{")

    with pytest.raises(StoreConflict, match=r"events\.handoff_key, events\.seq"):
        await log.commit(stale)

    assert table(db, "SELECT * FROM handoffs WHERE handoff_id = ?", str(newcomer.id)) == []
    assert table(db, "SELECT count(*) FROM events") == [(len(existing.events),)]
    assert table(db, "SELECT * FROM rejections") == []
    loaded = readable(await log.load([existing.id]))[existing.id]
    assert loaded.handoff == existing.row  # last_seq 2, not the stale writer's 3
    assert loaded.events == existing.events  # seq 2 is still the outcome; nothing published
    # The failed transaction was rolled back, so the connection goes on writing.
    await log.commit(batch_of(newcomer, stale))
    assert set(readable(await log.load([newcomer.id]))) == {newcomer.id}


async def test_queued_batches_commit_in_groups_in_queue_order(log: EventLog) -> None:
    """Batches queued without waiting ride in as few group commits as the writer makes; each
    group leads with the batch queued first in it, and its batches share its time."""
    handoffs, batches = zip(*(completed(1_000 + i) for i in range(6)), strict=True)
    queued = [log.queue(batch) for batch in batches]

    committed = [await future for future in queued]

    assert committed[0].leads
    for before, after in itertools.pairwise(committed):
        assert after.leads or after.seconds == before.seconds
    loaded = readable(await log.load([h.id for h in handoffs]))
    assert {h: loaded[h.id].events for h in handoffs} == {h: h.events for h in handoffs}


async def test_a_failed_queued_batch_fails_the_batches_queued_behind_it_until_resumed(
    log: EventLog, db: Path
) -> None:
    """A batch queued behind one that failed was planned on top of it: it must not be written
    either, whichever group it rode in, until the worker calls `resume`."""
    first, first_batch = completed(1_000)
    await log.queue(first_batch)
    # Planned on a stale copy of `first`: seq 0 is taken, so the batch collides.
    stale = Batch()
    stale.append_input(0, InputRecord(2_000, Canceled(first.id)))
    behind, behind_batch = completed(3_000)

    collided, skipped = log.queue(stale), log.queue(behind_batch)

    with pytest.raises(StoreConflict, match=r"events\.handoff_key, events\.seq"):
        await collided
    with pytest.raises(StoreError):
        await skipped
    assert table(db, "SELECT * FROM handoffs WHERE handoff_id = ?", str(behind.id)) == []
    # Still refused until `resume`, then written.
    with pytest.raises(StoreError, match="a batch queued before it failed"):
        await log.queue(behind_batch)
    await log.resume()
    await log.queue(behind_batch)
    loaded = readable(await log.load([first.id, behind.id]))
    assert {h: loaded[h.id].events for h in (first, behind)} == {
        first: first.events,
        behind: behind.events,
    }


async def test_every_input_digest_survives_a_reopen(log: EventLog, db: Path) -> None:
    """The worker de-duplicates against the digests it loads with a handoff: they must be
    exactly the logged inputs' digests (derived from the records: layout 2 stores none), after
    the log is closed and opened again."""
    handoff, batch = started(1_000)
    await log.commit(batch)
    await log.close()

    reopened = await EventLog.open(db)
    try:
        loaded = readable(await reopened.load([handoff.id]))[handoff.id]
    finally:
        await reopened.close()
    digests = [e.digest for e in loaded.events if isinstance(e.record, InputRecord)]
    assert digests == [input_digest(handoff.start)]


async def test_unpublished_actions_are_the_outbox_backlog(log: EventLog) -> None:
    done, first = completed(1_000)
    waiting, second = started(2_000)
    await log.commit(merged(first, second))

    def backlog(*handoffs: Handoff) -> list[UnpublishedAction]:
        # In the order the handoffs were first logged, each in seq order.
        return [unpublished for h in handoffs for unpublished in h.backlog()]

    assert await log.unpublished_actions() == backlog(done, waiting)
    # Of the handoff that succeeded, its Complete alone: its engines answered the rest, and a
    # claim that published them again would have an engine that restarted since do them anew
    # (seeds 590 and 622 of `kvhandoff sim`'s short runs: a reservation nothing released).
    assert [type(u.record.action) for u in backlog(done, waiting)] == [Complete, SubmitPrefill]

    marks = Batch()
    for seq in done.action_seqs()[:3]:
        done.publish(marks, seq, 3_000)
    await log.commit(marks)
    assert await log.unpublished_actions() == backlog(done, waiting)

    marks = Batch()
    for handoff in (done, waiting):
        for seq in handoff.action_seqs():
            handoff.publish(marks, seq, 4_000)
    await log.commit(marks)
    assert await log.unpublished_actions() == []


async def test_a_snapshot_closes_the_outbox_of_what_the_file_holds_ended_alike(
    log: EventLog, db: Path
) -> None:
    """A handoff the file holds ended, with none of its actions marked published (its owner
    stopped before a later batch carried the marks), ended as the snapshot's tombstone says: its
    outbox closes, and only that. Published again by a claim, its `ReserveDestination` would
    reserve blocks at an engine that restarted since, for a handoff long over (seed 483 of
    `kvhandoff sim`)."""
    done, batch = completed(1_000)
    await log.commit(batch)
    assert done.row.completed_at_ms is not None
    assert await log.unpublished_actions() == done.backlog() != []
    before = table(db, "SELECT state, completed_at_ms, updated_at_ms FROM handoffs")
    state = LiveState()
    state.tombstones.append(
        Tombstone(done.id, HandoffState.SUCCEEDED.value, done.row.completed_at_ms, [])
    )
    await log.commit(Batch(merge=state))

    assert await log.unpublished_actions() == []
    assert table(db, "SELECT state, completed_at_ms, updated_at_ms FROM handoffs") == before
    loaded = readable(await log.load([done.id]))[done.id]
    assert [(e.seq, e.record) for e in loaded.events] == [(e.seq, e.record) for e in done.events]


async def test_a_snapshot_ends_what_the_file_held_open_and_closes_its_outbox(
    log: EventLog, db: Path
) -> None:
    """A claim catches a file up from a snapshot (`Batch.merge`): a handoff the file held open
    that the snapshot knows by its tombstone alone ended under another owner. Its row ends as
    the tombstone says and keeps the prefix of its history the file had, and none of its actions
    is in the backlog a claim publishes again: the owner that ended it published them, and a
    claim that published its `SubmitPrefill` again (seed 5 of `kvhandoff sim`) started work at
    an engine for a handoff that had ended. One the snapshot does not know is dropped; one it
    holds open keeps its backlog."""
    ended, first = started(1_000)
    forgotten, second = started(1_000)
    live, third = started(2_000)
    await log.commit(merged(first, second, third))
    tombstone = Tombstone(ended.id, HandoffState.SUCCEEDED.value, 5_000, [])
    snapshot = LiveState([live.row], [(live.id, -1, None)], batch_of(live, third).events)
    snapshot.tombstones.append(tombstone)
    await log.commit(Batch(merge=snapshot))

    assert await log.unpublished_actions() == [
        UnpublishedAction(live.row, e.seq, e.record)
        for e in live.events
        if isinstance(e.record, ActionRecord)
    ]
    assert set(readable(await log.open_handoffs())) == {live.id}
    loaded = readable(await log.load([ended.id, forgotten.id]))
    assert set(loaded) == {ended.id}
    row = loaded[ended.id].handoff
    assert (row.state, row.completed_at_ms, row.last_seq) == (HandoffState.SUCCEEDED, 5_000, 1)
    assert [(e.seq, e.record) for e in loaded[ended.id].events] == [
        (e.seq, e.record) for e in ended.events
    ]
    assert all(e.published_at_ms == 5_000 for e in loaded[ended.id].events if e.seq > 0)
    with open_log(db) as reader:
        assert reader.disagreeing_tombstones() == []


async def test_a_snapshot_replaces_the_tombstones_of_a_handoff_that_reopened(
    log: EventLog, db: Path
) -> None:
    """A handoff that succeeded may reopen on a late `Canceled` (docs/handoff.md) and end again,
    canceled. A snapshot is the partition's state at its point in the log, newer than anything
    a file it is merged into holds: a tombstone of a handoff it holds open is stale, and its
    own tombstones replace the file's. A file that kept a tombstone of the first ending (seed
    200 of `kvhandoff sim`: a snapshot taken while the handoff was reopened still carried it)
    contradicted its own rows once the handoff ended canceled, and would answer a claim that
    reads its tombstones (one without a snapshot) from the stale ending."""
    reopened, batch = completed(1_000)
    succeeded = Tombstone(reopened.id, HandoffState.SUCCEEDED.value, 1_000, [])
    cleanup = reopened.feed(batch, Canceled(reopened.id), 2_000)
    assert not reopened.coordinator.is_complete  # cleaning up after the reopen
    reopened.row.state, reopened.row.completed_at_ms = HandoffState.OPEN, None
    other, _ = completed(1_000)
    stale = Tombstone(other.id, HandoffState.SUCCEEDED.value, 1_000, [])
    snapshot = LiveState([reopened.row], [(reopened.id, -1, None)], batch.events, [succeeded])
    await log.commit(Batch(merge=LiveState(tombstones=[stale])))
    await log.commit(Batch(merge=snapshot))
    assert await log.tombstones(0) == [stale]

    later = Tombstone(other.id, HandoffState.CANCELED.value, 3_000, [])
    await log.commit(Batch(merge=LiveState(tombstones=[later])))
    assert await log.tombstones(0) == [later]

    ending = Batch()
    reopened.drive(ending, 3_000, *(i for a in cleanup for i in success_script(a)))
    assert reopened.row.state is HandoffState.CANCELED
    await log.commit(ending)
    with open_log(db) as reader:
        assert reader.disagreeing_tombstones() == []


async def test_a_snapshot_ends_again_what_the_file_holds_ended_otherwise(
    log: EventLog, db: Path
) -> None:
    """A file holds a handoff that succeeded; in entries it never had, a late `Canceled`
    reopened it and it ended canceled, and the snapshot the file is caught up from knows it by
    that tombstone alone. Its row ends as the tombstone says, over the history the file holds
    (its outbox closed), as a row the file held open would: a row that kept its first ending
    beside the snapshot's tombstone contradicted it (seeds 2991 and 2993 of `kvhandoff sim`).
    A row that ended as the tombstone says is left as it is, but for its outbox, which closes
    too (see the test before); one started after that end, another handoff of the same id, is
    left whole."""
    first, batch = completed(1_000)
    same, second = canceled(1_000)
    reused, third = completed(9_000)
    await log.commit(merged(batch, second, third))
    assert await log.unpublished_actions() != []
    canceled_later = Tombstone(first.id, HandoffState.CANCELED.value, 5_000, [])
    as_held = Tombstone(same.id, HandoffState.CANCELED.value, 1_000, [])
    before_it = Tombstone(reused.id, HandoffState.CANCELED.value, 5_000, [])
    await log.commit(Batch(merge=LiveState(tombstones=[canceled_later, as_held, before_it])))

    loaded = readable(await log.load([first.id, same.id, reused.id]))
    row = loaded[first.id].handoff
    assert (row.state, row.completed_at_ms) == (HandoffState.CANCELED, 5_000)
    assert [(e.seq, e.record) for e in loaded[first.id].events] == [
        (e.seq, e.record) for e in first.events
    ]
    assert loaded[same.id].handoff == same.row and loaded[reused.id].handoff == reused.row
    backlog = await log.unpublished_actions()
    assert {u.row.handoff_id for u in backlog if isinstance(u, UnpublishedAction)} == {reused.id}
    with open_log(db) as reader:
        assert reader.disagreeing_tombstones() == []


async def test_a_catch_up_takes_the_history_an_entry_carries_of_a_handoff_that_ended(
    log: EventLog, db: Path, tmp_path: Path
) -> None:
    """A snapshot taken after a handoff ended knows it by its tombstone alone; an entry after
    it that appends to the handoff (a late `Canceled` reopened it; a late outcome is logged after
    its end) carries the history it logged before, with its outbox mark (`Batch.carry`). A claim
    catches a file up from the snapshot and those entries in one batch: a file that held the
    handoff open in part, and a file that held nothing of it, each end with its whole history,
    no gap (seeds 3000 and 3003 of `kvhandoff sim`: "log skips from sequence 12 to 15"), its
    actions before the mark not published again, and no tombstone beside its rows (the rows
    are newer). A history that overlaps a later entry's events goes in once."""
    handoff, first = started(1_000)
    await log.commit(first)  # the file that holds its start, open
    ending = Batch()
    prefill = handoff.events[-1].record
    assert isinstance(prefill, ActionRecord)
    handoff.drive(ending, 2_000, *success_script(prefill.action))
    for seq in handoff.action_seqs():
        handoff.publish(ending, seq, 2_500)
    assert handoff.row.state is HandoffState.SUCCEEDED
    succeeded = Tombstone(handoff.id, HandoffState.SUCCEEDED.value, 2_000, [])

    def carrying(at_ms: int, *messages: Input) -> tuple[Batch, list[Action]]:
        """The entry of a batch that loaded the ended handoff from its owner's file."""
        batch = Batch()
        batch.carry(HandoffLog(handoff.row.copy(), list(handoff.events)))
        actions = [a for m in messages for a in handoff.feed(batch, m, at_ms)]
        return batch, actions

    reopen, cleanup = carrying(3_000, Canceled(handoff.id))
    handoff.row.state, handoff.row.completed_at_ms = HandoffState.OPEN, None  # cleaning up
    reopen.upsert_handoff(handoff.row)
    ended_again = Batch()
    handoff.drive(ended_again, 4_000, *(i for a in cleanup for i in success_script(a)))
    assert handoff.row.state is HandoffState.CANCELED
    late_answer = ActionOutcome(handoff.id, cleanup[0].action_id, NOOP, by_tier=True)
    late, _ = carrying(5_000, late_answer)
    assert handoff.row.last_seq == handoff.events[-1].seq

    def catch_up() -> Batch:
        """As a claim builds it (worker.tier.partition): the snapshot, then each entry."""
        batch = Batch(merge=LiveState(tombstones=[succeeded]))
        for mark, entry in enumerate([reopen, ended_again, late]):
            rows = LoggedRows.of([mark], entry, [], [])
            decode_rows(encode_entry(rows), "the test's entry").add_to(batch)
        return batch

    cleanup_seqs = [u.seq for u in handoff.backlog() if u.seq > handoff.published_seq]
    assert cleanup_seqs
    for path in (db, tmp_path / "empty.db"):
        file = log if path == db else await EventLog.open(path)
        await file.commit(catch_up())
        loaded = readable(await file.load([handoff.id]))[handoff.id]
        assert [(e.seq, e.record) for e in loaded.events] == [
            (e.seq, e.record) for e in handoff.events
        ]
        assert loaded.handoff.state is HandoffState.CANCELED
        backlog = await file.unpublished_actions()
        assert [u.seq for u in backlog if isinstance(u, UnpublishedAction)] == cleanup_seqs
        assert len(backlog) == len(cleanup_seqs)
        assert await file.tombstones(0) == []
        if file is not log:
            await file.close()
        with open_log(path) as reader:
            assert verify_log(reader).findings == []
            assert reader.disagreeing_tombstones() == []


async def test_open_handoffs_are_the_open_ones_with_their_logs(log: EventLog) -> None:
    done, first = completed(1_000)
    gone, second = canceled(1_000)
    waiting, third = started(2_000)
    await log.commit(merged(first, second, third))

    recovered = readable(await log.open_handoffs())

    assert set(recovered) == {waiting.id}
    assert set(readable(await log.load([done.id, gone.id]))) == {
        done.id,
        gone.id,
    }  # logged, but closed
    assert recovered[waiting.id].handoff == waiting.row
    assert recovered[waiting.id].events == waiting.events


async def test_an_unreadable_handoff_is_reported_alone(log: EventLog, db: Path) -> None:
    """One bad record or row makes its own handoff corrupt; the others load as usual."""
    bad_record, first = started(1_000)
    bad_state, second = started(1_000)
    good, third = started(2_000)
    await log.commit(merged(first, second, third))
    alter(
        db,
        f"UPDATE events SET record = x'c1' WHERE handoff_key = {KEY_OF} AND seq = 1",
        str(bad_record.id),
    )
    alter(db, "UPDATE handoffs SET state = 'half-open' WHERE handoff_id = ?", str(bad_state.id))

    loaded = await log.load([bad_record.id, bad_state.id, good.id])
    recovered = await log.open_handoffs()

    assert loaded[good.id] == HandoffLog(good.row, good.events)
    assert set(recovered) == {bad_record.id, good.id}
    for found in (loaded, recovered):
        corrupt = found[bad_record.id]
        assert isinstance(corrupt, CorruptHandoff) and "seq 1" in corrupt.reason
    corrupt_row = loaded[bad_state.id]
    assert isinstance(corrupt_row, CorruptHandoff) and "half-open" in corrupt_row.reason


async def test_a_quarantine_sets_the_handoff_aside_with_its_reason(log: EventLog, db: Path) -> None:
    handoff, batch = started(1_000)
    await log.commit(batch)
    quarantine = Batch()
    quarantine.quarantine(1_500, handoff.id, "seq 1: undecodable")
    await log.commit(quarantine)

    assert await log.quarantined() == {handoff.id}
    assert readable(await log.open_handoffs()) == {}
    assert table(db, "SELECT state, updated_at_ms FROM handoffs") == [("quarantined", 1_500)]
    assert table(db, "SELECT handoff_id, reason FROM rejections") == [
        (str(handoff.id), "quarantined: seq 1: undecodable")
    ]


async def test_compact_removes_only_closed_handoffs_completed_before_the_cutoff(
    log: EventLog, db: Path
) -> None:
    old, a = completed(1_000)
    old_canceled, b = canceled(1_500)
    at_cutoff, c = completed(3_000)
    recent, d = completed(5_000)
    old_open, e = started(0)
    await log.commit(merged(a, b, c, d, e))

    assert await log.compact(3_000) == Compacted(handoffs=2, rejections=0)

    kept = readable(
        await log.load([h.id for h in (old, old_canceled, at_cutoff, recent, old_open)])
    )
    assert set(kept) == {at_cutoff.id, recent.id, old_open.id}
    for handoff in (at_cutoff, recent, old_open):
        assert kept[handoff.id].events == handoff.events
    kept_events = sum(len(h.events) for h in (at_cutoff, recent, old_open))
    assert table(db, "SELECT count(*) FROM events") == [(kept_events,)]
    assert await log.compact(3_000) == Compacted(handoffs=0, rejections=0)


async def test_compact_removes_rejections_logged_before_the_cutoff(log: EventLog, db: Path) -> None:
    """Rejections keep whole payloads; only those of a quarantined handoff are kept, however old:
    they are the evidence an operator needs."""
    old, a = completed(1_000)
    quarantined, b = started(1_000)
    b.upsert_handoff(msgspec.structs.replace(quarantined.row, state=HandoffState.QUARANTINED))
    rejections = Batch()
    rejections.reject(1_000, None, "undecodable input", b"{" * 1024)
    rejections.reject(2_999, old.id, "not expected", b"[]")
    rejections.reject(1_000, quarantined.id, "quarantined: replay diverged", b"")
    rejections.reject(2_000, quarantined.id, "handoff quarantined", b"{}")
    rejections.reject(3_000, None, "undecodable input", b"at the cutoff")
    await log.commit(merged(a, b, rejections))

    assert await log.compact(3_000) == Compacted(handoffs=1, rejections=2)

    assert table(db, "SELECT at_ms, handoff_id, reason FROM rejections ORDER BY id") == [
        (1_000, str(quarantined.id), "quarantined: replay diverged"),
        (2_000, str(quarantined.id), "handoff quarantined"),
        (3_000, None, "undecodable input"),
    ]
    assert set(await log.load([old.id, quarantined.id])) == {quarantined.id}


@pytest.mark.parametrize(("synchronous", "level"), [("FULL", 2), ("NORMAL", 1), ("EXTRA", 3)])
async def test_reopening_keeps_everything_in_wal_mode(
    db: Path, synchronous: str, level: int
) -> None:
    log = await EventLog.open(db, synchronous)
    try:
        # synchronous is a property of the connection, not of the file: ask the log's own.
        pragma = await log._write(lambda db: db.execute("PRAGMA synchronous").fetchone())
        assert pragma == (level,)
        done, first = completed(1_000)
        waiting, second = started(2_000)
        done.publish(second, done.action_seqs()[0], 2_000)
        await log.commit(merged(first, second))
    finally:
        await log.close()

    assert table(db, "PRAGMA journal_mode") == [("wal",)]  # persistent, unlike synchronous
    reopened = await EventLog.open(db, synchronous)
    try:
        loaded = readable(await reopened.load([done.id, waiting.id]))
        assert {h: (loaded[h].handoff, loaded[h].events) for h in loaded} == {
            done.id: (done.row, done.events),
            waiting.id: (waiting.row, waiting.events),
        }
        assert set(readable(await reopened.open_handoffs())) == {waiting.id}
        assert await reopened.unpublished_actions() == done.backlog() + waiting.backlog()
    finally:
        await reopened.close()


async def test_events_of_decodes_one_handoffs_log(log: EventLog) -> None:
    done, first = completed(1_000, engine_type=EngineType.TRTLLM)
    waiting, second = started(2_000)
    await log.commit(merged(first, second))

    assert await log.events_of(done.id) == done.events
    assert await log.events_of(waiting.id) == waiting.events
    assert await log.events_of(uuid.uuid4()) == []


async def test_the_log_names_every_type_number_this_build_writes(db: Path) -> None:
    """`record_types` is for people reading the file: opening the log adds what it lacks."""
    await (await EventLog.open(db)).close()
    alter(db, "DELETE FROM record_types WHERE kind = 'action'")
    await (await EventLog.open(db)).close()
    assert table(db, "SELECT * FROM record_types ORDER BY type") == sorted(RECORD_TYPES)


@pytest.mark.usefixtures("no_leaked_threads")
async def test_a_log_of_another_layout_is_refused(db: Path) -> None:
    await (await EventLog.open(db)).close()
    alter(db, "UPDATE meta SET value = '3' WHERE key = 'layout'")

    expected = f"event log {db} has layout '3', this build reads and writes layout '2'"
    with pytest.raises(StoreError, match=re.escape(expected)):
        await EventLog.open(db, migrate=True)


@pytest.mark.usefixtures("no_leaked_threads")
async def test_a_meta_table_of_another_shape_is_refused(db: Path) -> None:
    alter(db, "CREATE TABLE meta (name TEXT, version INTEGER)")

    with pytest.raises(StoreError, match=rf"cannot open event log {re.escape(str(db))}: "):
        await EventLog.open(db)


@pytest.fixture
def not_a_database(db: Path) -> Path:
    db.write_bytes(b"not an event log " * 100)
    return db


@pytest.mark.usefixtures("no_leaked_threads")
async def test_a_file_that_is_not_a_database_is_refused(not_a_database: Path) -> None:
    with pytest.raises(StoreError, match="file is not a database"):
        await EventLog.open(not_a_database)


@pytest.mark.usefixtures("no_leaked_threads")
async def test_an_unknown_synchronous_level_is_refused(db: Path) -> None:
    # SQLite itself would quietly run such a connection at NORMAL.
    with pytest.raises(StoreError, match="synchronous='OF' is not one of FULL, NORMAL, EXTRA"):
        await EventLog.open(db, "OF")
    assert not db.exists()  # noqa: ASYNC240  # a stat in a test's own tmp_path


async def test_a_locked_log_fails_with_store_errors_and_recovers(log: EventLog, db: Path) -> None:
    _, batch = completed(1_000)
    # Fail at once instead of after the 5 s busy timeout.
    await log._write(sqlite3.Connection.execute, "PRAGMA busy_timeout = 0")
    other = sqlite3.connect(db, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        with pytest.raises(StoreError, match="database is locked") as commit_error:
            await log.commit(batch)
        assert not isinstance(commit_error.value, StoreConflict)
        with pytest.raises(StoreError, match="database is locked"):
            await log.compact(10_000)
        other.execute("ROLLBACK")
    finally:
        other.close()

    # Neither failure left a transaction open on the log's connection.
    await log.commit(batch)
    assert await log.compact(10_000) == Compacted(handoffs=1, rejections=0)


def busy_error(tmp_path: Path) -> sqlite3.OperationalError:
    """SQLite's own answer to a read that may not wait for a lock another connection holds."""
    other = tmp_path / "rollback-journal.db"
    with closing(sqlite3.connect(other, isolation_level=None)) as holder:
        holder.execute("CREATE TABLE t (x)")
        holder.execute("BEGIN EXCLUSIVE")
        with (
            closing(sqlite3.connect(other, timeout=0)) as reader,
            pytest.raises(sqlite3.OperationalError) as busy,
        ):
            reader.execute("SELECT * FROM t")
        holder.execute("ROLLBACK")
    assert busy.value.sqlite_errorcode == sqlite3.SQLITE_BUSY
    return busy.value


class RefusingProbe:
    """Stands in for the event log's probe connection: every read fails with `error`."""

    def __init__(self, error: sqlite3.Error) -> None:
        self.error = error

    def execute(self, sql: str, parameters: object = ()) -> sqlite3.Cursor:
        raise self.error


async def test_a_load_the_probe_finds_busy_is_read_by_the_reader(
    log: EventLog, tmp_path: Path
) -> None:
    done, batch = completed(1_000)
    await log.commit(batch)
    probe, log._probe = log._probe, RefusingProbe(busy_error(tmp_path))  # type: ignore[assignment]
    try:
        loaded = readable(await log.load([done.id, uuid.uuid4()]))
    finally:
        log._probe = probe
    assert set(loaded) == {done.id}
    assert loaded[done.id].events == done.events


async def test_a_probe_that_fails_otherwise_fails_the_load_with_a_store_error(
    log: EventLog,
) -> None:
    probe, log._probe = log._probe, RefusingProbe(sqlite3.DatabaseError("disk I/O error"))  # type: ignore[assignment]
    try:
        with pytest.raises(StoreError, match="read failed: disk I/O error"):
            await log.load([uuid.uuid4()])
    finally:
        log._probe = probe


async def test_another_applications_database_is_left_untouched(tmp_path: Path) -> None:
    foreign = tmp_path / "someone-else.db"
    with closing(sqlite3.connect(foreign)) as connection:
        connection.execute("CREATE TABLE users (name TEXT)")
        connection.commit()

    with pytest.raises(StoreError, match="has layout None"):
        await EventLog.open(foreign)
    with closing(sqlite3.connect(foreign)) as connection:
        tables = {name for (name,) in connection.execute("SELECT name FROM sqlite_master")}
    assert tables == {"users"}


# --- the file itself ------------------------------------------------------------------------


@pytest.mark.usefixtures("no_leaked_threads")
async def test_an_empty_file_is_refused_as_a_lost_log(db: Path) -> None:
    """A 0-byte file is what a truncated or lost log looks like; adopting it as a new log would
    forget every open handoff."""
    db.touch()  # noqa: ASYNC240  # a file in the test's own tmp_path

    with pytest.raises(StoreError, match=rf"event log {re.escape(str(db))} is an empty file"):
        await EventLog.open(db)
    assert db.read_bytes() == b""  # noqa: ASYNC240
    assert sorted(p.name for p in db.parent.iterdir()) == [db.name]


@pytest.fixture
def usual_umask() -> Iterator[None]:
    """The umask most services run with, which leaves new files readable by everyone."""
    before = os.umask(0o022)
    yield
    os.umask(before)


@pytest.mark.usefixtures("usual_umask")
async def test_a_new_log_its_wal_and_shm_are_readable_by_the_owner_only(
    log: EventLog, db: Path
) -> None:
    """They hold raw payloads. SQLite gives the -wal and -shm files the database file's mode."""
    _, batch = started(1_000)
    await log.commit(batch)

    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in db.parent.iterdir()}
    assert files == {db.name: 0o600, f"{db.name}-wal": 0o600, f"{db.name}-shm": 0o600}


@pytest.mark.usefixtures("usual_umask")
async def test_an_existing_logs_mode_is_left_as_it_is(db: Path) -> None:
    await (await EventLog.open(db)).close()
    db.chmod(0o640)  # noqa: ASYNC240  # an operator's choice, e.g. for a backup group

    log = await EventLog.open(db)
    try:
        _, batch = started(1_000)
        await log.commit(batch)
    finally:
        await log.close()
    assert stat.S_IMODE(db.stat().st_mode) == 0o640  # noqa: ASYNC240


async def test_a_full_disk_fails_with_its_cause_and_the_log_recovers(tmp_path: Path) -> None:
    """When COMMIT fails for lack of space SQLite has already rolled back: the error must say
    "database or disk is full", and the log must work again once there is space."""
    with small_filesystem(tmp_path, 1024) as directory:
        db = directory / "kvhandoff.db"
        log = await EventLog.open(db)
        try:
            _, first = completed(1_000)
            await log.commit(first)
            waiting, second = started(2_000)
            # Larger than anything written so far, so it cannot fit in space the WAL has.
            second.reject(2_000, None, "undecodable input", b"x" * 256 * 1024)
            filler = fill(directory)

            with pytest.raises(StoreError, match="database or disk is full") as compact_error:
                await log.compact(10_000)
            with pytest.raises(StoreError, match="database or disk is full") as commit_error:
                await log.commit(second)
            for error in (compact_error, commit_error):
                assert isinstance(error.value.__cause__, sqlite3.OperationalError)
                assert "rollback" not in str(error.value)

            filler.unlink()
            await log.commit(second)
            assert await log.compact(1_500) == Compacted(handoffs=1, rejections=0)
        finally:
            await log.close()

        # The failed attempts left nothing behind; the retried commit is whole.
        assert table(db, "SELECT handoff_id FROM handoffs") == [(str(waiting.id),)]
        assert table(db, "SELECT length(payload) FROM rejections") == [(256 * 1024,)]


# --- one writer -----------------------------------------------------------------------------


def test_the_writer_lock_admits_one_holder_and_names_it(tmp_path: Path) -> None:
    """flock locks belong to an open file, so a second acquire in this process is refused just
    as another process's is (tests/worker/test_single_writer.py runs real workers)."""
    db = tmp_path / "kvhandoff.db"
    lock_file = tmp_path / "kvhandoff.db.lock"
    alias = tmp_path / "alias"
    alias.symlink_to(tmp_path, target_is_directory=True)
    with WriterLock.acquire(db):
        with pytest.raises(StoreLocked) as refused:
            WriterLock.acquire(alias / "kvhandoff.db")  # the same log, spelled another way
        assert re.fullmatch(
            rf"event log {re.escape(str(alias))}/kvhandoff\.db is in use by another worker:"
            rf" pid {os.getpid()} on host \S+, since \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
            rf" \(lock file {re.escape(str(lock_file))}\)",
            str(refused.value),
        )
        assert stat.S_IMODE(lock_file.stat().st_mode) == 0o600
        assert not db.exists()  # the lock is taken before the log is opened or created

    with WriterLock.acquire(alias / "kvhandoff.db") as again:
        assert again.path == lock_file


# --- a layout-1 log -------------------------------------------------------------------------


@pytest.fixture
def layout_1(db: Path) -> Path:
    """A copy of the golden layout-1 log, which this build reads and migrates."""
    shutil.copyfile(V1 / "log.sqlite3", db)
    return db


def logged_by_layout_1(path: Path) -> dict[uuid.UUID, list[tuple[int, int, object]]]:
    """Each handoff's (seq, at_ms, record), as the offline reader reads the golden log."""
    with open_log(path) as log:
        return {
            h.handoff_id: [(e.seq, e.at_ms, e.record) for e in log.load(h.handoff_id).events]
            for h in log.handoffs()
        }


@pytest.mark.usefixtures("no_leaked_threads")
async def test_a_layout_1_log_is_left_as_it_is_unless_migration_is_asked_for(
    layout_1: Path,
) -> None:
    before = layout_1.read_bytes()  # noqa: ASYNC240  # a file in the test's own tmp_path

    expected = (
        f"event log {layout_1} has layout '1', which this build reads but does not write: the"
        " worker (kvhandoff run) of this build migrates it to layout '2' when it starts"
    )
    with pytest.raises(StoreError, match=re.escape(expected)):
        await EventLog.open(layout_1)
    assert layout_1.read_bytes() == before  # noqa: ASYNC240


async def test_a_migrated_log_reads_back_what_layout_1_held(layout_1: Path) -> None:
    expected = logged_by_layout_1(layout_1)
    log = await EventLog.open(layout_1, migrate=True)
    try:
        loaded = readable(await log.load(list(expected)))
        recovered = readable(await log.open_handoffs())
        assert await log.unpublished_actions() == []  # the golden log published everything
        assert await log.quarantined() == set()
    finally:
        await log.close()

    assert {h: [(e.seq, e.at_ms, e.record) for e in loaded[h].events] for h in loaded} == expected
    open_ids = {IDS["stuck-on-reserve"], IDS["stuck-on-transfer"], IDS["just-started"]}
    assert {str(h) for h in recovered} == open_ids
    for handoff in loaded.values():
        for e in handoff.events:
            assert (e.digest is None) == isinstance(e.record, ActionRecord)
            assert (e.published_at_ms is None) == isinstance(e.record, InputRecord)
    assert table(layout_1, "SELECT value FROM meta") == [("2",)]
    assert table(layout_1, "SELECT * FROM record_types ORDER BY type") == sorted(RECORD_TYPES)
    # The offline reader sees the same as layout 2.
    assert logged_by_layout_1(layout_1) == expected


async def test_a_migrated_log_marks_published_up_to_the_first_action_that_was_not(
    layout_1: Path,
) -> None:
    # stuck-on-transfer logged actions at seqs 1, 4 and 7: the one at 4 never went out.
    handoff = IDS["stuck-on-transfer"]
    alter(
        layout_1,
        "UPDATE events SET published_at_ms = NULL WHERE handoff_id = ? AND seq = 4",
        handoff,
    )
    log = await EventLog.open(layout_1, migrate=True)
    await log.close()

    # Everything before seq 4 is marked published. (Its engines answered all three actions,
    # so no claim publishes them again, whatever the mark: `unpublished_actions`.)
    marked = "SELECT published_seq FROM handoffs WHERE handoff_id = ?"
    assert table(layout_1, marked, handoff) == [(3,)]


async def test_a_record_that_does_not_decode_is_kept_whole_and_its_handoff_quarantined(
    layout_1: Path,
) -> None:
    handoff = IDS["stuck-on-reserve"]
    damage = b"\xc1 not a record"
    alter(
        layout_1, "UPDATE events SET record = ? WHERE handoff_id = ? AND seq = 2", damage, handoff
    )
    log = await EventLog.open(layout_1, migrate=True)
    try:
        loaded = await log.open_handoffs()
    finally:
        await log.close()

    corrupt = loaded[uuid.UUID(handoff)]
    assert isinstance(corrupt, CorruptHandoff) and corrupt.reason.startswith("seq 2: ")
    assert table(layout_1, "SELECT seq, record FROM events WHERE type = 0") == [(2, damage)]
    assert all(isinstance(h, HandoffLog) for i, h in loaded.items() if str(i) != handoff)


async def test_a_record_of_another_handoff_is_kept_as_written_not_given_a_new_owner(
    layout_1: Path,
) -> None:
    """Layout 2 takes a record's handoff id from its row: carrying this one over split would
    make it the input of the handoff it is filed under, and its replay would accept it."""
    handoff, other = IDS["stuck-on-reserve"], uuid.UUID(IDS["source-first-success"])
    misfiled = encode_record(InputRecord(1, Canceled(other)))
    alter(
        layout_1, "UPDATE events SET record = ? WHERE handoff_id = ? AND seq = 2", misfiled, handoff
    )
    log = await EventLog.open(layout_1, migrate=True)
    try:
        events = readable(await log.load([uuid.UUID(handoff)]))[uuid.UUID(handoff)].events
    finally:
        await log.close()

    assert events[2].record == InputRecord(1, Canceled(other))
    assert table(layout_1, "SELECT seq, record FROM events WHERE type = 0") == [(2, misfiled)]


@pytest.mark.usefixtures("no_leaked_threads")
async def test_a_log_with_events_of_no_handoff_is_not_migrated_at_all(layout_1: Path) -> None:
    alter(layout_1, "DELETE FROM handoffs WHERE handoff_id = ?", IDS["frontend-cancel"])
    tables = table(layout_1, "SELECT name, sql FROM sqlite_master ORDER BY name")
    events = table(layout_1, "SELECT * FROM events ORDER BY handoff_id, seq")

    orphan = IDS["frontend-cancel"]
    orphans = rf"11 of its events belong to no row of the handoffs table \(handoff {orphan},"
    with pytest.raises(StoreError, match=orphans):
        await EventLog.open(layout_1, migrate=True)

    # One transaction: the log is layout 1 as it was.
    assert table(layout_1, "SELECT name, sql FROM sqlite_master ORDER BY name") == tables
    assert table(layout_1, "SELECT * FROM events ORDER BY handoff_id, seq") == events
    assert table(layout_1, "SELECT value FROM meta") == [("1",)]


def test_a_batch_keeps_the_row_as_it_was_when_upserted() -> None:
    """The worker plans the next batch before this one commits, changing the same row."""
    handoff, _ = started(1_000)
    row = handoff.row.copy()
    batch = Batch()
    batch.upsert_handoff(row)
    row.last_seq, row.state = 99, HandoffState.CANCELED
    assert batch.handoffs[handoff.id] == handoff.row  # every field copied, none shared
    assert batch.handoffs[handoff.id] is not row
