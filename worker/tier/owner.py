"""Owning one partition: pull its inputs while pinned, apply each once, append before acting.

Theory of operation. A `PartitionOwner` pulls the partition's consumer in the priority group
`worker.tier.streams.PRIORITY_GROUP`. The server delivers to one pinned client at a time (see "Pins"
in worker.tier.streams); a pull refused with 423 means another worker holds the pin, and this one
keeps asking, which is how it takes the partition over once the holder stops pulling for the
consumer's `priority_timeout`. The first batch under a pin id it has not claimed under makes it
claim the partition's log (`worker.tier.ownership.PartitionLog.claim`): catch up, append `Claimed`.
Then, batch by batch:

    1. drop the inputs that some owner already applied (their stream sequences are in the log:
       redeliveries of inputs a dead owner appended but did not acknowledge), to acknowledge;
       hold back those that must wait for an earlier input of their handoff (see "Order");
    2. `decide` the rest: the records the batch adds to the partition's log, and the inputs
       it defers (early: applied by none, given back with a delay to come again);
    3. append the records with the inputs applied, compare-and-set (`PartitionLog.append`);
    4. only then `act` (publish what the records say), acknowledge what was appended and what
       was dropped in step 1, and give the deferred inputs back (nak with their delay).

Phases. Where the owner is, claiming, catching up, owning (under its pin, or not pinned yet
after a vacant claim), handing over, or ended (handed over, fenced, released), is one
`worker.tier.phase.PartitionPhase`: each step below moves it through `worker.tier.phase.MOVES`,
and a move the table does not hold raises `PhaseError` instead of running on a wrong guess.

Pipelining. While batch k's append is on its way, the owner does not wait idle: if batch k+1
is ready, it does steps 1 and 2 for it (the decoding, the coordinators, the local file's reads),
then step 4 for k once k's append returned, and only then step 3 for k+1; if k's append had
returned already, step 4 for k comes first, which adds no wait to k. So appends go one at a
time, each compare-and-set on the sequence the one before it got, and nothing is acted on or
acknowledged before its own append returned; a batch whose append fails (fenced, or in doubt)
takes the one decided behind it down with it, unacknowledged, and the claim that follows
rebuilds the coordinators from the log. The inputs of the batch in flight count as applied in
step 1 (a redelivery of one is dropped, not appended twice). Deciding ahead waits where order
needs it: before a claim, behind a claim's orphans (a deferred orphan is given back before the
next batch is admitted), and when `decide` answers `after_previous` (the batch names a handoff
that the batch in flight took out of memory, which only its `act` writes down).

Doubt. If an append (or a claim) fails without an answer (NATS out of reach past the append's
time limit), it may have landed or not: the owner leaves the batch unacknowledged and claims
anew before the next one, which reads the log and so learns which inputs were applied. If
`act` raises `BusError` after the append landed, the inputs are applied all the same: the owner
claims anew (a warning says so), and acting again is the steps' `claimed`'s job, as for an owner
that died between steps 3 and 4 (see "Left to others"). worker.tier.partition's `act` does not
raise for
publishes that NATS lost: it publishes them again itself, since an idle partition may see no
next batch, and so no claim, for a long time.

The fence. If step 3 is refused (`Fenced`), another worker claimed the partition since: this
one stops at once. It neither acts nor acknowledges anything more, closes its pull, and `run`
returns with `fenced` set (a metric and a warning line say so). The inputs it held come back to
the new owner after the consumer's ack wait; those it had appended are dropped there by step 1.
Order. The consumer's ack wait must be shorter than its priority timeout (less the pull's
expiry): then a new owner is pinned only after the old owner's unacknowledged inputs are due
again, and the server hands those out before newer ones (tests/cluster/test_pins.py). But not
in stream order among themselves: when the old owner held many, JetStream redelivers them in
the order their ack waits ran out, and an owner that stays pinned while it stalls is sent its
own redeliveries again, so a handoff's inputs can come to the new owner out of order (some 20 of
90 to 150 inputs in tests/cluster/test_failover.py, without the next step). So, right after its
claim, the owner reads what the consumer delivered and never had acknowledged
(`Bus.unacknowledged`; what the owner holds itself is not read again, nearly all of it for a
first batch over a backlog), keeps what the log does not say was applied (the orphans),
and admits the inputs of each batch through `worker.tier.input_order.InputOrder`: an input waits,
delivered but unacknowledged, until the orphans of its handoff before it are applied. A
reconnect orphans inputs too, without a change of owner: what the server sent on the lost
connection comes again only after its ack wait, behind newer inputs delivered on the new one. So
an owner whose pull was reset since it last read them reads the orphans again before its next
batch, and adds them to the order (not a claim: a zombie whose connection died while it was
paused must still be fenced at its next append, not claim back what another worker took).

Vacant partitions. The server pins a client only when it delivers to it, so a partition that
gets no input after it changed hands would wait for one before anyone claimed it, and the open
handoffs of a dead owner's quiet partition would be neither timed out nor retried (those are
the timers of worker.tier.partition, armed at `claimed`). So an owner that is idle and has not
claimed asks, once a second, whether anyone is pinned; once nobody has been for
`claim_vacant_after_s` (the tier gives its priority timeout: the time a pin outlives its
holder's last pull), it claims without a delivery. The first batch then comes under a pin that
claim holds for, since a worker pinned in between would have claimed, and so fenced this one.
If instead a pull is refused with 423 (another worker is pinned), the owner stops: it would be
fenced at its next append anyway. The wait keeps a clean hand-over clean: the old owner logs
`HandedOver` and unpins within a round of the balance rule, well inside the priority timeout.

Lapsed pins. An owner learns that it lost its pin from a 423 or from a batch under another pin
id, both of which need a delivery. If its pin lapses (it stalled, or NATS heard none of its
pulls, past the priority timeout) and another worker is pinned by an input, claims, and hands
back, a partition that gets no more input leaves it owning on a claim the log has left behind,
and the handoffs opened since are never timed out. So an owner that has owned under its pin
with no delivery for `claim_vacant_after_s` asks whose the pin is, once per that time (one
consumer info per idle partition per period); if the consumer names another pin or none, it
goes back to claiming (`pin_lost`): it waits for a pin, or claims once the partition is vacant.
An owner that claimed while vacant and was never pinned since has no pin to ask about: another
worker may have claimed the vacant partition too, and handed it back (the balance rule), which
leaves no pin. So it reads instead, at the same pace, whether the log's last entry is still its
own; if not, it claims anew (`doubted`).

Hand-over. Stopped (a graceful shutdown, or the balance rule of worker.tier.balance giving the
partition to another worker), the owner finishes the batch in hand, gives back what it holds
(nak: redelivered at once), logs `HandedOver` if it had claimed (so that the next claim counts
as a hand-over, not a takeover) and releases the pin (`Bus.unpin`), so the next owner is
pinned at once rather than after the priority timeout; only its own pin, as the server's unpin
drops whoever holds it (see `_release_pin`: an owner stopped while it waited would unpin the
worker that owns the partition).

Snapshots. Given a `SnapshotPolicy`, the owner replaces the partition's log by a snapshot of
its state (`PartitionLog.snapshot`: a fenced roll-up) once after each claim, whenever
`every_entries` entries were appended since the last one, or `every_s` passed with any
appended, and at a clean hand-over (before `HandedOver`). It first acts on the batch in flight,
so the snapshot follows every entry it sums up; the steps' `snapshot` makes the state (its
local file, caught up with those entries), and the owner adds the applied inputs it remembers
(see "Memory": exactly those the consumer may deliver again). So a claim reads one snapshot and
at most an interval of entries after it, however long the partition's history. A snapshot that
fails leaves the previous one and its tail in place: a refused one is a fence like any other,
one in doubt is settled by claiming anew.

Metrics (`worker.tier.metrics.TierMetrics`, if given): each claim, by what the log said of the
previous owner, and how long it took to be ready, the catch-up included; each fence; each
hand-over.

Left to others. What the owner drives is the partition's coordinator, its `Steps` (with the
real one, `worker.tier.partition.Partition`): `decide` and `act` (steps 2 and 4), `claimed`,
told what the log held after each claim, before the next batch is decided (to catch a local
SQLite file up from the claimed records), `snapshot`, and `released`. Running one owner per
partition of a worker's share is worker.tier.membership's. Acting again on what the previous
owner appended: it may have died between step 3 and step 4, and step 1 here drops those inputs
as applied, so only `claimed` can act on them (worker.tier.partition republishes what its file
does not mark published; tests/cluster/tier_process.py, the last record). Acting on its own
between batches (worker.tier.partition's timers): `released` says when that must stop, at
once, whatever ended the owner.

Memory. The applied inputs it remembers (step 1) are cut, every `forget_every_s` (10 s), to
those above the consumer's ack floor, as it was at the previous cut if it was lower then: only
those can be delivered again. Not just the floor read now: the consumer's leader may count acks
that its replicas do not have yet, and a successor would deliver those inputs again.

What it does not do yet: reorder inputs that one owner's own stall (past the ack wait, while still
pinned) sent back to it out of order; it defers inputs that come early, through `decide`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, Protocol

from kvhandoff.worker.ambient import monotonic_s
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Inbound, Pull
from kvhandoff.worker.bus.streams import ack_floor, pin_of, pinned, unacknowledged, unpin
from kvhandoff.worker.errors import BusError, Fenced, PinMismatch, StoreError
from kvhandoff.worker.tier.input_order import InputOrder
from kvhandoff.worker.tier.metrics import TierMetrics
from kvhandoff.worker.tier.ownership import CaughtUp, PartitionLog
from kvhandoff.worker.tier.phase import Event, PartitionPhase, Phase
from kvhandoff.worker.tier.streams import PRIORITY_GROUP

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Decided:
    """What `decide` made of a batch: the records to append for the inputs it applied, and the
    inputs it deferred (by stream sequence, with their delay): early inputs, not applied now,
    given back to come again after the delay (see worker.tier.planner)."""

    records: bytes
    deferred: Mapping[int, float] = field(default_factory=dict)
    # The batch cannot be decided while the batch before it is appended but not acted on (it
    # names a handoff that batch took out of memory, which only its `act` writes down): the
    # owner acts on that one first, then asks again.
    after_previous: bool = False


@dataclass(slots=True)
class _InFlight:
    """A batch decided and sent to the partition's log (see "Pipelining"): what its append's
    return lets the owner act on and settle."""

    settled: list[Inbound]  # applied by an owner already: acknowledged without acting
    fresh: list[Inbound]  # appended by `append`, acted on once it returns
    deferred: list[tuple[Inbound, float]]  # given back, with their delay
    append: asyncio.Future[int] | None  # None: nothing to append

    @property
    def returned(self) -> bool:
        """Its append returned (or it had none): it can be acted on without waiting."""
        return self.append is None or self.append.done()


class Steps(Protocol):
    """One partition's coordinator, as its owner drives it (`worker.tier.partition.Partition`
    with the real one; the tests give stand-ins)."""

    async def claimed(self, caught: CaughtUp) -> None:
        """Told, right after each claim, what the partition's log held (to catch a local
        copy up, and act again on what the previous owner may not have acted on); awaited
        before the next batch is decided."""

    async def decide(self, batch: Sequence[Inbound]) -> Decided:
        """What the batch adds to the partition's log, and the inputs it defers."""

    async def act(self, batch: Sequence[Inbound]) -> None:
        """Act on the batch, whose records were appended."""

    async def snapshot(self) -> bytes:
        """The partition's state as a snapshot holds it, once every batch appended so far
        was acted on (see "Snapshots"); asked only with a `SnapshotPolicy`."""

    def released(self) -> None:
        """Told that the owner stopped owning the partition (handed over, fenced, its pin
        lost, or failed): nothing of the coordinator may act for it after."""


