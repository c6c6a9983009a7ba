"""Every kind of entry of a partition's replicated log, its tag, its version, and how it is read.

A partition's log (worker.tier.ownership) is a JetStream subject of msgpack messages, each one
entry, told apart by its tag in the field `entry`:

    tag            type          what it says
    claimed        Claimed       a worker took the partition, as owner number `epoch`
    appended       Appended      the owner applied these inputs; `records` holds their rows, a
                                 `LoggedRows` (tag `rows` in the field `kind`)
    handed_over    HandedOver    the owner gave the partition up cleanly
    snapshot       Snapshot      the partition's state before it, which replaced the log up to
                                 it; `records` holds a `LoggedState` (tag `state` in `kind`)
    snapshot_part  SnapshotPart  one part of an encoded `Snapshot` too large for one message

The meaning of each is in worker.tier.ownership (the entries) and worker.tier.service (the rows
and the state). Tags never change: a class may be renamed, its tag stays.

Versions. Every entry, and the records inside one, carries `version`: the log version of the
build that wrote it. It covers what the entry holds: a build that writes rows of version 2
writes them in an `Appended` of version 2. This build reads and writes `LOG_VERSION`, 1. An
entry without the field is of version 1: the entries from before versions, and this build's own,
since every type here omits its defaults on the wire; so this build writes the bytes that the
builds before versions wrote, and they read it (tests/worker/test_log_entries.py holds the bytes
of each kind).

What a next version may change, and how:

- A new field with a default, whose absence an older build may ignore without acting otherwise:
  no new version. An older build decodes the entry without it (msgspec skips the fields a type
  does not name; we never set `forbid_unknown_fields` on these types).
- Anything an older build must not ignore: a new entry kind, a new handoff state, a new record
  type in the rows' events, a field without which the entry means something else: a new
  `LOG_VERSION`. A field's type never changes; a change of meaning is a new field or a new kind.

Reading rule. An entry of a version above `LOG_VERSION`, of a kind this build does not know, or
holding a handoff in a state or an event of a record type (`events.records.TYPE_CODES`) it does
not know, is refused with `NewerLogVersion`, which names the partition, the entry and both
versions; it is never `StoreCorrupt`, and it is never skipped.
A worker that skipped what it does not understand would rebuild the partition from a part of
its history and act on it (handoffs lost, or started again): a worker that cannot read a
partition's history must not own it. So the worker stops, as for `LogDiverges` (exit 2, its
other partitions handed over: worker.tier.membership), and a worker that can read the log takes
the partition. The entries are checked where the log is read, before a claim appends its
`Claimed` (`worker.tier.ownership.read_entries`), so an older worker that meets a newer log
fences nobody; the rows and the state are checked again when the local file catches up
(worker.tier.service), which is where a handoff state or a record type unknown here shows up if
its writer did not bump the version. Whatever else does not decode is corrupt:
`msgspec.DecodeError`, which the callers report as before.

Rolling upgrades. A new version takes two releases: one that reads it and still writes the old
one, then, once every worker of the tier runs that, one that writes it. Done so, no worker ever
meets an entry it cannot read; `NewerLogVersion` is for the upgrade that skipped a step.
"""

from __future__ import annotations

from typing import Protocol, TypeVar
from uuid import UUID

import msgspec

from kvhandoff.events.records import TYPE_CODES
from kvhandoff.worker.errors import NewerLogVersion
from kvhandoff.worker.log.rows import Batch, HandoffRow, LiveState, Tombstone
from kvhandoff.worker.log.schema import HandoffState

# The log version this build reads up to and writes (see "Versions").
LOG_VERSION = 1

# The meta key of a partition file's mark: the first input of the last entry it holds.
MARK_KEY = "partition_log_mark"


class Claimed(msgspec.Struct, frozen=True, omit_defaults=True, tag="claimed", tag_field="entry"):
    """A worker took the partition, as owner number `epoch`."""

    epoch: int
    # "<label>/<member instance>" (worker.tier.membership: Tier.owner_name; worker.bus.Member)
    owner: str
    at_ms: int  # the claimant's wall clock
    version: int = 1

    @property
    def instance(self) -> str:
        """The claimant's member instance, as it announces itself (`worker.bus.Member`)."""
        return self.owner.rpartition("/")[2]


class Appended(msgspec.Struct, frozen=True, omit_defaults=True, tag="appended", tag_field="entry"):
    """The owner of `epoch` applied these inputs and logged these records (a `LoggedRows`)."""

    epoch: int
    inputs: list[int]  # stream sequences in the input stream
    records: bytes = b""
    version: int = 1


class HandedOver(
    msgspec.Struct, frozen=True, omit_defaults=True, tag="handed_over", tag_field="entry"
):
    """The owner of `epoch` handed the partition over (worker.tier.owner, "Hand-over").
    It fences nothing: it only tells the next claimant how the previous owner left."""

    epoch: int
    owner: str
    at_ms: int
    version: int = 1


