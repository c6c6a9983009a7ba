"""A partition's local event log: SQLite in WAL mode, one writer, readers beside it.

What it is for. Each partition a worker owns keeps its handoffs in one file (worker.tier.service).
The partition's replicated log is the authority, and it is what an input is acknowledged
against; the file is a prefix of it, kept so that a handoff not in memory, a claim's rebuild
and the offline tools read SQLite rather than the whole replicated log. A file that lost its
last commits (a crash, a power loss) is caught up from the replicated log at the next claim.
`synchronous=FULL` (the default) fsyncs the WAL at every commit; `NORMAL` survives a process
crash but may lose the last commits on power loss, which the catch-up then writes again.

Appends are group-committed. The rows one batch of inputs produced (new handoffs, events,
rejections, quarantines, outbox marks) are one `worker.log.rows.Batch`, and the worker queues
it (`EventLog.queue`) rather than wait for it: whenever the writer's thread is free it commits
every batch queued so far in one transaction, in queue order, and the writer never waits for
the event loop between two commits. A queued batch was made on top of those queued before it,
so once one fails every later one fails unwritten, until the caller has repaired the file and
calls `EventLog.resume`. `EventLog.commit` writes one batch and waits (a claim's catch-up, a
stop's last marks).
When a transaction fails, the error is SQLite's own ("database or disk is full"), never that of
the rollback after it. sqlite errors are translated to `StoreError` here and nowhere else.

Three connections. The writer's thread runs a whole transaction as one call (BEGIN to COMMIT):
a statement per thread round trip made a small batch's commit cost several wake-ups of the
event loop for one fsync. The reader has a thread of its own: in WAL mode it reads the last
commit without waiting for the one in flight, so the worker loads the handoffs of its next
batch while the previous batch commits. Both threads are reached only through the loop's
`run_in_executor`, never directly: the simulation's loop (worker.sim.loop) runs that inline, so
the same store runs there without a thread. The probe is a third, on the event loop's own
thread, for the one read nearly every batch makes: which of the handoffs it names are in the
file at all (a batch that starts a handoff asks, and the answer is nearly always none). Those
are index lookups: traced at 16 in flight they took 0.2 ms at p50 here, where the round trip to
the reader's thread took 1.5 ms while the writer's thread was busy. The probe never waits for
a lock (`timeout=0`): in the rare
case that SQLite answers busy, the reader asks instead, which does wait.

The layout is `worker.log.schema`'s layout 2; its rows are `worker.log.rows`' types, read back
through the same `read_row`/`read_event` as the offline reader's (a row with a state this build
does not know makes that handoff a `CorruptHandoff`, which the worker quarantines).

A log of layout 1 is migrated when the worker opens it (`EventLog.open(..., migrate=True)`,
which only `kvhandoff run` asks for, under its `WriterLock`): in one transaction, so a log is
either layout 1 or layout 2, never half of each. Every record is carried over as it decodes:
split, filed under its handoff's new key; one that does not decode (or names another handoff
than its row) is kept whole, as written, so the handoff is quarantined when loaded, as it would
have been before. An event with no handoff row has nowhere to go in layout 2, so such a log is
refused rather than converted. The stored input digests are dropped (layout 2 derives them); the
outbox marks become one per handoff, up to the first action that was not published. Other tools
open a layout-1 log read-only (`worker.log.reader`) and leave it as it is.

The file. A new log is built under a temporary name and linked into place once its layout is
written, so a log at the path is never a half-made one: an empty file there is a log that was
truncated or lost, and it is refused rather than adopted (adopting it would forget every open
handoff). A new log is created 0600, because it holds raw payloads, and SQLite gives its -wal and
-shm files the same mode. An existing file's mode is left as the operator set it.

One writer. SQLite's locks serialise transactions, not workers: two workers on one file both
commit, and they collide and duplicate. `WriterLock` is the worker's exclusive claim on a log for
its lifetime, an `flock` on the `<db>.lock` file beside it, which the OS releases when the
process dies however it dies, so a crash never blocks the restart. The offline tools and
`compact` do not take it: their reads and their short transactions are safe beside a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, Self, TypeVar
from uuid import UUID

import msgspec

from kvhandoff.events.codec import split_record
from kvhandoff.events.errors import LogCorrupt
from kvhandoff.events.messages import ActionOutcome
from kvhandoff.events.records import VERBATIM, ActionRecord, InputRecord
from kvhandoff.worker.errors import StoreConflict, StoreCorrupt, StoreError, StoreLocked
from kvhandoff.worker.log.rows import (
    Batch,
    CorruptHandoff,
    HandoffLog,
    HandoffRow,
    LiveState,
    Loaded,
    LoggedEvent,
    Tombstone,
    read_event,
    read_record,
    read_row,
)
from kvhandoff.worker.log.schema import (
    ACTION_TYPES,
    HANDOFF_COLUMNS,
    INDEXES,
    INSERT_RECORD_TYPES,
    LAYOUT_1,
    LAYOUT_VERSION,
    OUTCOME_TYPE,
    RECORD_TYPE_VALUES,
    SELECT_EVENTS,
    TABLES,
    TOMBSTONES,
    HandoffState,
)

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")

# SQLite's default limit on host parameters is 32766; stay far below it.
_CHUNK = 500
_SYNCHRONOUS = ("FULL", "NORMAL", "EXTRA")
# What a read that may not wait is answered while another connection holds a lock it needs.
_BUSY = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


@dataclass(frozen=True, slots=True)
class UnpublishedAction:
    row: HandoffRow
    seq: int
    record: ActionRecord


_UPSERT_HANDOFF = """
INSERT INTO handoffs (handoff_id, engine_type, source, destination, started_at_ms,
                      deadline_at_ms, state, completed_at_ms, last_seq, updated_at_ms)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (handoff_id) DO UPDATE SET
    state = excluded.state, completed_at_ms = excluded.completed_at_ms,
    last_seq = excluded.last_seq, updated_at_ms = excluded.updated_at_ms