@dataclass(frozen=True, slots=True)
class SnapshotPolicy:
    """When an owner snapshots its partition (see "Snapshots")."""

    every_entries: int = 10_000
    every_s: float = 60.0


# How long an idle owner waits for inputs before its housekeeping (a vacant claim, `_forget`);
# a stop request ends the wait at once (`_woken_by`).
_FETCH_TIMEOUT_S = 0.25
_FETCH_BACKOFF_S = (0.1, 5.0)  # first and longest pause after a failed pull
# What an input adds to its batch's log entry beyond its own bytes, at most: its actions and
# its handoff's row. A batch is cut so that its inputs' bytes and this, each, stay within half
# the largest message the server takes, so that its entry can be appended; a rejected input's
# row keeps at most `worker.tier.planner.LOGGED_PAYLOAD_LIMIT` of its bytes, so that one alone fits.
_ROW_OVERHEAD = 1024
_VACANCY_POLL_S = 1.0  # how often an idle, unclaimed owner asks whether anyone is pinned
_FORGET_EVERY_S = 10.0  # how often the applied inputs are cut to the consumer's ack floor


def max_ack_pending(batch: int) -> int:
    """The partition consumer's max_ack_pending for owners that pull `batch` inputs at once: an
    owner holds up to two batches unacknowledged (one appending, the next being decided, see
    "Pipelining") and keeps two more requested ahead (its pull's `max_ahead`). With less, the
    server stops delivering while two batches are in hand, and the next fetch waits for acks."""
    return max(4 * batch, 1024)