class Snapshot(msgspec.Struct, frozen=True, omit_defaults=True, tag="snapshot", tag_field="entry"):
    """The owner of `epoch` summed up the partition's log before this entry, which replaced
    it: `records`, the live state (a `LoggedState`); `applied`, the input stream sequences
    applied that the consumer may still deliver; `claims`, the latest `Claimed` entries, oldest
    first (for `worker.tier.ownership.read_claims`)."""

    epoch: int
    owner: str
    at_ms: int
    applied: list[int]
    records: bytes
    claims: list[Claimed] = []
    version: int = 1


class SnapshotPart(
    msgspec.Struct, frozen=True, omit_defaults=True, tag="snapshot_part", tag_field="entry"
):
    """Part `index` of `count` of an encoded `Snapshot` too large for one message: the parts
    are stored together or not at all (one atomic batch), the first rolling the subject up."""

    index: int
    count: int
    data: bytes
    version: int = 1


# What a reader of the log sees: a snapshot's parts are joined (`read_entries`).
Entry = Claimed | Appended | HandedOver | Snapshot


class LoggedRows(msgspec.Struct, frozen=True, omit_defaults=True, tag="rows", tag_field="kind"):
    """One batch's rows, as appended to the partition's replicated log (`Appended.records`)
    and committed to its local file: a `worker.log.rows.Batch`, whose outbox marks are those the
    server confirmed since the previous batch (so that a new owner republishes only the
    actions of the last batches, not the partition's history)."""

    inputs: list[int]  # the input stream sequences applied: the first is the entry's mark
    events: list[tuple[str, int, int, int, bytes]]  # (handoff id, seq, type, at_ms, record)
    handoffs: list[HandoffRow]
    rejections: list[tuple[int, str | None, str, bytes]]  # (at_ms, handoff id, reason, payload)
    quarantined: list[tuple[int, str]]  # (at_ms, handoff id)
    # (handoff id, seq, at_ms): outbox marks. msgspec writes a UUID as its text, so entries
    # appended when this was a str read the same.
    published: list[tuple[UUID, int, int]]
    # The tombstones of the handoffs the batch ended: what a claim that reads this entry after
    # a snapshot keeps of them, without reading their rows (none in entries from before).
    ended: list[Tombstone] = []
    # The events logged before of each handoff the batch appended to after it had ended, as
    # `events` (`Batch.carry`); their outbox marks are in `published`. A snapshot taken since
    # it ended knows it by its tombstone alone: a claim that catches a file up from that
    # snapshot takes its history from here (none in entries from before; a build that
    # ignores it catches up as before, a handoff's events from this entry on).
    history: list[tuple[str, int, int, int, bytes]] = []
    # The mark (first input) of the newest entry of its owner whose actions and rejections the
    # server confirmed, with every entry's before it: a claim publishes again the rejections of
    # the entries after it, which the owner may have died before publishing (rejections have no
    # outbox marks). None: nothing confirmed yet (and in entries from before it; a build that
    # ignores it publishes no rejection again).
    confirmed: int | None = None
    version: int = 1

    @classmethod
    def of(
        cls,
        inputs: list[int],
        batch: Batch,
        published: list[tuple[UUID, int, int]],
        ended: list[Tombstone],
        confirmed: int | None = None,
    ) -> LoggedRows:
        return cls(
            inputs,
            batch.events,
            list(batch.handoffs.values()),
            batch.rejections,
            batch.quarantined,
            # The batch's own marks are those of the histories it carries.
            [*published, *((h, seq, at) for h, (seq, at) in batch.published.items())]
            if batch.published
            else published,
            ended,
            batch.history,
            confirmed,
            version=LOG_VERSION,
        )

    def add_to(self, batch: Batch) -> None:
        """Add these rows to `batch`, after those it holds (a later row of a handoff wins)."""
        batch.events.extend(self.events)
        batch.history.extend(self.history)
        batch.handoffs.update((row.handoff_id, row) for row in self.handoffs)
        batch.rejections.extend(self.rejections)
        batch.quarantined.extend(self.quarantined)
        for handoff_id, seq, at_ms in self.published:
            batch.mark_published(handoff_id, seq, at_ms)
        if self.inputs:
            batch.meta[MARK_KEY] = str(self.inputs[0])


class LoggedState(msgspec.Struct, frozen=True, omit_defaults=True, tag="state", tag_field="kind"):
    """A partition's live state, as a snapshot of its replicated log holds it
    (`Snapshot.records`): a `worker.log.rows.LiveState`, and the mark of the last entry it
    sums up, so that a file that holds that entry already takes none of it."""

    mark: int | None  # the local file's mark after that entry (`MARK_KEY`)
    handoffs: list[HandoffRow]
    marks: list[tuple[UUID, int, int | None]]
    events: list[tuple[str, int, int, int, bytes]]
    tombstones: list[Tombstone]
    version: int = 1

    def live_state(self) -> LiveState:
        return LiveState(self.handoffs, self.marks, self.events, self.tombstones)