"""
# An event without its handoff's row has no key: NOT NULL refuses it.
_INSERT_EVENT = """
INSERT INTO events (handoff_key, seq, type, at_ms, record)
VALUES ((SELECT handoff_key FROM handoffs WHERE handoff_id = ?), ?, ?, ?, ?)
"""
# A mark only moves forward: a republished action keeps the time it was first marked.
_MARK_PUBLISHED = """
UPDATE handoffs SET published_seq = ?1, published_at_ms = ?2
WHERE handoff_id = ?3 AND published_seq < ?1
"""
_MERGE_EVENT = """
INSERT OR IGNORE INTO events (handoff_key, seq, type, at_ms, record)
VALUES ((SELECT handoff_key FROM handoffs WHERE handoff_id = ?), ?, ?, ?, ?)
"""
# A snapshot is newer than whatever the file it is merged into holds (a claim merges one only
# into a file behind it), so its tombstone replaces the file's: a handoff that reopened on a
# late `Canceled` and ended again ended as the newer one says.
_PUT_TOMBSTONE = """
INSERT INTO tombstones (handoff_id, state, completed_at_ms, digests) VALUES (?, ?, ?, ?)
ON CONFLICT (handoff_id) DO UPDATE SET
    state = excluded.state, completed_at_ms = excluded.completed_at_ms, digests = excluded.digests
"""
_FORGET_TOMBSTONE = "DELETE FROM tombstones WHERE handoff_id = ?"
# A handoff the file holds open that ended in entries it never had, or holds ended otherwise
# than the snapshot's tombstone says (it reopened on a late `Canceled` in entries the file never
# had, and ended again: sim seeds 2991, 2993). Its outbox closes: the owner that ended it
# published its actions, and what the file holds unmarked of them would, published again by a
# claim, start work at an engine for a handoff that has ended (its answer would come back as a
# late input). Its events stay, a prefix of its history: the planner knows it by its tombstone
# (worker.tier.planner, `Planner.plan`). A row started after that end is another handoff's.
_END_BY_TOMBSTONE = """
UPDATE handoffs SET state = ?1, completed_at_ms = ?2, updated_at_ms = ?2,
    published_at_ms = CASE WHEN published_seq < last_seq THEN ?2 ELSE published_at_ms END,
    published_seq = max(published_seq, last_seq)
WHERE handoff_id = ?3 AND (
    state = 'open'
    OR state IN ('succeeded', 'canceled') AND (state != ?1 OR completed_at_ms IS NOT ?2)
       AND started_at_ms <= ?2
)
"""
# A handoff the file holds ended as the tombstone says, with actions it never marked published:
# its owner stopped before a later batch carried their marks (they ride on the next one). Its
# outbox closes too, for the same reason: republished, a `ReserveDestination` would reserve
# blocks again at an engine that restarted since and forgot the handoff, and nothing would
# release them (seed 483 of `kvhandoff sim`).
_CLOSE_BY_TOMBSTONE = """
UPDATE handoffs SET published_at_ms = ?2, published_seq = last_seq
WHERE handoff_id = ?3 AND published_seq < last_seq AND state = ?1 AND completed_at_ms IS ?2
"""
_QUARANTINE = (
    f"UPDATE handoffs SET state = '{HandoffState.QUARANTINED}', updated_at_ms = ?"
    " WHERE handoff_id = ?"
)
_INSERT_REJECTION = (
    "INSERT INTO rejections (at_ms, handoff_id, reason, payload) VALUES (?, ?, ?, ?)"
)
_SET_META = (
    "INSERT INTO meta (key, value) VALUES (?, ?)"
    " ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)
_LOADED_COLUMNS = f"{HANDOFF_COLUMNS}, published_seq, published_at_ms"
_DIGESTS_ENCODER = msgspec.msgpack.Encoder()
_DIGESTS_DECODER = msgspec.msgpack.Decoder(list[bytes])
_EVENT_COLUMNS = "h.handoff_id, e.seq, e.type, e.at_ms, e.record"
# The backlog: actions past their handoff's mark (and records kept whole, which may be actions).
_UNPUBLISHED = f"""
SELECT {", ".join(f"h.{c.strip()}" for c in HANDOFF_COLUMNS.split(","))}, e.seq, e.type, e.at_ms,
       e.record
FROM handoffs h JOIN events e ON e.handoff_key = h.handoff_key AND e.seq > h.published_seq
WHERE h.published_seq < h.last_seq AND h.state != '{HandoffState.QUARANTINED}'
  AND e.type IN ({", ".join(map(str, (*ACTION_TYPES, OUTCOME_TYPE, VERBATIM)))})
