"""Ownership of one partition, fenced by the partition's replicated log.

Theory of operation. Each partition has one subject in the replicated log stream
(`events.subjects.partition_log_subject`), written only by compare-and-set
(`Bus.append_expecting`): every append names the sequence of the subject's last entry as its
writer last saw it, and JetStream refuses it if anyone appended since. The log's entries (their
types, tags and versions, and how each is decoded, are in worker.tier.entries):

    Claimed(epoch, owner)           a worker took the partition; epochs count up from 1
    Appended(epoch, inputs, records) the owner applied these inputs (their stream sequences in
                                    the input stream) and logged these records (opaque here:
                                    the event log's records, as the caller encodes them)
    HandedOver(epoch, owner)        the owner gave the partition up cleanly (it acted on what
                                    it appended and gave back the rest): the next claim is a
                                    hand-over, not a takeover from an owner that died
    Snapshot(epoch, owner, applied, records, claims)
                                    the owner's summary of everything before it: the
                                    partition's live state (opaque here), the applied inputs
                                    that may still be delivered again, and the latest claims.
                                    It is written as a roll-up, which drops every earlier entry
                                    of the subject in the same compare-and-set; one too large
                                    for a message goes as `SnapshotPart`s of one atomic batch

A worker becomes the owner by `claim`: it reads the subject (catch-up: the last snapshot, if
any, and the entries after it; the epoch so far, the inputs applied that may come again, every
record), then appends `Claimed(epoch + 1)` at the last sequence it read; from then on it
appends at the sequence its previous append got. So what a claim reads is bounded by the live
state and the entries since the last snapshot, never by history. A claim that reads an entry a
newer build wrote appends nothing and raises `NewerLogVersion` (see "Reading rule" in
worker.tier.entries): it fences nobody. Invariants:

- At most one writer appends at a time: the appends to the subject form one chain, and each
  link names the one before it. Whoever claimed last is the owner; every other writer's next
  append is refused (`Fenced`), including a claim that raced another.
- A writer that was refused once is fenced for good: `PartitionLog` refuses every later append
  itself, without asking NATS. It must claim anew (a new `PartitionLog`) to own the partition
  again, after catching up on what the others appended.
- An input is applied once: its stream sequence is in at most one `Appended` entry, because an
  owner learns at its claim every applied input that can still be delivered (those of the
  entries read, and a snapshot's `applied`, which its writer kept above the consumer's ack
  floor) and appends only inputs not yet applied (the caller's duty; `PartitionOwner` does
  it), and a fenced writer appends nothing.
- A snapshot is fenced like an append: a zombie's roll-up is refused whole and drops nothing.
  A roll-up that landed or not is all or nothing (one message, or one atomic batch), so a
  reader finds either the previous snapshot and its tail or the new one.

`read_claims` reads the latest claims, in order: who owned a partition when, for a report (the
demo's failover times), not for owning it; those a snapshot kept (the last `CLAIMS_KEPT`) and
those after it. The stream has no age limit (`worker.tier.streams.open_partition_log`):
snapshots bound it.

What it does not do. It does not stop a fenced writer from acting on what it did not append:
the caller must act (publish, acknowledge) only after its append returned, and stop at the
first `Fenced` (see worker.tier.owner), nor decide when to snapshot (the owner does).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field

import msgspec

from kvhandoff.events.subjects import partition_log_subject
from kvhandoff.worker.ambient import now_ms
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.publish import MAX_BATCH_MESSAGES
from kvhandoff.worker.bus.streams import last_sequence, read_subject
from kvhandoff.worker.errors import BusError, Fenced
from kvhandoff.worker.tier.entries import (
    LOG_VERSION,
    Appended,
    Claimed,
    Entry,
    HandedOver,
    Snapshot,
    SnapshotPart,
    decode_entry,
    decode_snapshot,
    encode_entry,
)

logger = logging.getLogger(__name__)


CLAIMS_KEPT = 32  # the claims a snapshot keeps for `read_claims`
# What a snapshot's message leaves of the bus's largest message for its headers and framing.
_PART_MARGIN = 16 * 1024


@dataclass
class CaughtUp:
    """What a partition's log held when a worker claimed it."""

    epoch: int  # the claimant's: one more than any before
    previous_owner: str | None
    handed_over: bool = False  # the log ends with the previous owner's `HandedOver`
    applied: set[int] = field(default_factory=set)  # input stream sequences
    snapshot: bytes | None = None  # the records of the snapshot the log starts with, if any
    records: list[bytes] = field(default_factory=list)  # of the entries after it, in order
    claims: list[Claimed] = field(default_factory=list)  # the snapshot's and those after it
    entries: int = 0  # log messages read

    def take(self, entry: Entry) -> None:
        """Read the next entry of the log."""
        match entry:
            case Claimed(epoch=epoch, owner=owner):
                self.epoch = max(self.epoch, epoch + 1)
                self.previous_owner = owner
                self.claims.append(entry)
            case Appended(inputs=inputs, records=records):
                self.applied.update(inputs)
                self.records.append(records)
            case Snapshot():
                # A roll-up replaced everything before it: it is the log's first entry.
                self.epoch = max(self.epoch, entry.epoch + 1)
                self.previous_owner = entry.owner
                self.applied = set(entry.applied)
                self.snapshot = entry.records
                self.records = []
                self.claims = list(entry.claims)
        self.handed_over = isinstance(entry, HandedOver)


