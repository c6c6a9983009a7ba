"""The offline, read-only reader of the event log, for `list`, `stuck`, `replay`, `verify` and
`export`. It needs the log file alone: no NATS, no running worker.

A log comes in three forms, read through one interface (`LogSource`):

- the worker's SQLite file (`SqliteLog`), opened read-only (`file:...?mode=ro`) with the
  standard library's sqlite3, so a running worker can keep writing while a tool reads. Every
  read of one `SqliteLog` sees the same snapshot of the file (one read transaction), so what
  one query says agrees with the next. It reads both layouts (`worker.log.schema`): layout 2,
  which this build writes, and layout 1, as an older worker left it and as the tools find it
  until the worker migrates it, with the input digests layout 1 keeps (layout 2 keeps none);
- one handoff exported as self-contained JSONL (`JsonlLog`), for bug reports: a header line,
  then one line per event with the record as JSON. `write_jsonl` writes it. An export keeps no
  input digests;
- the data directory of a partitioned worker (`DataDir`): one `SqliteLog` per partition file,
  named `partition-<p>.db` (p in decimal, no leading zeros; a worker writes only the partitions
  it owns, so numbers may be missing), read as one log. A handoff lives in exactly one
  partition, so every handoff is in one file: `handoffs` merges the files' rows into the same
  order one file gives, `resolve` looks for an id or prefix in all of them (a prefix that two
  files match is as ambiguous as two handoffs of one file), and the reads of one handoff go to
  the file that holds it. `scan` runs through the files in partition order, one after the
  other, and `owners` sends each span back to the file it came from: a run never crosses files.
  Each file is its own snapshot (one read transaction each), and the files of a live tier are
  not read at one instant; each handoff's log is still read whole from one snapshot. A
  directory with no partition file is refused, as a file that is no log is.

It returns the log's one set of row types (`worker.log.rows`: `HandoffRow`, `LoggedEvent`,
`HandoffLog`), read through the same `read_row`/`read_event` as the worker's own reads, and
`LogSource` extends the readers' one protocol (`worker.log.rows.HandoffReader`).

A `handoffs` row whose state this build does not know (a newer worker's, or a damaged row) is
read, not refused: its `HandoffRow.state` is None and `unknown_state` holds what the row
says, so that each command can say which handoff it is.

`open_log` tells a data directory by its being a directory, and the two forms of a file by
content (SQLite's magic header), not by extension. Records are decoded by
`events.codec.decode_record`, the one place that upcasts older schema versions, whichever form
they were read from; a layout-2 record is first put back together by
`events.codec.join_record`, into the bytes a layout-1 log would hold. sqlite errors are
translated to `StoreError` here.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import re
import sqlite3
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol, Self
from uuid import UUID

import msgspec
from msgspec import Struct

from kvhandoff.events.codec import encode_record, join_record
from kvhandoff.events.errors import LogCorrupt
from kvhandoff.events.records import SCHEMA_VERSION
from kvhandoff.events.replay import StoredRecord
from kvhandoff.worker.errors import StoreCorrupt, StoreError
from kvhandoff.worker.log.rows import (
    HandoffLog,
    HandoffReader,
    HandoffRow,
    LoggedEvent,
    Quarantine,
    read_event,
    read_record,
    read_row,
)
from kvhandoff.worker.log.schema import (
    LAYOUT_1,
    LAYOUT_1_SCAN,
    LAYOUT_1_SCAN_OWNERS,
    LAYOUT_1_SELECT_EVENTS,
    LAYOUT_1_SELECT_STORED,
    LAYOUT_VERSION,
    SCAN_EVENT_KEYS,
    SCAN_EVENTS,
    SCAN_KEYS,
    SELECT_EVENTS,
    SELECT_HANDOFF,
    SELECT_HANDOFF_IDS_BETWEEN,
    SELECT_HANDOFFS,
    SELECT_QUARANTINE,
    HandoffState,
)

_SQLITE_MAGIC = b"SQLite format 3\x00"

#: A partition's file in a partitioned worker's data directory (`kvhandoff run --data-dir`).
PARTITION_FILE = re.compile(r"partition-(0|[1-9][0-9]*)\.db")

#: The name and version of the JSONL export, in its header line.
EXPORT_FORMAT = "kvhandoff-handoff-log"
EXPORT_VERSION = 1


class LogSource(HandoffReader, Protocol):
    """What the offline tools read, from either form of the log: `HandoffReader`'s reads of
    one handoff, and these."""

    path: Path
    #: What the log is, for messages: "a layout-1 log", "a layout-2 log", "an export",
    #: "a data directory of 3 layout-2 logs".
    form: str
    #: Whether the log keeps each input's digest (a layout-1 log does; a layout-2 log and an
    #: export do not).
    keeps_digests: bool

    def handoffs(self, states: Collection[HandoffState | None] = ()) -> list[HandoffRow]:
        """Every handoff (in one of `states`, if given; None stands for any state this build
        does not know), oldest start first."""
        ...

    def resolve(self, text: str) -> UUID:
        """The handoff whose id is `text` or begins with it (unique prefix, as git does)."""
        ...

    def stored(self, handoff_id: UUID) -> list[StoredRecord]:
        """One handoff's log as stored (encoded, with input digests), in sequence order."""
        ...

    def scan(self) -> Iterator[list[StoredRecord]]:
        """Every record as stored, in one pass in handoff order, in runs of rising seq.

        A handoff's log is one run, and a run is one handoff's log unless the log is damaged
        (in layout 1, a handoff that lost its first events can run on from the one before):
        check each run, and ask `owners` whose rows are in one that fails.
        """
        ...

    def owners(self, spans: Sequence[tuple[int, int]]) -> list[list[UUID]]:
        """The handoff of each row in the given spans of `scan`'s order: (first row, rows),
        ascending and disjoint. One more pass, for the runs whose check failed."""
        ...

    def disagreeing_tombstones(self) -> list[tuple[UUID, str, str]]:
        """The tombstones (worker.log.store: what a snapshot said of the handoffs that ended) that
        the rows of the same file contradict: (handoff, the tombstone's end, the row's state).
        A row started after the tombstone's end is another handoff of a reused id."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


def open_log(path: Path) -> SqliteLog | JsonlLog | DataDir:
    """Open a log read-only: a data directory, or a file in whichever form it holds."""
    if path.is_dir():
        return DataDir(path)
    try:
        with path.open("rb") as file:
            magic = file.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        raise StoreError(f"cannot read event log {path}: {exc.strerror}") from exc
    if magic == _SQLITE_MAGIC:
        return SqliteLog(path)
    return JsonlLog(path)


class _Closing:
    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SqliteLog(_Closing):
    """The worker's SQLite event log, read-only, of either layout."""

    def __init__(self, path: Path) -> None:
        self.path = path
        uri = f"{path.resolve().as_uri()}?mode=ro"
        try:
            self._db = sqlite3.connect(uri, uri=True)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open event log {path}: {exc}") from exc
        try:
            # One read transaction for the reader's life: every query sees the same snapshot,
            # however a live worker writes meanwhile (`verify` relies on it to find rows again).
            self._db.execute("BEGIN")
            found = self._db.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()
        except sqlite3.Error as exc:
            self._db.close()
            raise StoreCorrupt(f"{path} is not a kvhandoff event log: {exc}") from exc
        self.layout = None if found is None else found[0]
        if self.layout not in (LAYOUT_1, LAYOUT_VERSION):
            self._db.close()
            raise StoreCorrupt(
                f"event log {path} has layout {self.layout}, this build reads {LAYOUT_1} and"
                f" {LAYOUT_VERSION}"
            )
        self.form = f"a layout-{self.layout} log"
        self.keeps_digests = self.layout == LAYOUT_1

    def close(self) -> None:
        self._db.close()

    def handoffs(self, states: Collection[HandoffState | None] = ()) -> list[HandoffRow]:
        sql, params = SELECT_HANDOFFS, [s.value for s in states if s is not None]
        if states:
            where = [f"state IN ({','.join('?' * len(params))})"] if params else []
            if None in states:
                known = [s.value for s in HandoffState]
                where.append(f"state NOT IN ({','.join('?' * len(known))})")
                params += known
            sql += " WHERE " + " OR ".join(where)
        rows = self._fetch(sql + " ORDER BY started_at_ms, handoff_id", params)
        return [self._quarantined(read_row(row)) for row in rows]

    def resolve(self, text: str) -> UUID:
        return _resolved(text, self.ids_beginning(text), self.path)

    def ids_beginning(self, text: str) -> list[str]:
        """The ids that begin with `text` (normalised as `resolve` does), at most two: enough
        to tell none, one and several apart."""
        prefix = text.strip().lower()
        # Every character of a stored id sorts below '~', so this range is "begins with".
        found = self._fetch(SELECT_HANDOFF_IDS_BETWEEN, (prefix, prefix + "~", 2))
        return [hid for (hid,) in found]

    def summary(self, handoff_id: UUID) -> HandoffRow:
        rows = self._fetch(SELECT_HANDOFF, (str(handoff_id),))
        if not rows:
            raise StoreError(f"no handoff {handoff_id} in {self.path}")
        return self._quarantined(read_row(rows[0]))

    def load(self, handoff_id: UUID) -> HandoffLog:
        summary = self.summary(handoff_id)
        logged = []
        if self.layout == LAYOUT_1:
            for seq, at_ms, published, blob in self._fetch(
                LAYOUT_1_SELECT_EVENTS, (str(handoff_id),)
            ):
                with _located(handoff_id, seq):
                    logged.append(LoggedEvent(seq, at_ms, read_record(blob), published))
            return HandoffLog(summary, logged)
        raw = handoff_id.bytes
        for seq, code, at_ms, fields, published_seq, marked_at in self._fetch(
            SELECT_EVENTS, (str(handoff_id),)
        ):
            with _located(handoff_id, seq):
                logged.append(
                    read_event(raw, (seq, code, at_ms, fields), (published_seq, marked_at))
                )
        return HandoffLog(summary, logged)

    def stored(self, handoff_id: UUID) -> list[StoredRecord]:
        if self.layout == LAYOUT_1:
            return self._fetch(LAYOUT_1_SELECT_STORED, (str(handoff_id),))
        raw = handoff_id.bytes
        return [
            (seq, None, _stored(raw, code, at_ms, fields))
            for seq, code, at_ms, fields, _, _ in self._fetch(SELECT_EVENTS, (str(handoff_id),))
        ]

    def scan(self) -> Iterator[list[StoredRecord]]:
        # `verify`'s read of a whole log, kept lean: no handoff id per row. In layout 1, within
        # a handoff seq only grows, so a run ends where it does not, and no new tuple is made
        # per row; in layout 2, a run is the rows of one handoff key.
        if self.layout == LAYOUT_1:
            return self._scan_layout_1()
        return self._scan()

    def _scan_layout_1(self) -> Iterator[list[StoredRecord]]:
        rows: list[StoredRecord] = []
        last = -1
        try:
            for row in self._db.execute(LAYOUT_1_SCAN):
                if row[0] <= last:
                    yield rows
                    rows = []
                rows.append(row)
                last = row[0]
        except sqlite3.Error as exc:
            raise StoreError(f"reading {self.path} failed: {exc}") from exc
        if rows:
            yield rows

    def _scan(self) -> Iterator[list[StoredRecord]]:
        # `_owned`'s merge and `_stored`, inlined into `verify`'s hot loop.
        join = join_record
        rows: list[StoredRecord] = []
        current, raw = -1, b""
        handoffs = self._db.execute(SCAN_KEYS)
        owner_key, owner = -1, ""
        try:
            for key, seq, code, at_ms, fields in self._db.execute(SCAN_EVENTS):
                if key != current:
                    if rows:
                        yield rows
                        rows = []
                    current = key
                    while owner_key < key and (following := handoffs.fetchone()) is not None:
                        owner_key, owner = following
                    # Events filed under a key no handoff has belong to none (see `_owned`).
                    raw = _uuid(owner).bytes if owner_key == key else b""
                if not raw:
                    continue
                try:
                    blob = join(raw, code, at_ms, fields)
                except LogCorrupt as exc:
                    blob = _unjoined(exc)
                rows.append((seq, None, blob))
        except sqlite3.Error as exc:
            raise StoreError(f"reading {self.path} failed: {exc}") from exc
        if rows:
            yield rows

    def owners(self, spans: Sequence[tuple[int, int]]) -> list[list[UUID]]:
        found: list[list[UUID]] = []
        position = 0
        try:
            if self.layout == LAYOUT_1:
                ids: Iterator[str] = (hid for (hid,) in self._db.execute(LAYOUT_1_SCAN_OWNERS))
            else:
                ids = (hid for hid, _ in self._owned(SCAN_EVENT_KEYS))
            for first, length in spans:
                collections.deque(itertools.islice(ids, first - position), maxlen=0)
                found.append([_uuid(hid) for hid in itertools.islice(ids, length)])
                position = first + length
        except sqlite3.Error as exc:
            raise StoreError(f"reading {self.path} failed: {exc}") from exc
        if [len(ids) for ids in found] != [length for _, length in spans]:
            raise StoreError(f"{self.path} has fewer events than a moment ago")
        return found

    def _owned(self, sql: str) -> Iterator[tuple[str, tuple[Any, ...]]]:
        """The rows of a layout-2 scan of `events` (the handoff key first, in key order), each
        with its handoff's id, read alongside from `handoffs` in the same order. A row whose key
        no handoff has belongs to no handoff, and is left out."""
        handoffs = self._db.execute(SCAN_KEYS)
        key, handoff_id = -1, ""
        for row in self._db.execute(sql):
            while key < row[0]:
                following = handoffs.fetchone()
                if following is None:
                    return
                key, handoff_id = following
            if key == row[0]:
                yield handoff_id, row

    def _quarantined(self, handoff: HandoffRow) -> HandoffRow:
        if handoff.state is not HandoffState.QUARANTINED:
            return handoff
        found = self._fetch(SELECT_QUARANTINE, (str(handoff.handoff_id),))
        if not found:
            return handoff
        at_ms, reason = found[0]
        return msgspec.structs.replace(handoff, quarantine=Quarantine(at_ms, str(reason)))

    def disagreeing_tombstones(self) -> list[tuple[UUID, str, str]]:
        if not self._fetch(_HAS_TOMBSTONES):
            return []  # a file from before snapshots, or of layout 1
        return [(UUID(hid), ended, state) for hid, ended, state in self._fetch(_DISAGREEING)]

    def _fetch(self, sql: str, params: Collection[object] = ()) -> list[Any]:
        try:
            return self._db.execute(sql, tuple(params)).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"reading {self.path} failed: {exc}") from exc


