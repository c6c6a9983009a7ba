"""The event log's rows as Python holds them, one type each, whoever reads or writes them.

`worker.log.schema` is the layout on disk; this is its mirror in memory, shared by the worker's
writer (`worker.log.store`), the offline reader (`worker.log.reader`, SQLite and JSONL export) and
the commands and reports built on them, and the worker's planner (`worker.tier.planner`):

    HandoffRow   one row of the `handoffs` projection. Mutable: the worker keeps one per handoff
                 in memory and updates it in place after each accepted input (`copy` snapshots
                 it into a batch). The offline reader fills in what a row alone cannot say:
                 `unknown_state`, a state this build does not know, as written (`state` is then
                 None), and `quarantine`, why the worker set the handoff aside. The worker never
                 writes either; both are left out of JSON when None.
    LoggedEvent  one decoded event of a handoff's log, with the time of the outbox mark that
                 covers it, if it is a published action. An input's `digest` is derived from it.
    HandoffLog   one handoff's row and its whole log in sequence order.
    CorruptHandoff
                 a handoff whose row or log could not be read back; `Loaded` is either.
    Batch        the rows one group commit writes, already encoded as layout 2 stores them;
                 `LiveState` is a partition file's live part, which a snapshot carries.

The worker's planner (worker.tier.planner) builds `Batch`es and reads `Loaded` handoffs, and
the store (worker.log.store) writes and reads them: they are here, not in the store, so that
the planner depends on no IO.

Every reader turns stored columns into these through `read_row` and `read_event`, so a row or
a record reads the same, and is refused for the same reasons (a row as `StoreCorrupt`, a record
as the core's `LogCorrupt`), from a live log, an offline copy or an export.
`tests/tools/test_log_contract.py` holds all of them to that.

`HandoffReader` is what every reader of one handoff offers, and the contract the suite checks:
`worker.log.reader.LogSource` (SQLite and JSONL) extends it, and the worker's own reads
(`worker.log.store.EventLog.load`) return the same `HandoffLog`, asynchronously.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID

import msgspec
from msgspec import Struct

from kvhandoff.events.codec import decode_record, input_digest, join_record, split_record
from kvhandoff.events.errors import LogCorrupt
from kvhandoff.events.records import ActionRecord, InputRecord, LogRecord
from kvhandoff.events.replay import LoggedRecord
from kvhandoff.worker.errors import StoreCorrupt
from kvhandoff.worker.log.schema import QUARANTINE_PREFIX, HandoffState

_KNOWN_STATES = frozenset(s.value for s in HandoffState)


class Quarantine(Struct, frozen=True):
    """Why the worker set a handoff aside, and when: its first "quarantined:" rejection."""

    at_ms: int
    reason: str


class HandoffRow(Struct, omit_defaults=True):
    """A handoff's row in the `handoffs` projection (module docstring).

    The first ten fields are the table's columns in `worker.log.schema.HANDOFF_COLUMNS` order.
    """

    handoff_id: UUID
    engine_type: str
    source: str
    destination: str
    started_at_ms: int
    deadline_at_ms: int
    state: HandoffState | None
    completed_at_ms: int | None
    last_seq: int
    updated_at_ms: int
    unknown_state: str | None = None
    quarantine: Quarantine | None = None

    def copy(self) -> HandoffRow:
        # msgspec's own copy: a third of a spelled-out constructor's time, once per handoff
        # per batch on the worker's hot path.
        return msgspec.structs.replace(self)

    @property
    def state_name(self) -> str:
        """The state as the log spells it, known to this build or not."""
        if self.state is not None:
            return self.state.value
        return "unknown" if self.unknown_state is None else self.unknown_state


class Tombstone(Struct, frozen=True):
    """A handoff that ended, as long as a late input for it may come: enough to answer that
    input as its whole log would (a duplicate by its digest, anything else as too late)."""

    handoff_id: UUID
    state: str
    completed_at_ms: int
    digests: list[bytes]  # `events.codec.input_digest` of each input it accepted


class LoggedEvent(Struct, frozen=True):
    """One decoded entry of a handoff's log.

    `published_at_ms` is None for an input and for an action not yet published, and otherwise
    the time of the handoff's outbox mark that covers the action (layout 2 keeps one mark per
    handoff: the action was published by then).
    """

    seq: int
    at_ms: int
    record: LogRecord
    published_at_ms: int | None = None

    @property
    def digest(self) -> bytes | None:
        """`events.codec.input_digest` of an input, None for an action: what the worker
        recognises a redelivered duplicate by."""
        if isinstance(self.record, InputRecord):
            return input_digest(self.record.input)
        return None


class HandoffLog(Struct, frozen=True):
    """One handoff: its row and its whole log in sequence order."""

    handoff: HandoffRow
    events: list[LoggedEvent]

    def records(self) -> list[LoggedRecord]:
        """The log as `events.replay` reads it."""
        return [(e.seq, e.record) for e in self.events]


@dataclass(frozen=True, slots=True)
class CorruptHandoff:
    """A handoff whose row or log could not be read back: the caller quarantines it."""

    handoff_id: UUID
    reason: str


#: What a read of one handoff gives (`EventLog.load`): its log, or why it could not be read.
Loaded = HandoffLog | CorruptHandoff


@dataclass(slots=True)
class LiveState:
    """A partition file's live part, as a snapshot of the partition carries it to another
    file: every row that rebuilding its open and quarantined handoffs reads, and the
    tombstones of those that ended lately. `merge` it into a `Batch`."""

    handoffs: list[HandoffRow] = field(default_factory=list)  # open and quarantined
    # (handoff id, published seq, when): their outbox marks
    marks: list[tuple[UUID, int, int | None]] = field(default_factory=list)
    events: list[tuple[str, int, int, int, bytes]] = field(default_factory=list)  # as `Batch`
    tombstones: list[Tombstone] = field(default_factory=list)


@dataclass(slots=True)
class Batch:
    """Everything one group commit writes, already encoded as rows."""

    # (handoff id, seq, type, at_ms, record): the record split as layout 2 stores it.
    events: list[tuple[str, int, int, int, bytes]] = field(default_factory=list)
    handoffs: dict[UUID, HandoffRow] = field(default_factory=dict)
    # handoff -> (the highest seq marked, when): one outbox mark per handoff.
    published: dict[UUID, tuple[int, int]] = field(default_factory=dict)
    rejections: list[tuple[int, str | None, str, bytes]] = field(default_factory=list)
    quarantined: list[tuple[int, str]] = field(default_factory=list)
    # meta key -> value, set in the same transaction (the partitioned worker's catch-up mark).
    meta: dict[str, str] = field(default_factory=dict)
    # A snapshot's live state, written first: its handoffs' rows and events are added where
    # the file lacks them, and what the file holds open that the snapshot does not is ended
    # (as its tombstone says, its outbox closed: the owner that ended it published its
    # actions) or, if the snapshot does not know it, dropped: it ended where the file never
    # saw, more than a tombstone's life ago.
    merge: LiveState | None = None
    # As `events`: the events logged before this batch of each handoff it appended to after it
    # had ended (`carry`), added where the file lacks them, after `events`.
    history: list[tuple[str, int, int, int, bytes]] = field(default_factory=list)

    def append_input(self, seq: int, record: InputRecord, key: str | None = None) -> None:
        """Log the input at `seq` of its handoff; `key`, the handoff id as text, if the caller
        has it at hand (the planner does: it saves a `str` of the UUID per row)."""
        self._append(key or str(record.input.handoff_id), seq, record)

    def append_action(self, seq: int, record: ActionRecord, key: str | None = None) -> None:
        """Log the action at `seq` of its handoff; `key` as for `append_input`."""
        self._append(key or str(record.action.handoff_id), seq, record)

    def _append(self, key: str, seq: int, record: LogRecord) -> None:
        code, fields = split_record(record)
        self.events.append((key, seq, code, record.at_ms, fields))

    def carry(self, logged: HandoffLog) -> None:
        """Carry the history of a handoff that ended before this batch appends to it (a late
        input reopened it, or was logged after its end), and its outbox mark: a snapshot taken
        since it ended knows it by its tombstone alone, so a file caught up from that snapshot
        and the entries after it would hold this batch's events without the ones before them."""
        key = str(logged.handoff.handoff_id)
        for event in logged.events:
            code, fields = split_record(event.record)
            self.history.append((key, event.seq, code, event.record.at_ms, fields))
        marked = [e for e in logged.events if e.published_at_ms is not None]
        if marked and (at_ms := marked[-1].published_at_ms) is not None:
            self.mark_published(logged.handoff.handoff_id, marked[-1].seq, at_ms)

    def upsert_handoff(self, row: HandoffRow) -> None:
        """Write the handoff's projection as it stands now: a copy, because the worker goes on
        changing its row (the next batch is planned before this one commits)."""
        self.handoffs[row.handoff_id] = row.copy()

    def mark_published(self, handoff_id: UUID, seq: int, at_ms: int) -> None:
        """The handoff's action at `seq`, and so every action before it, has been published:
        the worker publishes a handoff's actions in seq order, and marks them after the server
        confirmed them."""
        marked = self.published.get(handoff_id)
        if marked is None or seq > marked[0]:
            self.published[handoff_id] = (seq, at_ms)

    def reject(self, at_ms: int, handoff_id: UUID | None, reason: str, payload: bytes) -> None:
        hid = None if handoff_id is None else str(handoff_id)
        self.rejections.append((at_ms, hid, reason, payload))

    def quarantine(self, at_ms: int, handoff_id: UUID, reason: str) -> None:
        """Set the handoff aside: its state becomes `quarantined`, with the reason beside it."""
        self.quarantined.append((at_ms, str(handoff_id)))
        self.reject(at_ms, handoff_id, f"{QUARANTINE_PREFIX} {reason}", b"")

    def __bool__(self) -> bool:
        return bool(
            self.events
            or self.handoffs
            or self.published
            or self.rejections
            or self.quarantined
            or self.meta
            or self.merge is not None
            or self.history
        )


