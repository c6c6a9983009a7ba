"""Ownership of one partition, fenced by the partition's replicated log.

Theory of operation. Each partition has one subject in the replicated log stream
(`worker.bus.partition_log_subject`), written only by compare-and-set
(`Bus.append_expecting`): every append names the sequence of the subject's last entry as its
writer last saw it, and JetStream refuses it if anyone appended since. The log's entries:

    Claimed(epoch, owner)           a worker took the partition; epochs count up from 1
    Appended(epoch, inputs, records) the owner applied these inputs (their stream sequences in
                                    the input stream) and logged these records (opaque here:
                                    the event log's records, as the caller encodes them)
    HandedOver(epoch, owner)        the owner gave the partition up cleanly (it acted on what
                                    it appended and gave back the rest): the next claim is a
                                    hand-over, not a takeover from an owner that died

A worker becomes the owner by `claim`: it reads the whole subject (catch-up: the epoch so far,
every input ever applied, every record), then appends `Claimed(epoch + 1)` at the last sequence
it read. From then on it appends at the sequence its previous append got. Invariants:

- At most one writer appends at a time: the appends to the subject form one chain, and each
  link names the one before it. Whoever claimed last is the owner; every other writer's next
  append is refused (`Fenced`), including a claim that raced another.
- A writer that was refused once is fenced for good: `PartitionLog` refuses every later append
  itself, without asking NATS. It must claim anew (a new `PartitionLog`) to own the partition
  again, after catching up on what the others appended.
- An input is applied once: its stream sequence is in at most one `Appended` entry, because an
  owner learns every applied input at its claim and appends only inputs not yet applied (the
  caller's duty; `PartitionOwner` does it), and a fenced writer appends nothing.

`read_claims` reads the `Claimed` entries alone, in order: who owned a partition when, for a
report (the demo's failover times), not for owning it.

What it does not do. It does not stop a fenced writer from acting on what it did not append:
the caller must act (publish, acknowledge) only after its append returned, and stop at the
first `Fenced` (see worker.partition_owner). The log grows without bound here: the stream has
no age limit (`Bus.open_partition_log`), since a catch-up must find everything an open handoff
needs; snapshots that roll a subject up are the way to bound it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec

from kvhandoff.worker.bus import Bus, partition_log_subject
from kvhandoff.worker.errors import BusError, Fenced

logger = logging.getLogger(__name__)


class Claimed(msgspec.Struct, frozen=True, tag="claimed", tag_field="entry"):
    """A worker took the partition, as owner number `epoch`."""

    epoch: int
    owner: str  # "<label>/<member instance>" (worker.tier: Tier.owner_name; worker.bus.Member)
    at_ms: int  # the claimant's wall clock

    @property
    def instance(self) -> str:
        """The claimant's member instance, as it announces itself (`worker.bus.Member`)."""
        return self.owner.rpartition("/")[2]


class Appended(msgspec.Struct, frozen=True, tag="appended", tag_field="entry"):
    """The owner of `epoch` applied these inputs and logged these records."""

    epoch: int
    inputs: list[int]  # stream sequences in the input stream
    records: bytes = b""


class HandedOver(msgspec.Struct, frozen=True, tag="handed_over", tag_field="entry"):
    """The owner of `epoch` handed the partition over (worker.partition_owner, "Hand-over").
    It fences nothing: it only tells the next claimant how the previous owner left."""

    epoch: int
    owner: str
    at_ms: int


Entry = Claimed | Appended | HandedOver

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Entry)


