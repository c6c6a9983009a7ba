"""One contract for every reader of the event log (`worker.log.rows.HandoffReader`), run against
each: the offline SQLite reader, the JSONL export reader, the reader of a partitioned worker's data
directory, and the worker's own reads.

In the manner of eventsourcing's recorder test case: `ReaderContract` holds the tests, and each
subclass says only how to read a log that the worker's writer (`EventLog.commit`) wrote, and how
to damage one record of it in that reader's form. The expected handoffs are what the test gave
the writer (records, rows and outbox marks), never what some reader returned.

Left out, because the readers differ there on purpose: a state this build does not know (the
offline readers show it, the worker quarantines the handoff), and why a handoff was quarantined
(only the offline reader looks it up).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import sqlite3
import uuid
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import msgspec
import pytest

from kvhandoff.events.coordinator import HandoffCoordinator
from kvhandoff.events.errors import LogCorrupt
from kvhandoff.events.messages import Canceled, EngineType, HandoffCompletion, Input, StartHandoff
from kvhandoff.events.records import ActionRecord, InputRecord
from kvhandoff.worker.engines.healthy import success_script
from kvhandoff.worker.log.reader import DataDir, JsonlLog, SqliteLog, write_jsonl
from kvhandoff.worker.log.rows import (
    Batch,
    CorruptHandoff,
    HandoffLog,
    HandoffReader,
    HandoffRow,
    LoggedEvent,
)
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.log.store import EventLog


@dataclass(frozen=True)
class Written:
    """A log the worker's writer wrote, and every handoff in it as the writer was given it."""

    db: Path
    logs: dict[UUID, HandoffLog]

    def open_ids(self) -> set[UUID]:
        return {h for h, log in self.logs.items() if log.handoff.state is HandoffState.OPEN}


@dataclass(frozen=True)
class Case:
    engine_type: EngineType
    inputs: int  # how many inputs the handoff gets before the log is read
    cancel_at: int | None  # the frontend cancels as this input
    published: int  # how many of its actions were published


CASES = [
    Case(EngineType.VLLM, 99, None, 99),  # succeeds, every action published
    Case(EngineType.SGLANG, 4, None, 1),  # open, one action published
    Case(EngineType.TRTLLM, 99, 2, 3),  # canceled by the frontend, some published
    Case(EngineType.VLLM, 1, None, 0),  # just started, nothing published
]


def _handoff(batch: Batch, index: int, case: Case) -> HandoffLog:
    """Drive one handoff through the real coordinator with a healthy engine's answers, append
    it to `batch` as the worker would, and return what its log must read back as."""
    at = 1_000 * (index + 1)
    start = StartHandoff(
        uuid.uuid4(), case.engine_type, f"prefill-{index}", f"decode-{index}", 60_000
    )
    coordinator = HandoffCoordinator.for_start(start)
    pending: deque[Input] = deque([start])
    events: list[LoggedEvent] = []
    while pending and sum(isinstance(e.record, InputRecord) for e in events) < case.inputs:
        if sum(isinstance(e.record, InputRecord) for e in events) == case.cancel_at:
            pending.appendleft(Canceled(start.handoff_id))
        message = pending.popleft()
        actions = coordinator.handle(message)
        at += 10
        batch.append_input(len(events), InputRecord(at, message))
        events.append(LoggedEvent(len(events), at, InputRecord(at, message)))
        for action in actions:
            batch.append_action(len(events), ActionRecord(at, action))
            events.append(LoggedEvent(len(events), at, ActionRecord(at, action)))
            pending.extend(success_script(action))
    done = coordinator.is_complete
    state = HandoffState.OPEN
    if done:
        success = coordinator.completion is HandoffCompletion.SUCCESS
        state = HandoffState.SUCCEEDED if success else HandoffState.CANCELED
    row = HandoffRow(
        start.handoff_id,
        case.engine_type.value,
        start.source,
        start.destination,
        1_000 * (index + 1),
        1_000 * (index + 1) + 60_000,
        state,
        at if done else None,
        len(events) - 1,
        at,
    )
    batch.upsert_handoff(row)
    published = [e.seq for e in events if isinstance(e.record, ActionRecord)][: case.published]
    if published:
        marked_at = at + 5
        batch.mark_published(start.handoff_id, published[-1], marked_at)
        events = [
            msgspec.structs.replace(e, published_at_ms=marked_at)
            if isinstance(e.record, ActionRecord) and e.seq <= published[-1]
            else e
            for e in events
        ]
    return HandoffLog(row, events)