_HAS_TOMBSTONES = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'tombstones'"
_DISAGREEING = """
SELECT t.handoff_id, t.state, h.state FROM tombstones t JOIN handoffs h USING (handoff_id)
WHERE h.state != t.state AND h.started_at_ms <= t.completed_at_ms ORDER BY t.handoff_id
"""


class DataDir(_Closing):
    """A partitioned worker's data directory, its partition files read as one log (module
    docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            names = sorted(
                (int(found[1]), entry.name)
                for entry in path.iterdir()
                if (found := PARTITION_FILE.fullmatch(entry.name)) is not None
            )
        except OSError as exc:
            raise StoreError(f"cannot read data directory {path}: {exc.strerror}") from exc
        if not names:
            raise StoreError(
                f"{path} is a directory with no partition logs (partition-<p>.db) in it"
            )
        #: The partition files by partition number, each open read-only.
        self.partitions: dict[int, SqliteLog] = {}
        try:
            for partition, name in names:
                self.partitions[partition] = SqliteLog(path / name)
        except BaseException:
            self.close()
            raise
        layouts = sorted({str(log.layout) for log in self.partitions.values()})
        count = len(self.partitions)
        kind = f"layout-{layouts[0]}" if len(layouts) == 1 else "mixed-layout"
        self.form = f"a data directory of {count} {kind} log{'s' if count > 1 else ''}"
        # Digests are checked only if every file keeps them: `verify` checks all in one way.
        self.keeps_digests = all(log.keeps_digests for log in self.partitions.values())
        # Which file holds each handoff met so far: the reads of one handoff go there.
        self._holders: dict[UUID, SqliteLog] = {}
        # Where each file's rows begin in `scan`'s order, once a scan has passed them.
        self._scanned: list[tuple[int, SqliteLog]] = []

    def close(self) -> None:
        for log in self.partitions.values():
            log.close()

    def handoffs(self, states: Collection[HandoffState | None] = ()) -> list[HandoffRow]:
        rows = []
        for log in self.partitions.values():
            for row in log.handoffs(states):
                self._holders.setdefault(row.handoff_id, log)
                rows.append(row)
        # The order of one file's `SELECT_HANDOFFS ... ORDER BY started_at_ms, handoff_id`.
        rows.sort(key=lambda row: (row.started_at_ms, str(row.handoff_id)))
        return rows

    def resolve(self, text: str) -> UUID:
        found: dict[str, SqliteLog] = {}
        for log in self.partitions.values():
            for hid in log.ids_beginning(text):
                found.setdefault(hid, log)
        handoff_id = _resolved(text, sorted(found), self.path)
        self._holders.setdefault(handoff_id, found[str(handoff_id)])
        return handoff_id

    def summary(self, handoff_id: UUID) -> HandoffRow:
        return self._holder(handoff_id).summary(handoff_id)

    def load(self, handoff_id: UUID) -> HandoffLog:
        return self._holder(handoff_id).load(handoff_id)

    def stored(self, handoff_id: UUID) -> list[StoredRecord]:
        return self._holder(handoff_id).stored(handoff_id)

    def scan(self) -> Iterator[list[StoredRecord]]:
        self._scanned = []
        position = 0
        for log in self.partitions.values():
            self._scanned.append((position, log))
            for rows in log.scan():
                yield rows
                position += len(rows)

    def owners(self, spans: Sequence[tuple[int, int]]) -> list[list[UUID]]:
        # Each span is one run, and a run is of one file: ask each file for its own spans, in
        # the positions of its own scan.
        if not self._scanned:
            raise StoreError(f"owners() of {self.path} before a scan of it")
        asked: list[list[tuple[int, int]]] = [[] for _ in self._scanned]
        for first, length in spans:
            index = bisect.bisect_right(self._scanned, first, key=lambda part: part[0]) - 1
            asked[index].append((first - self._scanned[index][0], length))
        found: list[list[UUID]] = []
        for (_, log), mine in zip(self._scanned, asked, strict=True):
            if mine:
                found += log.owners(mine)
        return found

    def disagreeing_tombstones(self) -> list[tuple[UUID, str, str]]:
        return [t for log in self.partitions.values() for t in log.disagreeing_tombstones()]

    def _holder(self, handoff_id: UUID) -> SqliteLog:
        log = self._holders.get(handoff_id)
        if log is not None:
            return log
        text = str(handoff_id)
        for log in self.partitions.values():
            if text in log.ids_beginning(text):
                self._holders[handoff_id] = log
                return log
        raise StoreError(f"no handoff {handoff_id} in {self.path}")


class JsonlLog(_Closing):
    """One handoff's log, as `kvhandoff export` wrote it."""

    form = "an export"
    keeps_digests = False

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as file:
                self.log = read_jsonl(file)
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror}") from exc
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise StoreCorrupt(f"{path} is not a kvhandoff handoff export: {exc}") from exc
        except StoreCorrupt as exc:
            raise StoreCorrupt(f"{path}: {exc}") from exc

    def handoffs(self, states: Collection[HandoffState | None] = ()) -> list[HandoffRow]:
        handoff = self.log.handoff
        return [handoff] if not states or handoff.state in states else []

    def resolve(self, text: str) -> UUID:
        handoff_id = self.log.handoff.handoff_id
        if not str(handoff_id).startswith(text.strip().lower()):
            raise StoreError(f"{self.path} holds handoff {handoff_id}, not {text!r}")
        return handoff_id

    def summary(self, handoff_id: UUID) -> HandoffRow:
        return self.load(handoff_id).handoff

    def load(self, handoff_id: UUID) -> HandoffLog:
        if handoff_id != self.log.handoff.handoff_id:
            raise StoreError(f"{self.path} holds handoff {self.log.handoff.handoff_id} only")
        return self.log

    def stored(self, handoff_id: UUID) -> list[StoredRecord]:
        return [(e.seq, None, encode_record(e.record)) for e in self.load(handoff_id).events]

    def scan(self) -> Iterator[list[StoredRecord]]:
        yield self.stored(self.log.handoff.handoff_id)

    def owners(self, spans: Sequence[tuple[int, int]]) -> list[list[UUID]]:
        return [[self.log.handoff.handoff_id] * length for _, length in spans]

    def disagreeing_tombstones(self) -> list[tuple[UUID, str, str]]:
        return []  # an export is one handoff's rows, no tombstones