@dataclass
class CaughtUp:
    """What a partition's log held when a worker claimed it."""

    epoch: int  # the claimant's: one more than any before
    previous_owner: str | None
    handed_over: bool = False  # the log ends with the previous owner's `HandedOver`
    applied: set[int] = field(default_factory=set)  # input stream sequences
    records: list[bytes] = field(default_factory=list)  # in log order


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
        # Long enough to ride out the election of a new stream leader on a busy machine.
        self._append_timeout_s = append_timeout_s

    def anew(self) -> PartitionLog:
        """A log for the same worker and partition, to claim again (once pinned anew)."""
        return PartitionLog(
            self._bus, self._stream, self._prefix, self.partition, self.owner,
            append_timeout_s=self._append_timeout_s,
        )  # fmt: skip

    async def claim(self) -> CaughtUp:
        """Catch up on the partition's log and append our `Claimed`; `Fenced` if another
        worker appended meanwhile (it is the owner), `BusError` if the log cannot be read."""
        if self.fenced or self._last_seq is not None:
            raise BusError(
                f"partition {self.partition}: {self.owner} claims it once per PartitionLog "
                f"(epoch {self.epoch}, fenced {self.fenced})"
            )
        entries = await self._bus.read_subject(self._stream, self.subject)
        caught = CaughtUp(epoch=1, previous_owner=None)
        for seq, data in entries:
            try:
                entry = _DECODER.decode(data)
            except msgspec.DecodeError as exc:
                raise BusError(
                    f"partition {self.partition}: entry {seq} of {self.subject} is not a log "
                    f"entry ({exc}); refusing to own a log this build cannot read"
                ) from exc
            match entry:
                case Claimed(epoch=epoch, owner=owner):
                    caught.epoch = max(caught.epoch, epoch + 1)
                    caught.previous_owner = owner
                case Appended(inputs=inputs, records=records):
                    caught.applied.update(inputs)
                    caught.records.append(records)
            caught.handed_over = isinstance(entry, HandedOver)
        last = entries[-1][0] if entries else 0
        claim = Claimed(epoch=caught.epoch, owner=self.owner, at_ms=time.time_ns() // 1_000_000)
        try:
            self._last_seq = await self._bus.append_expecting(
                self.subject, _ENCODER.encode(claim), last, give_up_after_s=self._append_timeout_s
            )
        except Fenced:
            self.fenced = True
            raise
        self.epoch = caught.epoch
        logger.info(
            "partition %d: claimed as epoch %d by %s (after %s; %d inputs applied before)",
            self.partition, self.epoch, self.owner, caught.previous_owner or "nobody",
            len(caught.applied),
        )  # fmt: skip
        return caught

    async def hand_over(self) -> None:
        """Log that this owner handed the partition over, last of what it appends; `Fenced`
        if another worker appended first."""
        entry = HandedOver(epoch=self.epoch, owner=self.owner, at_ms=time.time_ns() // 1_000_000)
        await self._append(entry)

    async def append(self, inputs: list[int], records: bytes) -> int:
        """Log that these inputs were applied, with their records; the entry's sequence.
        `Fenced`, for this and every later call, once another worker appended first."""
        return await self._append(Appended(epoch=self.epoch, inputs=inputs, records=records))

    async def _append(self, entry: Appended | HandedOver) -> int:
        if self._last_seq is None:
            raise BusError(f"partition {self.partition}: append before claim by {self.owner}")
        if self.fenced:
            raise Fenced(
                f"partition {self.partition}: {self.owner} (epoch {self.epoch}) was fenced "
                "already; it appends nothing more"
            )
        try:
            self._last_seq = await self._bus.append_expecting(
                self.subject,
                _ENCODER.encode(entry),
                self._last_seq,
                give_up_after_s=self._append_timeout_s,
            )
        except Fenced:
            self.fenced = True
            logger.warning(
                "partition %d: %s (epoch %d) is fenced: another worker claimed it; "
                "dropping it at once, no publish, no ack",
                self.partition, self.owner, self.epoch,
            )  # fmt: skip
            raise
        return self._last_seq


async def read_claims(bus: Bus, stream: str, prefix: str, partition: int) -> list[Claimed]:
    """The partition's `Claimed` entries, in log order; `BusError` if the log cannot be read
    or holds an entry this build cannot decode."""
    subject = partition_log_subject(prefix, partition)
    claims = []
    for seq, data in await bus.read_subject(stream, subject):
        try:
            entry = _DECODER.decode(data)
        except msgspec.DecodeError as exc:
            raise BusError(f"entry {seq} of {subject} is not a log entry ({exc})") from exc
        if isinstance(entry, Claimed):
            claims.append(entry)
    return claims
