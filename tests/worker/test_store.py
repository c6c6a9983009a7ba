"""The event log's contract, against real SQLite files: what a committed batch leaves behind,
what a colliding batch leaves behind (nothing), and what recovery, the outbox and compaction
read back. Records come from the real coordinator, written the way the service writes them."""

from __future__ import annotations

import dataclasses
import os
import re
import sqlite3
import stat
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import closing
from pathlib import Path

import pytest

from events.codec import input_digest
from events.coordinator import HandoffCoordinator
from events.messages import (
    SUBMITTED,
    Action,
    ActionOutcome,
    Canceled,
    EngineType,
    HandoffCompletion,
    Input,
    StartHandoff,
    SubmitPrefill,
)
from events.records import ActionRecord, InputRecord
from tests.worker.scripted_engine import Script, success_script
from tests.worker.tmpfs import fill, small_filesystem
from worker.errors import StoreConflict, StoreError, StoreLocked
from worker.schema import HandoffState
from worker.store import (
    Batch,
    Compacted,
    CorruptHandoff,
    EventLog,
    HandoffRow,
    Loaded,
    LoadedHandoff,
    LoggedEvent,
    UnpublishedAction,
    WriterLock,
)


class Handoff:
    """One handoff driven through the real coordinator, logged as the service logs it.

    `events` is what the log must hold for it once the batches it wrote are committed.
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

    @property
    def id(self) -> uuid.UUID:
        return self.start.handoff_id

    def feed(self, batch: Batch, message: Input, at_ms: int) -> list[Action]:
        """Apply one input and append it, the actions it issued and the projection."""
        actions = self.coordinator.handle(message)
        seq = self.row.last_seq + 1
        digest = input_digest(message)
        batch.append_input(seq, InputRecord(at_ms, message), digest)
        self.events.append(LoggedEvent(seq, at_ms, InputRecord(at_ms, message), digest, None))
        for action in actions:
            seq += 1
            batch.append_action(seq, ActionRecord(at_ms, action))
            self.events.append(LoggedEvent(seq, at_ms, ActionRecord(at_ms, action), None, None))
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
        batch.mark_published(self.id, seq, at_ms)
        self.events[seq] = dataclasses.replace(self.events[seq], published_at_ms=at_ms)

    def action_seqs(self) -> list[int]:
        return [e.seq for e in self.events if isinstance(e.record, ActionRecord)]


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
        whole.published += batch.published
        whole.rejections += batch.rejections
    return whole


def batch_of(handoff: Handoff, batch: Batch) -> Batch:
    """Only the part of `batch` that belongs to `handoff`."""
    own = Batch()
    own.events = [e for e in batch.events if e[0] == str(handoff.id)]
    own.handoffs = {handoff.id: batch.handoffs[handoff.id]}
    return own


def readable(loaded: dict[uuid.UUID, Loaded]) -> dict[uuid.UUID, LoadedHandoff]:
    corrupt = [h for h in loaded.values() if isinstance(h, CorruptHandoff)]
    assert not corrupt, corrupt
    return {h: handoff for h, handoff in loaded.items() if isinstance(handoff, LoadedHandoff)}


def table(db: Path, sql: str, *parameters: object) -> list[tuple[object, ...]]:
    """Rows read by a separate, plain sqlite3 connection: what is really in the file."""
    with closing(sqlite3.connect(db)) as connection:
        return connection.execute(sql, parameters).fetchall()


def alter(db: Path, sql: str) -> None:
    """Change the file behind the log's back, and commit."""
    with closing(sqlite3.connect(db)) as connection, connection:
        connection.execute(sql)


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
    """An aiosqlite connection left open keeps a non-daemon thread, which hangs the process."""
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
        assert loaded[handoff.id].row == handoff.row
        assert loaded[handoff.id].events == handoff.events
    # Spot-check the expectations themselves: seq counts from 0 with no gaps, inputs carry
    # their digest and actions none, and a finished handoff's projection says so.
    events = loaded[done.id].events
    assert [e.seq for e in events] == list(range(len(events))) and len(events) == 15
    assert all((e.digest is None) == isinstance(e.record, ActionRecord) for e in events)
    assert loaded[done.id].row.completed_at_ms == 1_000
    assert loaded[done.id].row.last_seq == 14


async def test_published_marks_are_loaded_and_never_overwritten(log: EventLog) -> None:
    handoff, batch = completed(1_000)
    await log.commit(batch)
    first_action = handoff.action_seqs()[0]
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