ORDER BY h.handoff_key, e.seq
"""
# A quarantined handoff waits for an operator, with its rejections as the evidence: compaction
# keeps both, however old.
_DOOM_HANDOFFS = """
INSERT INTO doomed SELECT handoff_key FROM handoffs
WHERE state != 'open' AND state != 'quarantined' AND completed_at_ms < ?
"""
_DELETE_REJECTIONS = """
DELETE FROM rejections WHERE at_ms < ? AND NOT EXISTS (
    SELECT 1 FROM handoffs h WHERE h.handoff_id = rejections.handoff_id AND h.state = 'quarantined'
)
"""


@dataclass(frozen=True, slots=True)
class Committed:
    """The group commit that a queued batch rode in (`EventLog.queue`)."""

    seconds: float  # its transaction, on the writer's thread
    leads: bool  # this batch came first in it: count the group by this one only


@dataclass(frozen=True, slots=True)
class Compacted:
    """What one compaction deleted."""

    handoffs: int
    rejections: int


class WriterLock:
    """A worker's exclusive claim to write one event log, held for as long as the worker runs.

    An `flock` on `<db>.lock` (created 0600) into which the holder writes who it is, for the
    error that a second worker gets. The file stays when the lock is released: deleting a lock
    file that another process has open would let two holders lock two different files.
    """

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path

    @classmethod
    def acquire(cls, db_path: Path) -> WriterLock:
        """Take the lock of the log at `db_path`, or raise `StoreLocked` naming its holder."""
        # Resolved, so that two spellings of one log (relative, through a symlink) share a lock.
        resolved = db_path.resolve()
        path = resolved.with_name(f"{resolved.name}.lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StoreError(f"cannot lock event log {db_path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{_whoami()}\n".encode(), 0)
        except BlockingIOError as exc:  # only flock blocks
            holder = _holder(fd)
            os.close(fd)
            raise StoreLocked(
                f"event log {db_path} is in use by another worker: {holder} (lock file {path})"
            ) from exc
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"cannot lock event log {db_path}: {exc}") from exc
        return cls(fd, path)

    def release(self) -> None:
        """Give the lock up: another worker may take it at once."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _whoami() -> str:
    started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"pid {os.getpid()} on host {socket.gethostname()}, since {started}"


def _holder(fd: int) -> str:
    """Who holds the lock, as it wrote itself into the lock file."""
    try:
        written = os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        written = ""
    # Empty in the instant between the holder's flock and its write.
    return written or "a process that has not yet written its name"


def _prepare(path: Path) -> None:
    """Refuse an empty file at `path`, and create the log if there is no file at all."""
    try:
        size: int | None = path.stat().st_size
    except FileNotFoundError:
        size = None
    except OSError as exc:
        raise StoreError(f"cannot open event log {path}: {exc}") from exc
    if size == 0:
        raise StoreError(
            f"event log {path} is an empty file: most likely a log that was truncated or lost,"
            " and starting on it would forget every open handoff; restore the log, or delete"
            " the file to start a new one"
        )
    if size is None:
        try:
            _create(path)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot create event log {path}: {exc}") from exc