def read_entries(partition: int, subject: str, entries: list[tuple[int, bytes]]) -> list[Entry]:
    """The log's entries, a snapshot's parts joined; `NewerLogVersion` naming the first entry
    a newer build wrote (see "Reading rule" in worker.tier.entries), `BusError` naming the
    first entry that is none."""
    found: list[Entry] = []
    parts: list[bytes] = []
    for seq, data in entries:
        where = f"partition {partition}: entry {seq} of {subject}"
        try:
            entry = decode_entry(data, where)
            if isinstance(entry, SnapshotPart):
                parts.append(entry.data)
                if entry.index + 1 < entry.count:
                    continue
                entry = decode_snapshot(b"".join(parts), f"{where} (a snapshot's last part)")
                parts = []
        except msgspec.DecodeError as exc:
            raise BusError(
                f"partition {partition}: entry {seq} of {subject} is not a log entry ({exc}); "
                "refusing to own a log this build cannot read"
            ) from exc
        found.append(entry)
    if parts:
        raise BusError(
            f"partition {partition}: {subject} ends inside a snapshot's parts, which are stored "
            "all together or not at all; refusing to own a log this build cannot read"
        )
    return found


class PartitionLog:
    """One partition's log as one worker writes it: `claim`, then `append`, until fenced."""

    def __init__(
        self,
        bus: Bus,
        stream: str,
        prefix: str,
        partition: int,
        owner: str,
        *,
        append_timeout_s: float = 15.0,
    ) -> None:
        self.partition = partition
        self.owner = owner
        self.subject = partition_log_subject(prefix, partition)
        self._prefix = prefix
        self.epoch = 0  # none until claimed
        self.fenced = False
        self._bus = bus
        self._stream = stream
        self._last_seq: int | None = None  # the subject's last entry, as of our last append
        self._claims: list[Claimed] = []  # the latest, ours last: kept by each snapshot
        # Long enough to ride out the election of a new stream leader on a busy machine.
        self._append_timeout_s = append_timeout_s

    def anew(self) -> PartitionLog:
        """A log for the same worker and partition, to claim again (once pinned anew)."""
        return PartitionLog(
            self._bus,
            self._stream,
            self._prefix,
            self.partition,
            self.owner,
            append_timeout_s=self._append_timeout_s,
        )

    async def claim(self) -> CaughtUp:
        """Catch up on the partition's log and append our `Claimed`; `Fenced` if another
        worker appended meanwhile (it is the owner), `BusError` if the log cannot be read."""
        if self.fenced or self._last_seq is not None:
            raise BusError(
                f"partition {self.partition}: {self.owner} claims it once per PartitionLog "
                f"(epoch {self.epoch}, fenced {self.fenced})"
            )
        entries = await read_subject(self._bus, self._stream, self.subject)
        caught = CaughtUp(epoch=1, previous_owner=None, entries=len(entries))
        for entry in read_entries(self.partition, self.subject, entries):
            caught.take(entry)
        last = entries[-1][0] if entries else 0
        claim = Claimed(
            epoch=caught.epoch,
            owner=self.owner,
            at_ms=now_ms(),
            version=LOG_VERSION,
        )
        try:
            self._last_seq = await self._bus.append_expecting(
                self.subject, encode_entry(claim), last, give_up_after_s=self._append_timeout_s
            )
        except Fenced:
            self.fenced = True
            raise
        self.epoch = caught.epoch
        self._claims = [*caught.claims, claim][-CLAIMS_KEPT:]
        logger.info(
            "partition %d: claimed as epoch %d by %s (after %s; read %d entries%s of its log, "
            "%d applied inputs that may come again)",
            self.partition,
            self.epoch,
            self.owner,
            caught.previous_owner or "nobody",
            caught.entries,
            ", a snapshot first" if caught.snapshot is not None else "",
            len(caught.applied),
        )
        return caught

    async def hand_over(self) -> None:
        """Log that this owner handed the partition over, last of what it appends; `Fenced`
        if another worker appended first."""
        entry = HandedOver(
            epoch=self.epoch,
            owner=self.owner,
            at_ms=now_ms(),
            version=LOG_VERSION,
        )
        await self._append(entry)

    async def append(self, inputs: list[int], records: bytes) -> int:
        """Log that these inputs were applied, with their records; the entry's sequence.
        `Fenced`, for this and every later call, once another worker appended first."""
        entry = Appended(epoch=self.epoch, inputs=inputs, records=records, version=LOG_VERSION)
        return await self._append(entry)

    async def snapshot(self, applied: list[int], records: bytes) -> int:
        """Replace the partition's log by a snapshot of its state: `records`, as the caller
        encodes them, and the applied inputs that may still be delivered. Fenced like an
        append: the roll-up names the last entry this owner appended, and is refused whole if
        another worker appended since. The snapshot's (last) sequence."""
        entry = Snapshot(
            self.epoch,
            self.owner,
            now_ms(),
            applied,
            records,
            self._claims,
            version=LOG_VERSION,
        )
        encoded = encode_entry(entry)
        room = self._bus.max_payload - _PART_MARGIN
        if len(encoded) <= room:
            return await self._append(entry, rollup=True)
        count = -(-len(encoded) // room)
        if count > MAX_BATCH_MESSAGES:
            raise BusError(
                f"partition {self.partition}: a snapshot of {len(encoded)} bytes would take "
                f"{count} messages, more than one atomic batch holds ({MAX_BATCH_MESSAGES})"
            )
        parts = [
            encode_entry(SnapshotPart(i, count, encoded[i * room : (i + 1) * room], LOG_VERSION))
            for i in range(count)
        ]
        return await self._appended(
            self._bus.roll_up_batch(
                self.subject, parts, self._checked_last_seq(), timeout_s=self._append_timeout_s
            )
        )

    async def superseded(self) -> bool:
        """Whether another worker appended to the log since this owner's last append (one
        read of the log's last sequence); `BusError` if it cannot be read."""
        if self._last_seq is None or self.fenced:
            return self.fenced
        return await last_sequence(self._bus, self._stream, self.subject) != self._last_seq

    def _checked_last_seq(self) -> int:
        """The sequence the next append expects: claimed, and not fenced."""
        if self._last_seq is None:
            raise BusError(f"partition {self.partition}: append before claim by {self.owner}")
        if self.fenced:
            raise Fenced(
                f"partition {self.partition}: {self.owner} (epoch {self.epoch}) was fenced "
                "already; it appends nothing more"
            )
        return self._last_seq

    async def _appended(self, append: Awaitable[int]) -> int:
        """The sequence `append` (a compare-and-set of this owner's) stored; `Fenced`, for
        this and every later append, if another worker appended first."""
        try:
            self._last_seq = await append
        except Fenced:
            self.fenced = True
            logger.warning(
                "partition %d: %s (epoch %d) is fenced: another worker claimed it; "
                "dropping it at once, no publish, no ack",
                self.partition,
                self.owner,
                self.epoch,
            )
            raise
        return self._last_seq

    async def _append(
        self, entry: Appended | HandedOver | Snapshot, *, rollup: bool = False
    ) -> int:
        last_seq = self._checked_last_seq()
        return await self._appended(
            self._bus.append_expecting(
                self.subject,
                encode_entry(entry),
                last_seq,
                give_up_after_s=self._append_timeout_s,
                rollup=rollup,
            )
        )


async def read_claims(bus: Bus, stream: str, prefix: str, partition: int) -> list[Claimed]:
    """The partition's latest claims, in log order: those its last snapshot kept (the last
    `CLAIMS_KEPT`) and those after it; `BusError` if the log cannot be read or holds what is no
    entry, `NewerLogVersion` if it holds a newer build's."""
    subject = partition_log_subject(prefix, partition)
    caught = CaughtUp(epoch=1, previous_owner=None)
    for entry in read_entries(partition, subject, await read_subject(bus, stream, subject)):
        caught.take(entry)
    return caught.claims