async def test_a_colliding_batch_writes_nothing(log: EventLog, db: Path) -> None:
    existing, batch = started(1_000)
    existing.feed(batch, ActionOutcome(existing.id, 0, SUBMITTED), 1_001)  # seq 2
    await log.commit(batch)

    # A second writer with a stale copy of `existing` (last_seq 1) appends another input at
    # seq 2, in a batch that also starts a new handoff, marks an action and logs a rejection.
    newcomer, stale = started(2_000)
    stale.append_input(
        2, InputRecord(2_000, Canceled(existing.id)), input_digest(Canceled(existing.id))
    )
    stale.upsert_handoff(dataclasses.replace(existing.row, last_seq=3, updated_at_ms=2_000))
    stale.mark_published(existing.id, 1, 2_000)
    stale.reject(2_000, None, "undecodable input", b"{")

    with pytest.raises(StoreConflict, match=r"events\.handoff_id, events\.seq"):
        await log.commit(stale)

    assert table(db, "SELECT * FROM handoffs WHERE handoff_id = ?", str(newcomer.id)) == []
    assert table(db, "SELECT * FROM events WHERE handoff_id = ?", str(newcomer.id)) == []
    assert table(db, "SELECT * FROM rejections") == []
    loaded = readable(await log.load([existing.id]))[existing.id]
    assert loaded.row == existing.row  # last_seq 2, not the stale writer's 3
    assert loaded.events == existing.events  # seq 2 is still the outcome; nothing published
    # The failed transaction was rolled back, so the connection goes on writing.
    await log.commit(batch_of(newcomer, stale))
    assert set(readable(await log.load([newcomer.id]))) == {newcomer.id}


async def test_every_input_digest_survives_a_reopen(log: EventLog, db: Path) -> None:
    """The worker de-duplicates against the digests it loads with a handoff: they must be
    exactly the logged inputs' digests, after the log is closed and opened again."""
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
        expected = [
            UnpublishedAction(h.row, e.seq, e.record)
            for h in handoffs
            for e in h.events
            if isinstance(e.record, ActionRecord) and e.published_at_ms is None
        ]
        return sorted(expected, key=lambda u: (str(u.row.handoff_id), u.seq))

    assert await log.unpublished_actions() == backlog(done, waiting)
    assert len(backlog(done, waiting)) == len(done.action_seqs()) + 1

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
    assert recovered[waiting.id].row == waiting.row
    assert recovered[waiting.id].events == waiting.events


async def test_an_unreadable_handoff_is_reported_alone(log: EventLog, db: Path) -> None:
    """One bad record or row makes its own handoff corrupt; the others load as usual."""
    bad_record, first = started(1_000)
    bad_state, second = started(1_000)
    good, third = started(2_000)
    await log.commit(merged(first, second, third))
    alter(db, f"UPDATE events SET record = x'c1' WHERE handoff_id = '{bad_record.id}' AND seq = 1")
    alter(db, f"UPDATE handoffs SET state = 'half-open' WHERE handoff_id = '{bad_state.id}'")

    loaded = await log.load([bad_record.id, bad_state.id, good.id])
    recovered = await log.open_handoffs()

    assert loaded[good.id] == LoadedHandoff(good.row, good.events)
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
    for handoff in (old, old_canceled):
        assert table(db, "SELECT * FROM events WHERE handoff_id = ?", str(handoff.id)) == []
    assert await log.compact(3_000) == Compacted(handoffs=0, rejections=0)


async def test_compact_removes_rejections_logged_before_the_cutoff(log: EventLog, db: Path) -> None:
    """Rejections keep whole payloads; only those of a quarantined handoff are kept, however old:
    they are the evidence an operator needs."""
    old, a = completed(1_000)
    quarantined, b = started(1_000)
    b.upsert_handoff(dataclasses.replace(quarantined.row, state=HandoffState.QUARANTINED))
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
        async with log._db.execute("PRAGMA synchronous") as cursor:
            assert await cursor.fetchone() == (level,)
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
        assert {h: (loaded[h].row, loaded[h].events) for h in loaded} == {
            done.id: (done.row, done.events),
            waiting.id: (waiting.row, waiting.events),
        }
        assert set(readable(await reopened.open_handoffs())) == {waiting.id}
        assert len(await reopened.unpublished_actions()) == len(done.action_seqs())
    finally:
        await reopened.close()


async def test_events_of_decodes_one_handoffs_log(log: EventLog) -> None:
    done, first = completed(1_000, engine_type=EngineType.TRTLLM)
    waiting, second = started(2_000)
    await log.commit(merged(first, second))

    assert await log.events_of(done.id) == done.events
    assert await log.events_of(waiting.id) == waiting.events
    assert await log.events_of(uuid.uuid4()) == []


@pytest.mark.usefixtures("no_leaked_threads")
async def test_a_log_of_another_layout_is_refused(db: Path) -> None:
    await (await EventLog.open(db)).close()
    alter(db, "UPDATE meta SET value = '2' WHERE key = 'layout'")

    expected = f"event log {db} has layout '2', this build reads and writes layout '1'"
    with pytest.raises(StoreError, match=re.escape(expected)):
        await EventLog.open(db)


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
    await log._db.execute("PRAGMA busy_timeout = 0")
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