# --- The JSONL export -----------------------------------------------------------------------


class ExportHeader(Struct, frozen=True, tag=EXPORT_FORMAT, tag_field="format"):
    """The first line of an export: what it is, and the handoff's projection."""

    version: int
    handoff_id: UUID
    schema_version: int
    handoff: HandoffRow


class _ReadHeader(Struct, frozen=True, tag=EXPORT_FORMAT, tag_field="format"):
    # `ExportHeader` as read: the row is checked by `read_row`, which reads a state this
    # build does not know instead of refusing the whole export.
    version: int
    handoff_id: UUID
    schema_version: int
    handoff: dict[str, Any]


class ExportedEvent(Struct, frozen=True):
    """Every further line: one event, its record as the JSON form of a `LogRecord`."""

    seq: int
    at_ms: int
    published_at_ms: int | None
    record: msgspec.Raw


_header_decoder = msgspec.json.Decoder(_ReadHeader)
_event_decoder = msgspec.json.Decoder(ExportedEvent)
_json_encoder = msgspec.json.Encoder()


def write_jsonl(log: HandoffLog, out: IO[bytes]) -> None:
    """Write a handoff's log as a self-contained JSONL export."""
    encode = _json_encoder.encode
    handoff = log.handoff
    out.write(encode(ExportHeader(EXPORT_VERSION, handoff.handoff_id, SCHEMA_VERSION, handoff)))
    out.write(b"\n")
    for e in log.events:
        raw = msgspec.Raw(encode(e.record))
        out.write(encode(ExportedEvent(e.seq, e.at_ms, e.published_at_ms, raw)))
        out.write(b"\n")