class HandoffReader(Protocol):
    """What every reader of a log offers for one handoff."""

    def summary(self, handoff_id: UUID) -> HandoffRow:
        """One handoff's row."""
        ...

    def load(self, handoff_id: UUID) -> HandoffLog:
        """One handoff's row and its decoded log."""
        ...


_ROW_FIELDS = HandoffRow.__struct_fields__


def read_row(values: Sequence[object] | dict[str, Any]) -> HandoffRow:
    """A `handoffs` row from its columns (in `HANDOFF_COLUMNS` order) or from its fields by
    name (an export's header), every one checked against its type. A state this build does not
    know is kept in `unknown_state`; any other bad column is `StoreCorrupt`."""
    fields = values if isinstance(values, dict) else dict(zip(_ROW_FIELDS, values, strict=False))
    state = fields.get("state")
    if state is not None and state not in _KNOWN_STATES:
        fields = {**fields, "state": None, "unknown_state": state}
    try:
        return msgspec.convert(fields, HandoffRow)
    except msgspec.ValidationError as exc:
        raise StoreCorrupt(
            f"handoff {fields.get('handoff_id')!r}: bad handoffs row: {exc}"
        ) from exc


def read_record(blob: object) -> LogRecord:
    """A record stored whole (layout 1, an export), decoded; `LogCorrupt` if it is not one."""
    if not isinstance(blob, bytes):
        raise LogCorrupt(f"a record stored as {type(blob).__name__}, not bytes")
    return decode_record(blob)


def read_event(
    handoff_id: bytes, row: tuple[int, int, int, bytes], mark: tuple[int, int | None]
) -> LoggedEvent:
    """One layout-2 event of the handoff whose id's 16 bytes are `handoff_id`: its columns
    (seq, type, at_ms, fields) put back together and decoded, with the handoff's outbox mark
    (published seq, when) if it covers this action. `LogCorrupt` (saying what, not where: the
    caller knows) if it does not decode."""
    seq, code, at_ms, fields = row
    published_seq, marked_at = mark
    record = decode_record(join_record(handoff_id, code, at_ms, fields))
    # The handoff's one outbox mark covers every action up to its seq.
    if isinstance(record, ActionRecord) and seq <= published_seq:
        return LoggedEvent(seq, at_ms, record, marked_at)
    return LoggedEvent(seq, at_ms, record)