async def _write(db: Path, cases: Collection[int] = range(len(CASES))) -> dict[UUID, HandoffLog]:
    """Write the handoffs of `CASES` (those at the indices `cases`, if given) to `db`."""
    log = await EventLog.open(db)
    try:
        batch = Batch()
        logs = [_handoff(batch, i, case) for i, case in enumerate(CASES) if i in cases]
        await log.commit(batch)
    finally:
        await log.close()
    return {h.handoff.handoff_id: h for h in logs}


@pytest.fixture
def written(tmp_path: Path) -> Written:
    db = tmp_path / "log.sqlite3"
    return _covering(Written(db, asyncio.run(_write(db))))


def _covering(written: Written) -> Written:
    """`written`, checked to hold what the cases claim."""
    logs = written.logs
    # The cases cover what they claim to: every final state, and actions on both sides of a mark.
    assert {log.handoff.state for log in logs.values()} == {
        HandoffState.SUCCEEDED,
        HandoffState.OPEN,
        HandoffState.CANCELED,
    }
    published = [e.published_at_ms is not None for log in logs.values() for e in log.events]
    assert any(published) and not all(published)
    return written


class ReaderContract(abc.ABC):
    """What every reader of the log must do. Subclasses say how to read and damage a log."""

    @abc.abstractmethod
    def reading(
        self, written: Written, handoff_id: UUID
    ) -> contextlib.AbstractContextManager[HandoffReader]:
        """A reader of `written` that holds `handoff_id`."""

    @abc.abstractmethod
    def damage(self, written: Written, handoff_id: UUID, seq: int) -> None:
        """Make the record at `seq` of that handoff unreadable, in this reader's form."""

    def test_each_handoff_reads_back_as_the_writer_was_given_it(self, written: Written) -> None:
        for handoff_id, expected in written.logs.items():
            with self.reading(written, handoff_id) as reader:
                assert reader.load(handoff_id) == expected
                assert reader.summary(handoff_id) == expected.handoff

    def test_an_input_carries_the_digest_the_worker_deduplicates_by(self, written: Written) -> None:
        for handoff_id in written.logs:
            with self.reading(written, handoff_id) as reader:
                events = reader.load(handoff_id).events
            assert all((e.digest is None) == isinstance(e.record, ActionRecord) for e in events)
            assert len({e.digest for e in events if e.digest is not None}) == sum(
                isinstance(e.record, InputRecord) for e in events
            )

    def test_a_record_that_does_not_decode_is_log_corrupt_naming_its_seq(
        self, written: Written
    ) -> None:
        damaged = next(h for h, log in written.logs.items() if len(log.events) > 3)
        self.damage(written, damaged, 2)
        # An export is read whole when it is opened, a SQLite log when the handoff is loaded.
        with pytest.raises(LogCorrupt, match=r"seq 2: "), self.reading(written, damaged) as reader:
            reader.load(damaged)


class TestSqliteLog(ReaderContract):
    """The offline tools' reader of the worker's file."""

    @contextlib.contextmanager
    def reading(self, written: Written, handoff_id: UUID) -> Iterator[HandoffReader]:
        with SqliteLog(written.db) as log:
            yield log

    def damage(self, written: Written, handoff_id: UUID, seq: int) -> None:
        _damage_sqlite(written.db, handoff_id, seq)