def read_jsonl(lines: Iterator[bytes] | IO[bytes]) -> HandoffLog:
    """Read a JSONL export back; every record goes through the codec's upcasting decoder."""
    lines = (line for line in lines if line.strip())
    first = next(lines, None)
    if first is None:
        raise StoreCorrupt("empty export")
    header = _header_decoder.decode(first)
    if header.version > EXPORT_VERSION:
        raise StoreCorrupt(
            f"export format version {header.version}, this build reads {EXPORT_VERSION}"
        )
    handoff = read_row(header.handoff)
    events = []
    for line in lines:
        event = _event_decoder.decode(line)
        # Through msgpack, so that JSON records meet the same upcaster as stored ones.
        blob = msgspec.msgpack.encode(msgspec.json.decode(event.record))
        with _located(header.handoff_id, event.seq):
            record = read_record(blob)
        events.append(LoggedEvent(event.seq, event.at_ms, record, event.published_at_ms))
    return HandoffLog(handoff, events)


def _resolved(text: str, found: list[str], where: Path) -> UUID:
    """The one handoff `text` names among `found`, the ids that begin with it in sorted
    order: the one, or an id given whole, or an error naming `where`."""
    if not found:
        raise StoreError(f"no handoff {text!r} in {where}")
    if len(found) > 1 and found[0] != text.strip().lower():
        raise StoreError(f"handoff id prefix {text!r} is ambiguous in {where}")
    return UUID(found[0])


@contextlib.contextmanager
def _located(handoff_id: UUID, seq: int) -> Iterator[None]:
    """A record that does not read says where it is: its handoff and its seq."""
    try:
        yield
    except LogCorrupt as exc:
        raise LogCorrupt(f"handoff {handoff_id} seq {seq}: {exc}") from exc


def _stored(raw: bytes, code: int, at_ms: int, fields: bytes) -> bytes:
    """A layout-2 record put back together, for `check_stored` (or `_unjoined`)."""
    try:
        return join_record(raw, code, at_ms, fields)
    except LogCorrupt as exc:
        return _unjoined(exc)


def _unjoined(exc: LogCorrupt) -> bytes:
    """For `check_stored`, a record that cannot be put back together: a map that is no record,
    whose kind says why, so that the check reports a record that does not decode, and the
    decoder's error quotes the kind."""
    return msgspec.msgpack.encode({"record": str(exc)})


def _uuid(text: str) -> UUID:
    try:
        return UUID(text)
    except ValueError:
        raise StoreCorrupt(f"events row with handoff id {text!r}, which is not a UUID") from None