class _ProbedRow(msgspec.Struct):
    handoff_id: str = "?"
    state: str | None = None


class _Probe(msgspec.Struct):
    """What can be told of an entry that did not decode: whether a newer build wrote it. Every
    field has a default, so that any map decodes; whatever is not a map is corrupt."""

    entry: str | None = None  # the tag of an entry
    kind: str | None = None  # the tag of an entry's records
    version: int = 1
    handoffs: list[_ProbedRow] = []


class _Versioned(Protocol):
    @property
    def version(self) -> int: ...


_T = TypeVar("_T", bound=_Versioned)

_ENCODER = msgspec.msgpack.Encoder()
_ENTRY: msgspec.msgpack.Decoder[Entry | SnapshotPart] = msgspec.msgpack.Decoder(
    Entry | SnapshotPart
)
_SNAPSHOT = msgspec.msgpack.Decoder(Snapshot)
_ROWS = msgspec.msgpack.Decoder(LoggedRows)
_STATE = msgspec.msgpack.Decoder(LoggedState)
_PROBE = msgspec.msgpack.Decoder(_Probe)
# Every kind of entry, and of an entry's records, that this build reads and writes.
ENTRY_KINDS = (Claimed, Appended, HandedOver, Snapshot, SnapshotPart)
RECORD_KINDS = (LoggedRows, LoggedState)
_ENTRY_TAGS = frozenset(str(kind.__struct_config__.tag) for kind in ENTRY_KINDS)
_RECORD_TAGS = frozenset(str(kind.__struct_config__.tag) for kind in RECORD_KINDS)
_KNOWN_STATES = frozenset(state.value for state in HandoffState)
_KNOWN_TYPES = frozenset(TYPE_CODES.values())


def encode_entry(entry: Entry | SnapshotPart | LoggedRows | LoggedState) -> bytes:
    """An entry, or an entry's records, as the log stores it."""
    return _ENCODER.encode(entry)


def decode_entry(data: bytes, where: str) -> Entry | SnapshotPart:
    """One message of a partition's log. `where` names it for `NewerLogVersion` (see "Reading
    rule"); `msgspec.DecodeError` if it is no entry at all."""
    return _decode(_ENTRY, data, where)


def decode_snapshot(data: bytes, where: str) -> Snapshot:
    """A `Snapshot`, its parts' data joined; as `decode_entry`."""
    return _decode(_SNAPSHOT, data, where)


def decode_rows(data: bytes, where: str) -> LoggedRows:
    """An `Appended` entry's records; as `decode_entry`."""
    rows = _decode(_ROWS, data, where)
    _check_types(rows.events, where)
    _check_types(rows.history, where)
    return rows


def decode_state(data: bytes, where: str) -> LoggedState:
    """A `Snapshot`'s records; as `decode_entry`."""
    state = _decode(_STATE, data, where)
    _check_types(state.events, where)
    return state


def _decode(decoder: msgspec.msgpack.Decoder[_T], data: bytes, where: str) -> _T:
    try:
        entry = decoder.decode(data)
    except msgspec.DecodeError as exc:
        newer = _newer(data, where)
        if newer is not None:
            raise newer from exc
        raise
    if entry.version > LOG_VERSION:
        raise _refusal(where, f"is of log version {entry.version}")
    return entry


def _check_types(events: list[tuple[str, int, int, int, bytes]], where: str) -> None:
    """Refuse an event whose record type a newer build's coordinator made: this build's would
    read it as a corrupt record, and quarantine a handoff that is not."""
    for handoff_id, seq, code, _, _ in events:
        if code not in _KNOWN_TYPES:
            raise _refusal(
                where,
                f"holds event {seq} of handoff {handoff_id} of record type {code}, which this "
                "build lacks",
            )


def _newer(data: bytes, where: str) -> NewerLogVersion | None:
    """Why `data`, which did not decode, is a newer build's entry; None if it is not one."""
    try:
        probe = _PROBE.decode(data)
    except msgspec.DecodeError:
        return None
    if probe.version > LOG_VERSION:
        return _refusal(where, f"is of log version {probe.version}")
    if probe.entry is not None and probe.entry not in _ENTRY_TAGS:
        return _refusal(where, f"is an entry of kind {probe.entry!r}, which this build lacks")
    if probe.kind is not None and probe.kind not in _RECORD_TAGS:
        return _refusal(where, f"holds records of kind {probe.kind!r}, which this build lacks")
    for row in probe.handoffs:
        if row.state is not None and row.state not in _KNOWN_STATES:
            return _refusal(
                where,
                f"holds handoff {row.handoff_id} in state {row.state!r}, which this build lacks",
            )
    return None


def _refusal(where: str, what: str) -> NewerLogVersion:
    return NewerLogVersion(
        f"{where} {what}: a newer build wrote it, and this build reads the log up to version "
        f"{LOG_VERSION}. Upgrade this worker: it does not own a partition whose history it "
        "cannot read"
    )