class TestJsonlLog(ReaderContract):
    """One handoff exported as `kvhandoff export` writes it, read back."""

    @contextlib.contextmanager
    def reading(self, written: Written, handoff_id: UUID) -> Iterator[HandoffReader]:
        export = self._export(written, handoff_id)
        if not export.exists():
            with SqliteLog(written.db) as log, export.open("wb") as out:
                write_jsonl(log.load(handoff_id), out)
        with JsonlLog(export) as log:
            yield log

    def damage(self, written: Written, handoff_id: UUID, seq: int) -> None:
        export = self._export(written, handoff_id)
        with SqliteLog(written.db) as log, export.open("wb") as out:
            write_jsonl(log.load(handoff_id), out)
        lines = export.read_bytes().splitlines()
        event = msgspec.json.decode(lines[1 + seq])  # the header comes first
        event["record"] = {"record": "nonsense"}
        lines[1 + seq] = msgspec.json.encode(event)
        export.write_bytes(b"\n".join(lines))

    @staticmethod
    def _export(written: Written, handoff_id: UUID) -> Path:
        return written.db.with_name(f"{handoff_id}.jsonl")


class TestDataDir(ReaderContract):
    """A partitioned worker's data directory: each partition file written by the worker's
    writer, read as one log. The cases alternate between two files (by index, not by the hash
    of their random ids, so that neither file is empty)."""

    @pytest.fixture
    def written(self, tmp_path: Path) -> Written:
        directory = tmp_path / "data"
        directory.mkdir()
        logs: dict[UUID, HandoffLog] = {}
        for partition in (0, 1):
            cases = range(partition, len(CASES), 2)
            logs |= asyncio.run(_write(directory / f"partition-{partition}.db", cases))
        return _covering(Written(directory, logs))

    @contextlib.contextmanager
    def reading(self, written: Written, handoff_id: UUID) -> Iterator[HandoffReader]:
        with DataDir(written.db) as log:
            yield log

    def damage(self, written: Written, handoff_id: UUID, seq: int) -> None:
        for partition in sorted(written.db.iterdir()):
            with SqliteLog(partition) as log:
                holds = bool(log.ids_beginning(str(handoff_id)))
            if holds:
                _damage_sqlite(partition, handoff_id, seq)
                return
        raise AssertionError(f"no partition file of {written.db} holds {handoff_id}")


class _WriterReads:
    """The worker's own read of a handoff (`EventLog.load`, asynchronous) as a `HandoffReader`:
    a handoff it cannot read comes back as a `CorruptHandoff`, which is its `LogCorrupt`."""

    def __init__(self, db: Path) -> None:
        self.db = db

    def load(self, handoff_id: UUID) -> HandoffLog:
        loaded = asyncio.run(self._load(handoff_id))
        if isinstance(loaded, CorruptHandoff):
            raise LogCorrupt(loaded.reason)
        return loaded

    def summary(self, handoff_id: UUID) -> HandoffRow:
        return self.load(handoff_id).handoff

    async def _load(self, handoff_id: UUID) -> HandoffLog | CorruptHandoff:
        log = await EventLog.open(self.db)
        try:
            return (await log.load([handoff_id]))[handoff_id]
        finally:
            await log.close()


class TestWriterReads(ReaderContract):
    """The worker's reads of its own log, which recovery and late inputs rebuild handoffs from."""

    @contextlib.contextmanager
    def reading(self, written: Written, handoff_id: UUID) -> Iterator[HandoffReader]:
        yield _WriterReads(written.db)

    def damage(self, written: Written, handoff_id: UUID, seq: int) -> None:
        _damage_sqlite(written.db, handoff_id, seq)

    def test_recovery_reads_the_open_handoffs_as_written(self, written: Written) -> None:
        async def recover() -> dict[UUID, HandoffLog | CorruptHandoff]:
            log = await EventLog.open(written.db)
            try:
                return await log.open_handoffs()
            finally:
                await log.close()

        recovered = asyncio.run(recover())
        assert recovered == {h: written.logs[h] for h in written.open_ids()}


def _damage_sqlite(db: Path, handoff_id: UUID, seq: int) -> None:
    """A type number no message has: the record cannot be put back together."""
    with contextlib.closing(sqlite3.connect(db)) as connection, connection:
        changed = connection.execute(
            "UPDATE events SET type = 250 WHERE seq = ? AND handoff_key ="
            " (SELECT handoff_key FROM handoffs WHERE handoff_id = ?)",
            (seq, str(handoff_id)),
        ).rowcount
    assert changed == 1