def _create(path: Path) -> None:
    """Build a new log beside `path` (0600, mkstemp's mode) and link it into place."""
    fd, name = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".new", dir=path.parent)
    os.close(fd)
    draft = Path(name)
    try:
        # No transaction needed: nobody sees the draft until it is complete.
        with contextlib.closing(sqlite3.connect(draft, isolation_level=None)) as db:
            for statement in (*TABLES, *INDEXES):
                db.execute(statement)
            db.execute(INSERT_RECORD_TYPES, RECORD_TYPE_VALUES)
            db.execute("INSERT INTO meta (key, value) VALUES ('layout', ?)", (LAYOUT_VERSION,))
            db.execute("PRAGMA journal_mode=WAL")
        # A link, unlike a rename, never replaces: if another process created the log
        # meanwhile, its log is the one both open.
        with contextlib.suppress(FileExistsError):
            os.link(draft, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the new name must survive a power loss with the log
        finally:
            os.close(directory)
    finally:
        draft.unlink()


# --- Layout 1 to layout 2 -------------------------------------------------------------------

# Keys in start order. A handoff is marked published up to its first action that was not,
# at the time of the last action up to there that was.
_COPY_HANDOFFS = """
INSERT INTO handoffs (handoff_id, engine_type, source, destination, started_at_ms,
                      deadline_at_ms, state, completed_at_ms, last_seq, updated_at_ms,
                      published_seq, published_at_ms)
SELECT h.handoff_id, h.engine_type, h.source, h.destination, h.started_at_ms, h.deadline_at_ms,
       h.state, h.completed_at_ms, h.last_seq, h.updated_at_ms, h.upto,
       (SELECT max(e.published_at_ms) FROM layout_1_events e
        WHERE e.handoff_id = h.handoff_id AND e.kind = 'action' AND e.seq <= h.upto)
FROM (
    SELECT *, coalesce(
        (SELECT min(e.seq) - 1 FROM layout_1_events e
         WHERE e.handoff_id = l.handoff_id AND e.kind = 'action' AND e.published_at_ms IS NULL),
        l.last_seq) AS upto
    FROM layout_1_handoffs l
) h
ORDER BY h.started_at_ms, h.handoff_id
"""
_LAYOUT_1_EVENTS = """
SELECT h.handoff_key, h.handoff_id, e.seq, e.at_ms, e.record
FROM handoffs h JOIN layout_1_events e USING (handoff_id) ORDER BY h.handoff_key, e.seq
"""


@dataclass(slots=True)
class _Migrated:
    handoffs: int = 0
    events: int = 0
    kept_whole: int = 0


def _migrate(path: Path) -> None:
    """Convert the layout-1 log at `path` to layout 2, in one transaction (module docstring)."""
    began = time.perf_counter()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("PRAGMA busy_timeout=5000")
        with _transaction(db):
            migrated = _migrate_in(db, path)
    logger.info(
        "event log %s: migrated from layout %s to %s in %.1fs: %d handoffs, %d events, %d of"
        " them kept whole as they do not read as records of their handoff; run VACUUM on the"
        " stopped log to give the space back to the file system",
        path,
        LAYOUT_1,
        LAYOUT_VERSION,
        time.perf_counter() - began,
        migrated.handoffs,
        migrated.events,
        migrated.kept_whole,
    )


def _migrate_in(db: sqlite3.Connection, path: Path) -> _Migrated:
    (layout,) = db.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()
    if layout != LAYOUT_1:
        raise StoreError(f"event log {path} changed layout to {layout!r} while being migrated")
    for statement in (
        "ALTER TABLE handoffs RENAME TO layout_1_handoffs",
        "ALTER TABLE events RENAME TO layout_1_events",
        *TABLES,
    ):
        db.execute(statement)
    migrated = _Migrated(handoffs=db.execute(_COPY_HANDOFFS).rowcount)
    db.executemany(
        "INSERT INTO events (handoff_key, seq, type, at_ms, record) VALUES (?, ?, ?, ?, ?)",
        _split_layout_1(db.execute(_LAYOUT_1_EVENTS), migrated),
    )
    (events,) = db.execute("SELECT count(*) FROM layout_1_events").fetchone()
    if events != migrated.events:
        (orphan,) = db.execute(
            "SELECT handoff_id FROM layout_1_events WHERE handoff_id NOT IN"
            " (SELECT handoff_id FROM layout_1_handoffs) LIMIT 1"
        ).fetchone()
        raise StoreError(
            f"event log {path} cannot be migrated to layout {LAYOUT_VERSION}:"
            f" {events - migrated.events} of its events belong to no row of the handoffs table"
            f" (handoff {orphan}, for one), and layout {LAYOUT_VERSION} files events under their"
            " handoff's row; restore the rows or delete those events, then start again"
        )
    for statement in (
        "DROP TABLE layout_1_events",
        "DROP TABLE layout_1_handoffs",
        *INDEXES,
    ):
        db.execute(statement)
    db.execute(INSERT_RECORD_TYPES, RECORD_TYPE_VALUES)
    db.execute("UPDATE meta SET value = ? WHERE key = 'layout'", (LAYOUT_VERSION,))
    return migrated


def _split_layout_1(
    rows: Iterable[tuple[int, str, int, int, bytes]], migrated: _Migrated
) -> Iterator[tuple[int, int, int, int, bytes]]:
    """Layout-1 events as layout-2 rows: split, or kept whole if they do not decode as a record
    of the handoff they are filed under."""
    for key, handoff_id, seq, at_ms, blob in rows:
        migrated.events += 1
        try:
            record = read_record(blob)
            message = record.input if isinstance(record, InputRecord) else record.action
            if str(message.handoff_id) != handoff_id:
                raise LogCorrupt(f"a record of handoff {message.handoff_id}")
        except LogCorrupt:
            migrated.kept_whole += 1
            yield key, seq, VERBATIM, at_ms, blob
            continue
        code, fields = split_record(record)
        yield key, seq, code, record.at_ms, fields


# --- Reading rows back ----------------------------------------------------------------------


def _row_values(row: HandoffRow) -> tuple[object, ...]:
    if row.state is None:  # only the offline reader reads a state this build does not know
        raise StoreError(f"handoff {row.handoff_id}: a row to write must have a known state")
    return (
        str(row.handoff_id),
        row.engine_type,
        row.source,
        row.destination,
        row.started_at_ms,
        row.deadline_at_ms,
        row.state.value,
        row.completed_at_ms,
        row.last_seq,
        row.updated_at_ms,
    )


def _handoff_row(values: Sequence[Any]) -> HandoffRow:
    """A row as the worker reads it back: one with a state this build does not know cannot be
    rebuilt, and is `StoreCorrupt` like a bad column."""
    row = read_row(values)
    if row.state is None:
        raise StoreCorrupt(f"state {row.unknown_state!r} is not one this build knows")
    return row


class EventLog:
    """The append-only log of every accepted input and issued action, per handoff in order."""

    def __init__(
        self,
        path: Path,
        *,
        writer: ThreadPoolExecutor,
        db: sqlite3.Connection,
        reading: ThreadPoolExecutor,
        reader: sqlite3.Connection,
        probe: sqlite3.Connection,
    ) -> None:
        self._writer = writer  # the one thread that uses `_db`
        self._db = db
        self._reading = reading  # the one thread that uses `_reader`
        self._reader = reader
        self._probe = probe  # the event loop's (module docstring)
        self._closed = False
        self.path = path
        # Batches queued for the next group commit, and whether the writer has been asked for
        # it; shared with the writer's thread, under the lock.
        self._lock = threading.Lock()
        self._queued: list[tuple[Batch, asyncio.Future[Committed]]] = []
        self._group_asked = False
        self._halted: StoreError | None = None  # the writer's: why queued batches are refused

    @classmethod
    async def open(
        cls, path: Path, synchronous: str = "FULL", *, migrate: bool = False
    ) -> EventLog:
        """Open the log at `path`, creating it if absent. An existing file must be a log of this
        layout, or, with `migrate`, of layout 1, which is then migrated (see the module
        docstring: only the holder of the `WriterLock` may ask for it). An empty file is
        refused. Takes no `WriterLock`."""
        if synchronous.upper() not in _SYNCHRONOUS:
            # SQLite silently reads an unknown level as NORMAL, which is not what was asked.
            raise StoreError(
                f"cannot open event log {path}: synchronous={synchronous!r} is not one of"
                f" {', '.join(_SYNCHRONOUS)}"
            )
        await asyncio.to_thread(_prepare, path)
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvhandoff-log")
        reading = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvhandoff-log-read")
        loop = asyncio.get_running_loop()
        db: sqlite3.Connection | None = None
        reader: sqlite3.Connection | None = None
        probe: sqlite3.Connection | None = None
        try:
            db = await loop.run_in_executor(writer, _connect_writer, path, synchronous, migrate)
            reader = await loop.run_in_executor(reading, _connect_reader, path)
            probe = sqlite3.connect(path, timeout=0, isolation_level=None)
            probe.execute("PRAGMA query_only=1")
        except BaseException as exc:
            if probe is not None:
                probe.close()
            if reader is not None:
                await loop.run_in_executor(reading, reader.close)
            if db is not None:
                await loop.run_in_executor(writer, db.close)
            reading.shutdown()
            writer.shutdown()
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"cannot open event log {path}: {exc}") from exc
            raise
        return cls(path, writer=writer, db=db, reading=reading, reader=reader, probe=probe)

    async def close(self) -> None:
        """Close the connections; closing a closed log does nothing."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        try:
            self._probe.close()
            await loop.run_in_executor(self._reading, self._reader.close)
        finally:
            self._reading.shutdown()
            await self._write(sqlite3.Connection.close)
            self._writer.shutdown()

    async def commit(self, batch: Batch) -> None:
        """Write the batch in one transaction, or nothing at all."""
        try:
            await self._write(_commit, batch)
        except sqlite3.Error as exc:
            raise self._commit_error(exc) from exc

    def queue(self, batch: Batch) -> asyncio.Future[Committed]:
        """Queue `batch` for the next group commit (module docstring) and return at once; the
        future is done when its group committed, or failed with the `StoreError` that left it
        unwritten. Groups commit in queue order, one at a time. After a failure every batch
        queued before the next `resume` fails too, without being written."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Committed] = loop.create_future()
        with self._lock:
            self._queued.append((batch, future))
            if self._group_asked:
                return future  # it rides in the group the writer has been asked for
            self._group_asked = True
        # Not awaited: `_commit_group` answers every future itself, and raises nothing.
        loop.run_in_executor(self._writer, self._commit_group, loop)
        return future

    async def resume(self) -> None:
        """Commit queued batches again after one failed (see `queue`), once the caller has
        repaired what they were made on. Batches queued before this call still fail."""
        await self._write(self._resume)

    def _resume(self, _: sqlite3.Connection) -> None:
        self._halted = None  # on the writer's thread: in order with the queued groups

    def _commit_group(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the writer's thread: commit every batch queued by now, in one transaction."""
        with self._lock:
            group, self._queued = self._queued, []
            self._group_asked = False
        outcome: Committed | Exception
        if self._halted is not None:
            outcome = StoreError(f"not written, as a batch queued before it failed: {self._halted}")
        else:
            began = time.perf_counter()
            try:
                with _transaction(self._db):
                    for batch, _ in group:
                        _write_batch(self._db, batch)
            except sqlite3.Error as exc:
                outcome = self._halted = self._commit_error(exc)
                outcome.__cause__ = exc
            except Exception as exc:  # a bug, not the disk: every batch still gets an answer
                outcome, self._halted = exc, StoreError(f"commit failed: {exc!r}")
            else:
                seconds = time.perf_counter() - began
                outcome = Committed(seconds, leads=True)
        loop.call_soon_threadsafe(_resolve, [future for _, future in group], outcome)

    def _commit_error(self, exc: sqlite3.Error) -> StoreError:
        if isinstance(exc, sqlite3.IntegrityError):
            return StoreConflict(f"append collided with the log: {exc}")
        return StoreError(f"commit to event log {self.path} failed: {exc}")

    async def load(self, handoff_ids: Collection[UUID]) -> dict[UUID, Loaded]:
        """The logs of those handoffs that exist, keyed by id; unreadable ones as corrupt."""
        loaded: dict[UUID, Loaded] = {}
        ids = [str(h) for h in handoff_ids]
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            marks = ",".join("?" * len(chunk))
            rows = await self._probed(
                f"SELECT {_LOADED_COLUMNS} FROM handoffs WHERE handoff_id IN ({marks})", chunk
            )
            if rows:
                # Grouped by handoff in the order of the id's index, which needs no sort.
                events = await self._fetch(
                    f"SELECT {_EVENT_COLUMNS} FROM handoffs h JOIN events e USING (handoff_key)"
                    f" WHERE h.handoff_id IN ({marks}) ORDER BY h.handoff_id, e.seq",
                    chunk,
                )
                loaded.update(self._assemble(rows, events))
        return loaded

    async def open_handoffs(self) -> dict[UUID, Loaded]:
        """Every handoff that has not completed, with its log: what recovery rebuilds."""
        rows = await self._fetch(f"SELECT {_LOADED_COLUMNS} FROM handoffs WHERE state = 'open'")
        # Grouped by handoff in the order of the open handoffs' index: in key order, SQLite
        # would read every handoff row instead.
        events = await self._fetch(
            f"SELECT {_EVENT_COLUMNS} FROM handoffs h JOIN events e USING (handoff_key)"
            " WHERE h.state = 'open' ORDER BY h.deadline_at_ms, h.handoff_key, e.seq"
        )
        return self._assemble(rows, events)

    async def quarantined(self) -> set[UUID]:
        """The handoffs set aside because their log could not be rebuilt."""
        rows = await self._fetch(
            "SELECT handoff_id FROM handoffs WHERE state = ?", (HandoffState.QUARANTINED,)
        )
        return {UUID(hid) for (hid,) in rows}

    async def unpublished_actions(self) -> list[UnpublishedAction | CorruptHandoff]:
        """Actions that were committed but never marked published (the outbox's backlog), less
        those an outcome logged after them answers: their engine had them (or the tier
        answered for it), and one that restarted since would only do them anew, for a handoff
        that may be long over (seeds 590 and 622 of `kvhandoff sim`'s short runs)."""
        backlog: list[UnpublishedAction | CorruptHandoff] = []
        answered: set[tuple[UUID, int]] = set()
        for values in await self._fetch(_UNPUBLISHED):
            seq, code, at_ms, blob = values[-4:]
            try:
                row = _handoff_row(values[:-4])
                event = read_event(row.handoff_id.bytes, (seq, code, at_ms, blob), (-1, None))
            except (StoreCorrupt, LogCorrupt) as exc:
                backlog.append(CorruptHandoff(UUID(values[0]), f"seq {seq}: {exc}"))
                continue
            record = event.record
            if isinstance(record, ActionRecord):
                backlog.append(UnpublishedAction(row, seq, record))
            elif isinstance(record.input, ActionOutcome):
                answered.add((row.handoff_id, record.input.action_id))
        return [
            unpublished
            for unpublished in backlog
            if isinstance(unpublished, CorruptHandoff)
            or (unpublished.row.handoff_id, unpublished.record.action.action_id) not in answered
        ]

    async def live_state(self) -> LiveState:
        """The rows a snapshot carries (see `LiveState`), less its tombstones, which the
        caller keeps (`tombstones`, and the handoffs it saw end)."""
        live = "state IN ('open', 'quarantined')"
        state = LiveState()
        for values in await self._fetch(f"SELECT {_LOADED_COLUMNS} FROM handoffs WHERE {live}"):
            row = read_row(values[:-2])
            state.handoffs.append(row)
            state.marks.append((row.handoff_id, values[-2], values[-1]))
        events = await self._fetch(
            "SELECT h.handoff_id, e.seq, e.type, e.at_ms, e.record"
            f" FROM handoffs h JOIN events e USING (handoff_key) WHERE h.{live}"
            " ORDER BY h.handoff_key, e.seq"
        )
        state.events = [tuple(values) for values in events]
        return state

    async def tombstones(self, since_ms: int) -> list[Tombstone]:
        """The tombstones this file got from snapshots, of handoffs that ended at `since_ms`
        or later."""
        rows = await self._fetch(
            "SELECT handoff_id, state, completed_at_ms, digests FROM tombstones"
            " WHERE completed_at_ms >= ?",
            (since_ms,),
        )
        return [
            Tombstone(UUID(hid), state, at_ms, _DIGESTS_DECODER.decode(digests))
            for hid, state, at_ms, digests in rows
        ]

    async def ended_since(self, since_ms: int) -> list[UUID]:
        """The handoffs whose rows the file holds that ended at `since_ms` or later."""
        rows = await self._fetch(
            "SELECT handoff_id FROM handoffs WHERE state IN ('succeeded', 'canceled')"
            " AND completed_at_ms >= ?",
            (since_ms,),
        )
        return [UUID(hid) for (hid,) in rows]

    async def events_of(self, handoff_id: UUID) -> list[LoggedEvent]:
        rows = await self._fetch(SELECT_EVENTS, (str(handoff_id),))
        raw = handoff_id.bytes
        return [
            read_event(raw, (seq, code, at_ms, blob), (published_seq, marked_at))
            for seq, code, at_ms, blob, published_seq, marked_at in rows
        ]

    async def meta(self, key: str) -> str | None:
        """The value the meta table holds under `key` (set by a `Batch`), if any."""
        rows = await self._fetch("SELECT value FROM meta WHERE key = ?", (key,))
        return None if not rows else str(rows[0][0])

    async def compact(self, before_ms: int) -> Compacted:
        """Delete the handoffs that completed before `before_ms`, with their logs, and the
        rejections logged before it. Open and quarantined handoffs are kept."""
        try:
            return await self._write(_compact, before_ms)
        except sqlite3.Error as exc:
            raise StoreError(f"compaction of event log {self.path} failed: {exc}") from exc

    async def _write(
        self,
        work: Callable[Concatenate[sqlite3.Connection, _P], _T],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _T:
        """Run `work(db, ...)` on the writer's thread. sqlite errors pass through unchanged,
        for the caller to translate."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._writer, partial(work, self._db, *args, **kwargs))

    async def _fetch(self, sql: str, parameters: Iterable[object] = ()) -> list[sqlite3.Row]:
        loop = asyncio.get_running_loop()
        try:
            # One round trip to the reader's thread for execute and fetchall: a batch that
            # names a new handoff waits for this read.
            return await loop.run_in_executor(
                self._reading, _fetchall, self._reader, sql, tuple(parameters)
            )
        except sqlite3.Error as exc:
            raise StoreError(f"read failed: {exc}") from exc

    async def _probed(self, sql: str, parameters: Sequence[object]) -> list[sqlite3.Row]:
        """A short read on the event loop's thread; by the reader if SQLite answers busy."""
        try:
            return self._probe.execute(sql, parameters).fetchall()
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF not in _BUSY:  # the primary code of an extended one
                raise StoreError(f"read failed: {exc}") from exc
        except sqlite3.Error as exc:
            raise StoreError(f"read failed: {exc}") from exc
        return await self._fetch(sql, parameters)

    @staticmethod
    def _assemble(rows: list[sqlite3.Row], events: list[sqlite3.Row]) -> dict[UUID, Loaded]:
        """Handoff rows (with their outbox mark) and their events (ordered by handoff, seq) as
        loaded handoffs; a row or record that cannot be read makes that one handoff corrupt,
        not the whole load."""
        loaded: dict[UUID, Loaded] = {}
        marks: dict[str, tuple[int, int | None]] = {}
        for values in rows:
            hid = UUID(values[0])
            marks[values[0]] = (values[-2], values[-1])
            try:
                loaded[hid] = HandoffLog(_handoff_row(values[:-2]), [])
            except StoreCorrupt as exc:  # e.g. a state this build does not know
                loaded[hid] = CorruptHandoff(hid, f"unreadable handoff row: {exc}")
        # A handoff's events come together: what they share is worked out once per handoff.
        current, hid, raw = "", UUID(int=0), b""
        mark: tuple[int, int | None] = (-1, None)
        handoff: Loaded | None = None
        for hid_text, seq, code, at_ms, blob in events:
            if hid_text != current:
                current, hid = hid_text, UUID(hid_text)
                raw, mark, handoff = hid.bytes, marks[hid_text], loaded[hid]
            if not isinstance(handoff, HandoffLog):
                continue
            try:
                handoff.events.append(read_event(raw, (seq, code, at_ms, blob), mark))
            except LogCorrupt as exc:
                handoff = loaded[hid] = CorruptHandoff(hid, f"seq {seq}: {exc}")
        return loaded


def _layout(db: sqlite3.Connection) -> str | None:
    """The layout the file's meta table names, or None (a new file is created with one)."""
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "meta" not in tables:
        return None
    row = db.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()
    return None if row is None else str(row[0])


def _connect_reader(path: Path) -> sqlite3.Connection:
    """The reader's connection, made (and then used) on the reader's thread: read-only, and it
    waits out a checkpoint's lock rather than fail."""
    reader = sqlite3.connect(path, isolation_level=None)
    try:
        reader.execute("PRAGMA query_only=1")
        reader.execute("PRAGMA busy_timeout=5000")
    except BaseException:
        reader.close()
        raise
    return reader


def _fetchall(reader: sqlite3.Connection, sql: str, parameters: tuple[object, ...]) -> list[Any]:
    """On the reader's thread: every row `sql` selects."""
    return reader.execute(sql, parameters).fetchall()


def _connect_writer(path: Path, synchronous: str, migrate: bool) -> sqlite3.Connection:
    """The writer's connection to the log at `path`, made (and then used) on the writer's
    thread; see `EventLog.open`. sqlite errors pass through, `StoreError` for the layout."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        # An offline `compact` may hold the write lock briefly; wait rather than fail.
        db.execute("PRAGMA busy_timeout=5000")
        # Checked before anything is written: another application's database, or a log of
        # another layout, must be left as it is.
        layout = _layout(db)
        if layout == LAYOUT_1 and migrate:
            _migrate(path)
            layout = _layout(db)
        if layout == LAYOUT_1:
            raise StoreError(
                f"event log {path} has layout {LAYOUT_1!r}, which this build reads but does"
                f" not write: the worker (kvhandoff run) of this build migrates it to layout"
                f" {LAYOUT_VERSION!r} when it starts"
            )
        if layout != LAYOUT_VERSION:
            raise StoreError(
                f"event log {path} has layout {layout!r}, this build reads and writes layout"
                f" {LAYOUT_VERSION!r}"
            )
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous}")
        db.execute(TOMBSTONES)  # a file of layout 2 from before snapshots lacks it
        # The numbers of message types this build knows, for people reading the file.
        db.execute(INSERT_RECORD_TYPES, RECORD_TYPE_VALUES)
    except BaseException:
        db.close()
        raise
    return db


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE, then COMMIT, or a rollback on any error. sqlite errors pass through
    unchanged, for the caller to translate."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException as exc:
        # SQLite itself rolls back on some errors (SQLITE_FULL, SQLITE_IOERR, ...), even on a
        # failed COMMIT. A ROLLBACK then fails with "no transaction is active", and its error
        # must never replace the one that says what went wrong.
        if db.in_transaction:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error as rollback_error:
                exc.add_note(f"the rollback failed too: {rollback_error}")
        raise


def _resolve(futures: list[asyncio.Future[Committed]], outcome: Committed | Exception) -> None:
    """On the event loop: the outcome of a group commit, for each batch that rode in it."""
    for future in futures:
        if future.done():  # cancelled: nobody waits for its outcome
            continue
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
            outcome = Committed(outcome.seconds, leads=False)


def _commit(db: sqlite3.Connection, batch: Batch) -> None:
    """`EventLog.commit`, on the writer's thread."""
    with _transaction(db):
        _write_batch(db, batch)


def _write_batch(db: sqlite3.Connection, batch: Batch) -> None:
    """A batch's statements, inside the caller's transaction."""
    if batch.merge is not None:
        _merge(db, batch.merge)
    if batch.handoffs:
        rows = [_row_values(r) for r in batch.handoffs.values()]
        db.executemany(_UPSERT_HANDOFF, rows)
        # A row is newer than the tombstone a snapshot left of its handoff: kept beside it, the
        # tombstone would say an ending the handoff no longer has (it reopened since).
        db.executemany(_FORGET_TOMBSTONE, [values[:1] for values in rows])
    if batch.events:
        db.executemany(_INSERT_EVENT, batch.events)
    if batch.history:
        # After `events`: a catch-up's entries may carry a history that ends past the first
        # events a later entry appended (seq for seq the same rows: the log holds them once).
        db.executemany(_MERGE_EVENT, batch.history)
    if batch.published:
        db.executemany(
            _MARK_PUBLISHED, [(seq, at, str(h)) for h, (seq, at) in batch.published.items()]
        )
    if batch.rejections:
        db.executemany(_INSERT_REJECTION, batch.rejections)
    if batch.quarantined:
        db.executemany(_QUARANTINE, batch.quarantined)
    if batch.meta:
        db.executemany(_SET_META, batch.meta.items())


def _merge(db: sqlite3.Connection, state: LiveState) -> None:
    """`Batch.merge`, inside the caller's transaction."""
    known = {str(row.handoff_id) for row in state.handoffs}
    ended = {str(t.handoff_id): t for t in state.tombstones}
    stale = [
        hid
        for (hid,) in db.execute("SELECT handoff_id FROM handoffs WHERE state = 'open'")
        if hid not in known
    ]
    ending = [(t.state, t.completed_at_ms, hid) for hid, t in ended.items() if hid not in known]
    db.executemany(_CLOSE_BY_TOMBSTONE, ending)
    db.executemany(_END_BY_TOMBSTONE, ending)
    for hid in stale:
        if hid in ended:
            continue
        db.execute(
            "DELETE FROM events WHERE handoff_key = "
            "(SELECT handoff_key FROM handoffs WHERE handoff_id = ?)",
            (hid,),
        )
        db.execute("DELETE FROM handoffs WHERE handoff_id = ?", (hid,))
    if stale:
        logger.info(
            "%d handoffs this file held open ended in entries it never had (%d known by their "
            "tombstones)",
            len(stale),
            sum(hid in ended for hid in stale),
        )
    db.executemany(_UPSERT_HANDOFF, [_row_values(row) for row in state.handoffs])
    db.executemany(_MERGE_EVENT, state.events)
    db.executemany(
        _MARK_PUBLISHED, [(seq, at, str(h)) for h, seq, at in state.marks if at is not None]
    )
    # A handoff the snapshot holds as a row has not ended (it may have reopened since the
    # tombstone the file or the snapshot has of it): a tombstone kept beside its row would,
    # once it ended again, say the earlier ending, to a claim that reads the file's tombstones.
    db.executemany(
        _PUT_TOMBSTONE,
        [
            (str(t.handoff_id), t.state, t.completed_at_ms, _DIGESTS_ENCODER.encode(t.digests))
            for t in state.tombstones
            if str(t.handoff_id) not in known
        ],
    )
    db.executemany(_FORGET_TOMBSTONE, [(hid,) for hid in known])


def _compact(db: sqlite3.Connection, before_ms: int) -> Compacted:
    """`EventLog.compact`, on the writer's thread."""
    with _transaction(db):
        db.execute("CREATE TEMP TABLE IF NOT EXISTS doomed (handoff_key INTEGER PRIMARY KEY)")
        db.execute("DELETE FROM doomed")
        db.execute(_DOOM_HANDOFFS, (before_ms,))
        db.execute("DELETE FROM events WHERE handoff_key IN (SELECT handoff_key FROM doomed)")
        handoffs = db.execute(
            "DELETE FROM handoffs WHERE handoff_key IN (SELECT handoff_key FROM doomed)"
        )
        rejections = db.execute(_DELETE_REJECTIONS, (before_ms,))
        db.execute("DELETE FROM tombstones WHERE completed_at_ms < ?", (before_ms,))
    return Compacted(handoffs.rowcount, rejections.rowcount)