def _held(batch: Sequence[Inbound], pull: Pull) -> dict[int, str]:
    """What an owner holds delivered and unacknowledged as it claims: the batch in hand and
    what its pull has delivered since (stream sequence: subject)."""
    return {inbound.stream_seq: inbound.subject for inbound in (*batch, *pull.ready)}


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, or less if `stop` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


@contextlib.asynccontextmanager
async def _woken_by(stop: asyncio.Event, pull: Pull) -> AsyncIterator[None]:
    """While inside: once `stop` is set, `pull`'s fetch returns at once, so that an idle owner
    stops now rather than at the end of its fetch's timeout."""

    def wake(waiter: asyncio.Future[Literal[True]]) -> None:
        if not waiter.cancelled():
            pull.wake()

    waiter = asyncio.ensure_future(stop.wait())
    waiter.add_done_callback(wake)
    try:
        yield
    finally:
        waiter.cancel()


class PartitionOwner:
    """One worker's hold on one partition (see the module docstring); `run` it."""

    def __init__(
        self,
        bus: Bus,
        stream: str,
        consumer: str,
        log: PartitionLog,
        steps: Steps,
        *,
        batch: int = 64,
        expires_s: float = 2.0,
        heartbeat_s: float = 0.5,
        claim_vacant_after_s: float | None = None,
        forget_every_s: float = _FORGET_EVERY_S,
        metrics: TierMetrics | None = None,
        snapshots: SnapshotPolicy | None = None,
    ) -> None:
        self._bus = bus
        self._steps = steps  # the partition's coordinator, which this owner drives
        self._snapshots = snapshots
        self._since_snapshot = 0  # entries appended since the last snapshot (or claim)
        self._snapshot_at = 0.0  # when the last one was written (monotonic)
        self._snapshot_due = False  # set by a claim: one follows it
        self._forget_every_s = forget_every_s
        self._claim_vacant_after_s = claim_vacant_after_s  # see "Vacant partitions"
        self._vacant_since: float | None = None  # since when nobody was seen pinned (monotonic)
        self._vacancy_checked = 0.0
        # The last delivery, claim or pin check while owning (monotonic): see "Lapsed pins".
        self._pin_checked = 0.0
        self._metrics = metrics
        self._stream = stream
        self._consumer = consumer
        self.log = log
        self._batch = batch
        self._expires_s = expires_s
        self._heartbeat_s = heartbeat_s
        # Inputs applied by any owner that the consumer may still deliver (see `_forget`).
        self._applied: set[int] = set()
        self._forgot_at = 0.0  # when `_applied` was last cut to the ack floor (monotonic)
        self._floor = 0  # the ack floor read then: the next cut goes no higher (see `_forget`)
        self._order: InputOrder[Inbound] | None = None  # after a claim, until the orphans are in
        self._resets_seen = 0  # the pull's reconnects whose orphans were read (see "Order")
        # Where this owner is (worker.tier.phase): what it may do next, and how it ended.
        self.phase = PartitionPhase(log.partition)
        # The server's token for the pin the claim holds for (see "Pins" in worker.tier.streams): a
        # batch under another one is claimed for anew. Not a generation: the log's epoch is.
        self._pin_id: str | None = None
        self._in_flight: _InFlight | None = None  # the batch whose append is on its way
        # What it did, for metrics and tests.
        self.claims = 0
        self.applied = 0  # inputs appended and acted on
        self.skipped = 0  # inputs an owner had applied already (redeliveries)
        self.orphans = 0  # inputs a previous owner left unacknowledged and unapplied
        self.acked = 0
        self.deferred = 0  # early inputs given back to come again (see `Decided`)
        self.refused_pulls = 0  # 423: another worker held the pin
        self.snapshots = 0  # written

    @property
    def fenced(self) -> bool:
        """It ended because another worker's claim refused one of its appends."""
        return self.phase.now is Phase.FENCED

    @property
    def handed_over(self) -> bool:
        """It ended with a clean hand-over."""
        return self.phase.now is Phase.HANDED_OVER

    @property
    def held(self) -> int:
        """Inputs delivered and held back behind an earlier input of their handoff."""
        return 0 if self._order is None else self._order.held

    async def run(self, stop: asyncio.Event) -> None:
        """Own the partition until another worker fences this one, or until `stop` is set:
        then the batch in hand is finished and the partition handed over (see "Hand-over").
        The steps' `claimed` is awaited after each claim, before the next batch is decided;
        `released` is called once this owner acts no more (it returned, fenced or handed
        over, or failed), so that nothing of the coordinator acts for the partition after."""
        try:
            await self._own(stop)
        finally:
            if not self.phase.now.ended:
                self.phase.move(Event.FAILED)  # an error it does not handle: its caller's
            self._drop_in_flight()
            self._steps.released()

    async def _own(self, stop: asyncio.Event) -> None:
        pull = Pull(
            self._bus,
            self._stream,
            self._consumer,
            max_ahead=2 * self._batch,
            expires_s=self._expires_s,
            heartbeat_s=self._heartbeat_s,
            group=PRIORITY_GROUP,
        )
        backoff_s = _FETCH_BACKOFF_S[0]
        async with pull, _woken_by(stop, pull):
            while not stop.is_set():
                try:
                    # With an append on its way, only what is ready now: else its return is
                    # what to wait for.
                    waiting_s = _FETCH_TIMEOUT_S if self._in_flight is None else 0.0
                    batch = await pull.fetch(
                        self._batch,
                        timeout_s=waiting_s,
                        max_bytes=self._bus.max_payload // 2,
                        overhead=_ROW_OVERHEAD,
                    )
                except PinMismatch:
                    self.refused_pulls += 1
                    self._vacant_since = None
                    if self.phase.now is Phase.OWNING_UNPINNED:
                        # Claimed while vacant, and another worker was pinned since: its claim
                        # fences this one, if it has not already. Act no more for it.
                        self.phase.move(Event.PIN_TAKEN)
                        logger.warning(
                            "partition %d: claimed while vacant, but another worker is pinned "
                            "to it now; %s stops acting for it",
                            self.log.partition,
                            self.log.owner,
                        )
                        return
                    continue  # the Pull asks to be pinned anew
                except BusError as exc:
                    # A consumer just made is not known to every node at once (503), a node
                    # restarts (409): the next fetch asks again, after a pause.
                    logger.warning("partition %d: %s; pulling again", self.log.partition, exc)
                    await _pause(stop, backoff_s)
                    backoff_s = min(2 * backoff_s, _FETCH_BACKOFF_S[1])
                    continue
                backoff_s = _FETCH_BACKOFF_S[0]
                try:
                    if not batch:
                        if self._in_flight is not None:
                            await self._finish()
                            continue
                        if self.phase.now is Phase.CLAIMING:
                            await self._claim_if_vacant()
                        elif self.phase.now is Phase.OWNING:
                            await self._check_pin(pull)
                        elif self.phase.now is Phase.OWNING_UNPINNED:
                            await self._check_claim(pull)
                        await self._snapshot_if_due()
                        await self._forget()
                        continue
                    self._pin_checked = monotonic_s()
                    if self.phase.now is Phase.OWNING_UNPINNED:
                        # A claim made while vacant holds under the first pin: a claim by
                        # whoever was pinned in between would fence this owner at its next
                        # append.
                        self.phase.move(Event.PINNED)
                        self._pin_id = pull.pin_id
                    if not self.phase.now.claimed or pull.pin_id != self._pin_id:
                        await self._finish()  # a claim comes after the batch in flight
                        self._resets_seen = pull.resets
                        await self._claim(pull.pin_id, held=partial(_held, batch, pull))
                    elif pull.resets != self._resets_seen:
                        await self._finish()  # what it settles is not an orphan
                        self._resets_seen = pull.resets
                        await self._reorder(partial(_held, batch, pull))
                    await self._handle(batch)
                    if self._snapshot_due_now():
                        await self._finish()
                        await self._snapshot_if_due()
                    await self._forget()
                except Fenced as exc:
                    self._fenced(exc)
                    return
                except BusError as exc:
                    self._drop_in_flight()  # its inputs too are left unacknowledged
                    # Whether the last append (or claim) landed is unknown: leave the batch
                    # unacknowledged, and claim anew, which reads the log and so learns it.
                    doubt = f"leaving {len(batch)} inputs unacknowledged, claiming anew"
                    logger.warning(
                        "partition %d: %s; %s",
                        self.log.partition,
                        exc,
                        doubt if batch else "claiming it later",
                    )
                    self.phase.move(Event.DOUBTED)
                    self.log = self.log.anew()
                    await _pause(stop, backoff_s)
            try:
                await self._finish()
            except Fenced as exc:
                self._fenced(exc)
                return
            except BusError as exc:
                logger.warning(
                    "partition %d: %s; its last batch comes back after the ack wait",
                    self.log.partition,
                    exc,
                )
                # Not handed over: the next claim reads what landed.
                self.phase.move(Event.DOUBTED)
            await self._hand_over(pull)

    async def _hand_over(self, pull: Pull) -> None:
        """Stopped, not fenced: give back what is in hand, then the pin, so that the next
        owner is pinned at once instead of after the priority timeout. What was delivered and
        not applied is nak'd (redelivered at once, and an orphan of the next owner's claim, so
        still in order); what was applied is acknowledged."""
        claimed = self.phase.now.claimed
        self.phase.move(Event.STOPPED)
        in_hand = {inbound.stream_seq: inbound for inbound in pull.take_ready()}
        if self._order is not None:
            in_hand.update((inbound.stream_seq, inbound) for inbound in self._order.take_held())
        try:
            await pull.close()  # deliveries from now on come back after the ack wait
            if not self._bus.is_connected:
                # Each step below would wait out its request timeout, and a stop is to be
                # prompt: what is in hand comes back after the ack wait, as after a crash.
                raise BusError("no connection to NATS")
            for seq, inbound in sorted(in_hand.items()):
                await (inbound.ack() if seq in self._applied else inbound.nak())
            if claimed:
                if self._since_snapshot:
                    await self._snapshot_handing_over()
                await self.log.hand_over()  # before the unpin: before the next claim
            await self._release_pin(pull.pin_id)
        except BusError as exc:
            logger.warning(
                "partition %d: hand-over incomplete (%s); the next owner waits for the "
                "priority timeout",
                self.log.partition,
                exc,
            )
            self.phase.move(Event.INCOMPLETE)
            return
        self.phase.move(Event.HANDED_OVER)
        if self._metrics is not None:
            self._metrics.handovers.inc()
        logger.info(
            "partition %d: handed over by %s (%d inputs given back)",
            self.log.partition,
            self.log.owner,
            len(in_hand),
        )

    async def _release_pin(self, pin_id: str | None) -> None:
        """Unpin, if the pin is its own: the server's unpin drops whoever holds the pin. An
        owner stopped while it waited for the pin (another worker's, whose pulls keep it), or
        whose pin lapsed while it stalled, would otherwise unpin the worker that owns the
        partition; that one would learn it only from a 423 on the next message, so if another
        worker is pinned by that message, claims, and hands over in turn, the owner goes on
        owning an idle partition on a claim the log has left behind, and the handoffs opened
        since are never timed out. Between the read and the unpin its own pin could lapse and
        another be given: after a priority timeout without its pulls, which a prompt stop
        does not wait out."""
        if pin_id is None:
            return
        if await pin_of(self._bus, self._stream, self._consumer, PRIORITY_GROUP) == pin_id:
            await unpin(self._bus, self._stream, self._consumer, PRIORITY_GROUP)

    async def _snapshot_handing_over(self) -> None:
        """The snapshot of a clean hand-over, which the next owner reads and no more. A local
        file that fails it (a full disk) costs the next owner the entries since the last one,
        not the hand-over: nothing was lost, the replicated log still holds them."""
        try:
            await self._write_snapshot()
        except StoreError as exc:
            logger.warning(
                "partition %d: no snapshot at the hand-over (%s); the next owner reads the "
                "entries since the last one",
                self.log.partition,
                exc,
            )

    async def _forget(self) -> None:
        """Drop from the applied inputs those at or below the consumer's ack floor, at most
        every `forget_every_s`: it never delivers them again, and the set would otherwise hold
        every input since the claim. What it may deliver again (a dead owner's applied inputs
        it did not acknowledge, an ack that was lost) stays above the floor.

        The cut goes up to the lower of the floor read now and the one read at the previous
        cut: a floor just read may count acks that the consumer's leader has not replicated
        yet, and if it dies, the next leader's floor is lower and it delivers those inputs
        again; a floor read an interval ago is one the replicas have. A floor that went down
        (a new leader) is taken as it is."""
        now = monotonic_s()
        if not self._applied or now - self._forgot_at < self._forget_every_s:
            return
        self._forgot_at = now
        try:
            floor = await ack_floor(self._bus, self._stream, self._consumer)
        except BusError as exc:
            logger.info("partition %d: %s; forgetting later", self.log.partition, exc)
            return
        cut, self._floor = min(self._floor, floor), floor
        self._applied = {seq for seq in self._applied if seq > cut}

    def _snapshot_due_now(self) -> bool:
        """A snapshot is due (see "Snapshots")."""
        if self._snapshots is None or not self.phase.now.claimed:
            return False
        if self._snapshot_due or self._since_snapshot >= self._snapshots.every_entries:
            return True
        elapsed_s = monotonic_s() - self._snapshot_at
        return self._since_snapshot > 0 and elapsed_s >= self._snapshots.every_s

    async def _snapshot_if_due(self) -> None:
        """Write a snapshot if one is due; nothing may be in flight."""
        if self._snapshot_due_now():
            await self._write_snapshot()

    async def _write_snapshot(self) -> None:
        if self._snapshots is None:
            return
        assert self._in_flight is None, "a snapshot sums up only what was acted on"
        records = await self._steps.snapshot()
        seq = await self.log.snapshot(sorted(self._applied), records)
        logger.info(
            "partition %d: snapshot at %d by %s (%d bytes of state, %d entries since the last)",
            self.log.partition,
            seq,
            self.log.owner,
            len(records),
            self._since_snapshot,
        )
        self.snapshots += 1
        self._since_snapshot, self._snapshot_due = 0, False
        self._snapshot_at = monotonic_s()
        if self._metrics is not None:
            self._metrics.snapshots.inc()
            self._metrics.snapshot_bytes.observe(len(records))

    @property
    def remembered(self) -> int:
        """How many applied inputs it remembers (to drop their redeliveries)."""
        return len(self._applied)

    async def _claim_if_vacant(self) -> None:
        """Claim the partition without a delivery once nobody was pinned to it for
        `claim_vacant_after_s` (see "Vacant partitions"); asks the server at most once a
        second."""
        now = monotonic_s()
        if self._claim_vacant_after_s is None or now - self._vacancy_checked < _VACANCY_POLL_S:
            return
        self._vacancy_checked = now
        if await pinned(self._bus, self._stream, self._consumer, PRIORITY_GROUP):
            self._vacant_since = None
            return
        if self._vacant_since is None:
            self._vacant_since = now
        if now - self._vacant_since >= self._claim_vacant_after_s:
            logger.info(
                "partition %d: nobody pinned to it for %.1fs; %s claims it without a delivery",
                self.log.partition,
                now - self._vacant_since,
                self.log.owner,
            )
            await self._claim(None, vacant=True)

    async def _check_pin(self, pull: Pull) -> None:
        """Go back to claiming if, idle under its pin for `claim_vacant_after_s`, the owner
        reads that the consumer names another pin or none (see "Lapsed pins")."""
        now = monotonic_s()
        if (
            self._claim_vacant_after_s is None
            or now - self._pin_checked < self._claim_vacant_after_s
        ):
            return
        self._pin_checked = now
        try:
            pin_id = await pin_of(self._bus, self._stream, self._consumer, PRIORITY_GROUP)
        except BusError as exc:
            logger.info("partition %d: %s; checking the pin later", self.log.partition, exc)
            return
        if pin_id == self._pin_id:
            return
        logger.warning(
            "partition %d: %s owns it under pin %s, but the consumer names %s; claiming anew",
            self.log.partition,
            self.log.owner,
            self._pin_id,
            "another pin" if pin_id else "none",
        )
        self.phase.move(Event.PIN_LOST)
        self._steps.released()  # another worker may apply its inputs: nothing acts on a stale claim
        pull.pin_id = None  # its pulls ask to be pinned anew, as after a 423
        # Nobody is pinned now: the vacancy counts from this read.
        self._vacant_since = None if pin_id else now
        self._vacancy_checked = now

    async def _reorder(self, held: Callable[[], Mapping[int, str]]) -> None:
        """After a reconnect: read the orphans it left, and hold the newer inputs of their
        handoffs behind them (see "Order")."""
        order = self._order

        def held_now() -> Mapping[int, str]:
            mine = dict(held())
            if order is not None:
                mine.update(order.held_subjects())
            return mine

        left = await unacknowledged(self._bus, self._stream, self._consumer, held_now)
        orphans = [(seq, subject) for seq, subject in left if seq not in self._applied]
        if not orphans:
            return
        logger.info(
            "partition %d: %d inputs delivered on a lost connection come again; holding their "
            "handoffs' newer inputs behind them",
            self.log.partition,
            len(orphans),
        )
        if order is None:
            self._order = InputOrder(orphans)
        else:
            order.add_orphans(orphans)
        self.orphans += len(orphans)

    async def _check_claim(self, pull: Pull) -> None:
        """Claim anew if, idle since a vacant claim for `claim_vacant_after_s`, the owner reads
        that another worker appended to the log since (see "Lapsed pins")."""
        now = monotonic_s()
        if (
            self._claim_vacant_after_s is None
            or now - self._pin_checked < self._claim_vacant_after_s
        ):
            return
        self._pin_checked = now
        try:
            if not await self.log.superseded():
                return
        except BusError as exc:
            logger.info("partition %d: %s; checking the claim later", self.log.partition, exc)
            return
        logger.warning(
            "partition %d: %s claimed it while vacant, but another worker appended to its log "
            "since; claiming anew",
            self.log.partition,
            self.log.owner,
        )
        self.phase.move(Event.DOUBTED)
        self._steps.released()  # another worker may apply its inputs: nothing acts on a stale claim
        pull.pin_id = None
        self._vacant_since = None
        self._vacancy_checked = now

    async def _claim(
        self,
        pin_id: str | None,
        held: Callable[[], Mapping[int, str]] | None = None,
        *,
        vacant: bool = False,
    ) -> None:
        """Claim the partition's log (`Fenced` if another worker owns it), learn what was
        applied, and what the previous owner left unapplied (see "Order"); `held`: what this
        owner holds delivered (see `Bus.unacknowledged`); `vacant`: claimed without a
        delivery, so under no pin yet (see "Vacant partitions")."""
        self.phase.move(Event.CLAIM_BEGAN)
        if self.log.epoch:
            # Claiming anew ends the claim before: its timers must not fire while the new one
            # is on its way, or a deadline fires again once the claim rearms it.
            self._steps.released()
            self.log = self.log.anew()  # pinned anew: someone may have owned it meanwhile
        began = monotonic_s()
        caught = await self.log.claim()
        self._applied = caught.applied
        self._pin_id = pin_id
        self._pin_checked = monotonic_s()
        self._since_snapshot, self._snapshot_due = 0, True
        # Only now, with the old owner fenced, is what it left for good.
        left = await unacknowledged(self._bus, self._stream, self._consumer, held)
        orphans = [(seq, subject) for seq, subject in left if seq not in self._applied]
        self._order = InputOrder(orphans) if orphans else None
        self.orphans += len(orphans)
        await self._steps.claimed(caught)
        self.phase.move(Event.CLAIMED_VACANT if vacant else Event.CLAIMED)
        self.claims += 1  # counted once the coordinator caught up: it serves the partition now
        if self._metrics is not None:
            self._metrics.claims.labels(self._claimed_after(caught)).inc()
            self._metrics.catch_up_seconds.observe(monotonic_s() - began)
            self._metrics.catch_up_entries.inc(caught.entries)

    def _claimed_after(self, caught: CaughtUp) -> str:
        """What the claim followed, for `TierMetrics.claims`."""
        if caught.previous_owner is None:
            return "nothing"
        if caught.previous_owner == self.log.owner:
            return "reclaim"
        return "handover" if caught.handed_over else "takeover"

    async def _handle(self, batch: list[Inbound]) -> None:
        """Steps 1-3 for one batch, and step 4 for the batch before it (see "Pipelining"):
        `Fenced` before acting if another worker owns the partition now."""
        if self._in_flight is not None and self._in_flight.returned:
            await self._finish()  # no wait: acted on before the next batch is decided
        # A stall past the ack wait (an append retried while a node dies) brings an input again
        # before its first delivery was handled: one batch may hold it twice. It is one input,
        # appended once; the latest delivery is the one to settle.
        batch = list({inbound.stream_seq: inbound for inbound in batch}.values())
        # The inputs of the batch in flight count as applied: if its append fails, the owner
        # claims anew, which learns from the log what was.
        fresh = [inbound for inbound in batch if inbound.stream_seq not in self._applied]
        settled = [inbound for inbound in batch if inbound.stream_seq in self._applied]
        self.skipped += len(settled)
        if settled:
            # Not acted on again: if their acts were lost, only `claimed` publishes them.
            logger.info(
                "partition %d: %d redelivered inputs are applied already (%d..%d), "
                "acknowledged without acting",
                self.log.partition,
                len(settled),
                settled[0].stream_seq,
                settled[-1].stream_seq,
            )
        if self._order is not None:
            # In order behind orphans: what the batch in flight defers is given back first.
            await self._finish()
            fresh = self._order.admit(fresh)  # the others are held, unacknowledged
            if self._order.done:
                self._order = None
        decided = await self._steps.decide(fresh) if fresh else Decided(b"")
        if decided.after_previous:
            await self._finish()
            decided = await self._steps.decide(fresh)
        later = decided.deferred
        deferred = [(i, later[i.stream_seq]) for i in fresh if i.stream_seq in later]
        fresh = [inbound for inbound in fresh if inbound.stream_seq not in later]
        await self._finish()  # the batch before: appended, acted on, settled
        append = None
        if fresh:
            inputs = [inbound.stream_seq for inbound in fresh]
            append = asyncio.ensure_future(self.log.append(inputs, decided.records))
            self._applied.update(inputs)
            self._since_snapshot += 1
        self._in_flight = _InFlight(settled, fresh, deferred, append)

    async def _finish(self) -> None:
        """Step 4 for the batch in flight, if any: once its append returned, act on it, then
        acknowledge what it appended and what it dropped, and give back what it deferred."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        fresh = in_flight.fresh
        if in_flight.append is not None:
            await self._act_after_append(in_flight.append, fresh)
        for inbound in (*in_flight.settled, *fresh):
            await inbound.ack()
        self.acked += len(in_flight.settled) + len(fresh)
        if in_flight.deferred:
            if self._order is not None:
                self._order.give_back(inbound.stream_seq for inbound, _ in in_flight.deferred)
            for inbound, delay_s in in_flight.deferred:
                await inbound.nak(delay_s)
            self.deferred += len(in_flight.deferred)

    async def _act_after_append(self, append: asyncio.Future[int], fresh: list[Inbound]) -> None:
        """Append before acting (step 4's first half): act on `fresh` only once `append`, the
        append of their records, returned; `Fenced` if another worker's claim refused it, and
        nothing is acted on."""
        await append  # `Fenced`: another worker owns it; nothing is acted on
        self.applied += len(fresh)
        try:
            await self._steps.act(fresh)
        except BusError as exc:
            raise BusError(
                f"inputs {fresh[0].stream_seq}..{fresh[-1].stream_seq} are appended "
                f"(applied), but acting on them failed ({exc}); claimed must act on them "
                "again"
            ) from exc

    def _drop_in_flight(self) -> None:
        """Forget the batch in flight, unsettled (its inputs come back after the ack wait): its
        append's outcome, whatever it is, is read from the log by the next claim."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and in_flight.append is not None:
            append = in_flight.append
            if append.done():
                if not append.cancelled():
                    append.exception()  # read, so that asyncio does not report it unread
            else:
                append.cancel()

    def _fenced(self, exc: Fenced) -> None:
        self.phase.move(Event.FENCED)
        if self._metrics is not None:
            self._metrics.fenced.inc()
        logger.warning(
            "partition %d: %s; another worker owns it now, %s stops acting for it "
            "(applied %d inputs, acknowledged %d)",
            self.log.partition,
            exc,
            self.log.owner,
            self.applied,
            self.acked,
        )
