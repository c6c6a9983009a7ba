"""One partition of this worker, with the real coordinator: its planner, its local file, its
timers and its outbox, and the steps its owner drives.

Theory of operation. `worker.tier.service.Worker` makes one `Partition` per partition number
the tier gives it an owner for, the first time, and keeps it until the worker stops (its file
stays open, under its `WriterLock`, from its first claim on). Each
`worker.tier.owner.PartitionOwner` that owns the partition drives it through these steps (see
worker.tier.owner for when, and worker.tier.phase for the owner's phases):

    claimed    the partition's replicated log was read (`CaughtUp`): open the file the first
               time, commit to it the `Appended` entries it lacks (a new owner on another
               machine starts from an empty file), rebuild the planner from the file, publish
               its backlog. From now on the partition serves the claim's epoch;
    decide     decode and plan the batch, loading from the local file the handoffs not in
               memory; return the plan's rows (`LoggedRows`) for the owner to append;
    act        after the append: arm the plan's timers, queue the same rows for the local
               file, then publish the plan's actions (`publish_action`) and rejections,
               without waiting for the local commit;
    snapshot   the partition's live state as a snapshot of its log holds it (`LoggedState`):
               its file once every queued commit ended, and the tombstones of late;
    released   the owner stopped (handed over, fenced, or failed): drop the timers and memory;
               the partition serves no epoch until the next claim.

The epoch. Each claim of the partition's log counts up one number, the owner's generation, which
the log's entries and this whole tier call `epoch` (worker.tier.entries): `epoch` here is that
of the claim this partition serves, None while it serves none. A lot of actions is published
again (see "Outbox") only while the partition serves the epoch it was published in; the owner's
pin id is the server's token for its pin, not a generation (worker.tier.owner).

Invariants.
- The replicated log is the authority; the local file is a prefix of it. Each local commit of
  an entry carries, in the file's meta table and in the same transaction, the entry's mark (the
  stream sequence of its first input: an input is applied once, so it names one entry). A
  catch-up applies the entries after the marked one, in log order, in one transaction. A mark
  that the log no longer holds means every entry left is newer.
- Nothing is published before its rows are in the replicated log (the owner appends between
  `decide` and `act`). The local commit is queued (`EventLog.queue`) and not waited for: the
  publishes, the acks and the next batch's `decide` and append go on while the file's writer
  commits, so a batch's critical path holds one store, the append. The file trails by a bounded
  amount: with more than `COMMITS_AHEAD` commits queued, the next `decide` waits for the oldest
  (a file slower than the front would otherwise have every queued row held in memory). The file
  stays a prefix: its commits run in order, one writer, and once one fails every one queued
  behind it fails unwritten (the next `decide` raises the failure, the owner stops, and its next
  claim catches the file up). A crash before a local commit loses nothing either: the claim
  after it catches the file up the same way, and republishes what the file does not mark
  published.
- The file is read only for handoffs not in memory. A handoff a queued batch completed has left
  memory before that batch's local commit, so `decide` waits for the queued commits before it
  reads one; any other handoff not in memory is in no queued batch, so its read may overtake
  them. A claim waits for every queued commit before it reads the file's mark.
- A plan that was decided but not acted on (the append was fenced or in doubt) leaves the
  planner ahead of the file: every claim rebuilds it from the file, after the catch-up.

Outbox. Marks ("published") ride in the rows of the partition's next batch after the server
confirmed them, in publication order, so they are in the replicated log too. Actions whose
barrier failed (NATS lost the connection they were written to) are published again, with a
growing pause, until a barrier confirms them or the partition is released; the marks behind
them wait, since a mark says that every earlier action of its handoff was published. Without
this, an action that no timer retries (`Complete`: nothing answers it) would wait for the
partition's next claim. A claim publishes what the file does not mark published (at most the
last batches' actions of the previous owner, which may have died between its append and its
publishes, or handed over before its marks rode on a batch), and every action still
outstanding: at least once, with the same action ids. Rejections have no marks of their own
(a rejected start has no row to hold one): each entry names instead the newest entry of its
owner whose lot the server confirmed, with every lot before it (`LoggedRows.confirmed`), and a
claim publishes again the rejections of the log's entries after the newest one named.

Timers. The partition's `worker.tier.timers.HandoffTimers` run over its planner: a deadline
publishes `TimedOut` to the handoff's input subject (so it is appended and logged like any
other input), an action without an outcome is published again with the same action id after a
growing backoff. They are armed from a plan only in `act` (what was not appended does not
count), rearmed from the file at each claim (so the new owner of a dead worker's partition
times out its handoffs, a partition with no input included: see "Vacant partitions" in
worker.tier.owner), and dropped at release. What a worker that was fenced published before it
learnt so (at its next append) is harmless: a republished action is answered by action id like
any other, and a second `TimedOut` of a handoff is an exact duplicate of the first, dropped by
its digest (counted in `kvhandoff_duplicate_inputs_total`).

The pipeline: decide batch k+1 while batch k is being appended, then act on k and acknowledge
it, then append k+1 (see "Pipelining" in worker.tier.owner), while the local commits run
behind. What overlaps, and why it is safe: deciding k+1 only changes memory, which a failed or
fenced append of k leaves ahead of the file (every claim rebuilds it, as above); `decide` keeps
the plans in order until their `act`, and answers `after_previous` rather than read from the
file a handoff that a plan not yet acted on took out of memory (its rows are in no file yet,
nor queued). The local commits of batches k, k+1, ... run while later batches are decided and
appended, because the file is only a cache of the replicated log (see the invariants); the
append of batch k+1 never overtakes k's, since an owner appends one batch at a time, by
compare-and-set on the previous one's sequence. Partitions are independent throughout: one
owner each, one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from uuid import UUID

import msgspec

from kvhandoff.events.codec import encode
from kvhandoff.events.errors import ReplayDivergence
from kvhandoff.events.messages import Action, Complete, Rejection
from kvhandoff.events.subjects import Subjects, partition_prefix
from kvhandoff.worker.ambient import monotonic_s, now_ms, wall_s
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Inbound
from kvhandoff.worker.config import WorkerConfig
from kvhandoff.worker.errors import BusError, LogDiverges, StoreCorrupt, StoreError
from kvhandoff.worker.log.rows import Batch, CorruptHandoff, HandoffLog, HandoffRow, Tombstone
from kvhandoff.worker.log.schema import QUARANTINE_PREFIX, HandoffState
from kvhandoff.worker.log.store import Committed, EventLog, WriterLock
from kvhandoff.worker.stoppable import cancel_until_done
from kvhandoff.worker.tier.entries import (
    LOG_VERSION,
    MARK_KEY,
    LoggedRows,
    LoggedState,
    decode_rows,
    decode_state,
    encode_entry,
)
from kvhandoff.worker.tier.leases import EngineLeases
from kvhandoff.worker.tier.metrics import Metrics
from kvhandoff.worker.tier.owner import Decided
from kvhandoff.worker.tier.ownership import CaughtUp
from kvhandoff.worker.tier.planner import Plan, Planner, rejection_for
from kvhandoff.worker.tier.timers import HandoffTimers

logger = logging.getLogger(__name__)

# First and longest pause before publishing again what a failed barrier covered.
_RESEND_PAUSE_S = (0.1, 2.0)

# Local commits a partition may have queued and not ended before its next batch is decided:
# the file trails the replicated log, by a bounded amount. Unbounded, a drain faster than the
# file's commits grew the worker by 3.7 KB a handoff (the queued rows) until it stalled.
COMMITS_AHEAD = 8


@dataclass(frozen=True, slots=True)
class _Canonical:
    """A delivery as the planner reads it: under its handoff's input subject, not the
    partition-qualified one the stream's transform stored it under."""

    data: bytes
    subject: str
    stream_seq: int
    deliveries: int


@dataclass
class _Sent:
    """Actions (and rejections) published together, the barrier that confirms them, and when
    they were published (both replaced when the barrier failed and they were published again).
    A seq of -1 is an action the file already marks."""

    actions: list[tuple[HandoffRow, int, Action]]
    barrier: asyncio.Future[None]
    at_ms: int
    rejections: list[Rejection]
    entry: int | None  # the mark of the entry whose rows these are; None: a claim's, a retry's

    def marks(self) -> list[tuple[UUID, int, int]]:
        return [(action.handoff_id, seq, self.at_ms) for _, seq, action in self.actions if seq >= 0]


@dataclass
class _File:
    """The partition's local file, open from its first claim until the worker stops, and the
    timers' task, which runs as long."""

    log: EventLog
    lock: WriterLock | None  # None: the worker's caller holds it
    timers_task: asyncio.Task[None]


async def publish_action(
    bus: Bus, subjects: Subjects, row: HandoffRow, action: Action
) -> asyncio.Future[int] | None:
    """Publish an action to its engine's subject. A `Complete` is also stored by the completion
    stream (and still seen by core subscribers), so a frontend that was reconnecting can read it
    afterwards: its ack is returned (see `Bus.confirm`)."""
    subject = subjects.action(action, row.source, row.destination)
    if isinstance(action, Complete):
        return await bus.publish_stored(subject, encode(action))
    await bus.publish(subject, encode(action))
    return None


class Partition:
    """One partition's coordinator state and the steps its owner drives (module docstring)."""

    def __init__(
        self,
        number: int,
        config: WorkerConfig,
        bus: Bus,
        metrics: Metrics,
        leases: EngineLeases,
        *,
        count_in_memory: Callable[[], None],
    ) -> None:
        self.number = number
        self._config = config
        self._bus = bus
        self._metrics = metrics
        self._subjects = Subjects(config.nats.subject_prefix)
        self._leases = leases
        self._count_in_memory = count_in_memory  # the worker's gauges, over its partitions
        # Its inputs' subjects, `<prefix>.inp.<p>.<id>`, less the handoff id.
        self._inputs_of = partition_prefix(config.nats.subject_prefix, number)
        self.planner = Planner(
            self._subjects,
            config.tier.batch_size,
            config.tier.ack_wait_s,
            tombstone_ttl_ms=int(config.tombstone_ttl_s * 1000),
        )
        self.planner.admit = leases.admit
        self.timers = HandoffTimers(
            self.planner,
            bus,
            self._subjects,
            metrics,
            retry_interval_s=config.retry_interval_s,
            republish=self._republish,
        )
        self._file: _File | None = None  # opened at the first claim
        # The epoch of the claim it serves (module docstring); None: it serves none.
        self.epoch: int | None = None
        # Plans and their rows, in order, awaiting their append and `act`, with the inputs they
        # apply: the owner decides a batch while the one before it is being appended.
        self.decided: deque[tuple[list[int], Plan, LoggedRows]] = deque()
        # Actions published, in order, each lot with the barrier that confirms it.
        self._published: list[_Sent] = []
        # The mark of the newest entry whose lot the server confirmed, with every lot before it
        # (`LoggedRows.confirmed`).
        self._confirmed_through: int | None = None
        # Local commits queued and not seen to end, in order, each with the handoffs its plan
        # took out of memory: those are not to be read from the file before it committed.
        self.committing: deque[tuple[asyncio.Future[Committed], frozenset[UUID]]] = deque()
        # See `_publish_again`. A dict, not a set: they are cancelled in the order made, not in
        # their addresses'.
        self._resends: dict[asyncio.Task[None], None] = {}
        self._last_commit_failure: BaseException | None = None  # counted once per group

    @property
    def opened(self) -> bool:
        """Its file is open: it was claimed once since the worker started."""
        return self._file is not None

    @property
    def log(self) -> EventLog:
        """Its local file; `StoreError` if it was never claimed, so never opened."""
        if self._file is None:
            raise StoreError(f"partition {self.number}: its file is opened at its first claim")
        return self._file.log

    # --- The owner's steps --------------------------------------------------------------

    async def claimed(self, caught: CaughtUp) -> None:
        """Catch the local file up from the replicated log, rebuild the planner from it, and
        publish what the file does not mark published, and every outstanding action."""
        began = monotonic_s()
        log = await self._open()
        self.decided.clear()
        self.epoch = caught.epoch
        # The file's mark must be the last of what it will hold. A local commit that failed
        # left the file behind the replicated log; the catch-up below repairs that.
        with contextlib.suppress(StoreError):
            await self._all_committed()
        await log.resume()
        entries = []
        for index, record in enumerate(caught.records):
            try:
                entries.append(
                    decode_rows(record, f"partition {self.number}: entry {index} of its log's tail")
                )
            except msgspec.DecodeError as exc:
                raise StoreCorrupt(
                    f"partition {self.number}: entry {index} of its replicated log is not a "
                    f"batch of rows ({exc}); refusing to catch {log.path} up from it"
                ) from exc
        mark = await log.meta(MARK_KEY)
        marked = [i for i, entry in enumerate(entries) if entry.inputs[:1] == [_int(mark)]]
        missing = entries[marked[-1] + 1 :] if marked else entries
        catch_up = Batch()
        state = None if caught.snapshot is None else self._logged_state(caught.snapshot)
        # A file whose last entry is not after the snapshot holds what the snapshot sums up if
        # its mark is the snapshot's, and otherwise takes the snapshot's state.
        if not marked and state is not None and (mark is None or state.mark != int(mark)):
            catch_up.merge = state.live_state()
            if state.mark is not None:
                catch_up.meta[MARK_KEY] = str(state.mark)
        for entry in missing:
            entry.add_to(catch_up)
        # Marks of this worker's earlier claim; those not confirmed yet are republished.
        for handoff_id, seq, at_ms in self._confirmed():
            catch_up.mark_published(handoff_id, seq, at_ms)
        self._published.clear()
        self._confirmed_through = None
        if catch_up:
            try:
                await log.commit(catch_up)
            except StoreError:
                self._metrics.commit_failures.inc()  # e.g. a full disk, at each claim
                raise
        await self._rebuild(await self._tombstones(state, entries))
        self._leases.sweep(self.planner.open.values())
        if unconfirmed := _unconfirmed_rejections(entries):
            logger.info(
                "partition %d: publishing again %d rejections of its log's last entries, which "
                "the server never confirmed",
                self.number,
                len(unconfirmed),
            )
            await self._publish([], unconfirmed)
        elapsed = monotonic_s() - began
        logger.info(
            "partition %d: caught %s up with %s%d of %d entries (mark %s) and recovered %d open "
            "handoffs in %.3fs",
            self.number,
            log.path,
            "a snapshot and " if catch_up.merge else "",
            len(missing),
            len(entries),
            mark,
            len(self.planner.open),
            elapsed,
        )

    async def decide(self, batch: Sequence[Inbound]) -> Decided:
        """Plan the batch against the partition's handoffs: the rows to append, and the early
        inputs deferred."""
        deliveries = [self._canonical(inbound) for inbound in batch]
        planner = self.planner
        decoded = planner.decode(deliveries)
        missing = planner.missing(decoded)
        if missing and self.decided:
            # A handoff that a plan still awaiting its `act` took out of memory is in no file
            # yet, nor queued for one: that plan must be acted on first.
            leaving = {h for _, plan, _ in self.decided for h in plan.left_memory}
            if not leaving.isdisjoint(missing):
                return Decided(b"", after_previous=True)
        # Before anything is planned: a handoff a queued commit took out of memory is read only
        # once the file holds it (and a failed commit raises here).
        if any(not evicted.isdisjoint(missing) for _, evicted in self.committing):
            await self._all_committed()
        else:
            await self._keep_up()
        loaded = await self.log.load(missing) if missing else {}
        plan = planner.plan(deliveries, decoded, loaded, now_ms(), wall_s())
        deferred = {batch[index].stream_seq: delay_s for index, delay_s in plan.naks}
        if deferred:
            self._metrics.deferred.inc(len(deferred))
        inputs = [inbound.stream_seq for inbound in batch if inbound.stream_seq not in deferred]
        if not inputs:
            # Early inputs only: nothing to append or act on; the marks wait for the next batch.
            return Decided(b"", deferred)
        marks = self._confirmed()  # first: it moves `_confirmed_through` on
        rows = LoggedRows.of(inputs, plan.batch, marks, plan.ended, self._confirmed_through)
        self.decided.append((inputs, plan, rows))
        return Decided(encode_entry(rows), deferred)

    async def act(self, batch: Sequence[Inbound]) -> None:
        """Commit the appended rows locally, then publish what they say."""
        inputs = [inbound.stream_seq for inbound in batch]
        if not self.decided or self.decided[0][0] != inputs:
            raise StoreError(
                f"partition {self.number}: asked to act on inputs {inputs[:3]}... that were "
                "not the next decided; the next claim catches the file up"
            )
        _, plan, rows = self.decided.popleft()
        # Only now, with the plan in the replicated log, are its timers this partition's.
        self.timers.arm(plan)
        rows_batch = Batch()
        rows.add_to(rows_batch)
        committed = self.log.queue(rows_batch)
        committed.add_done_callback(self._observe_commit)
        self.committing.append((committed, frozenset(plan.left_memory)))
        # The rejections behind the same barrier: a frontend waits on a rejected start's.
        rejections = [rejection for _, rejection in plan.rejections]
        await self._publish(plan.publish, rejections, entry=inputs[0])
        m = self._metrics
        Metrics.count(m.inputs, plan.inputs.items())
        Metrics.count(m.actions, plan.issued.items())
        Metrics.count(m.rejections, plan.reasons.items())
        for _, _, action in plan.publish:
            if isinstance(action, Complete):
                m.completed.labels(action.completion.value).inc()
        if plan.duplicates:
            m.duplicates.inc(plan.duplicates)
        m.batch_size.observe(len(batch))
        self._count_in_memory()  # a handoff whose log would not load is quarantined in a plan

    async def snapshot(self) -> bytes:
        """The partition's live state as its next snapshot holds it (`LoggedState`): its file
        once every queued commit ended (every appended batch was acted on: see
        worker.tier.owner), and the tombstones of the handoffs that ended lately."""
        await self._all_committed()
        state = await self.log.live_state()
        mark = _int(await self.log.meta(MARK_KEY))
        tombstones = list(self.planner.tombstones.values())
        return encode_entry(
            LoggedState(
                mark, state.handoffs, state.marks, state.events, tombstones, version=LOG_VERSION
            )
        )

    def released(self) -> None:
        """The partition's owner stopped (handed over, fenced or failed): this worker times
        out and republishes nothing of it any more. Its memory is stale from now on (another
        worker may apply its inputs), so it is dropped too; the next claim rebuilds it."""
        if self._file is None:
            return  # never claimed
        self.timers.clear()
        self.planner.open.clear()
        self.planner.quarantined = set()  # read from the file again at the next claim
        self.planner.tombstones = {}
        self.decided.clear()
        # What it published and is not confirmed is the next owner's to publish.
        self.epoch = None
        self._count_in_memory()
        logger.info("partition %d: released; its timers are dropped", self.number)

    def stop_publishing_again(self) -> None:
        """The worker stops: cancel the publishing again of lots whose barrier failed (the
        next owner publishes what the file does not mark)."""
        for resend in self._resends:
            resend.cancel()

    async def close(self) -> None:
        """The worker stops, and has stopped publishing again (`stop_publishing_again`): stop
        the timers, commit the confirmed marks, and close the file, releasing its lock."""
        if self._file is None:
            return
        await cancel_until_done(self._file.timers_task)
        with contextlib.suppress(StoreError):
            await self._all_committed()
            await self._settle_marks()
        await self._file.log.close()
        if self._file.lock is not None:
            self._file.lock.release()
        self._file = None

    # --- The file -----------------------------------------------------------------------

    async def _open(self) -> EventLog:
        """Its file, opened (under its writer lock) the first time, with the timers' task."""
        if self._file is not None:
            return self._file.log
        path = self._config.partition_file(self.number)
        # A file that `run` locked before anything else is not locked twice.
        lock = None if path == self._config.locked_path else WriterLock.acquire(path)
        try:
            # A file of layout 1 (an earlier version's single worker's log) is migrated: this
            # worker holds its writer lock. Its history is in no replicated log: until its
            # open handoffs end, only this machine's file can rebuild them.
            log = await EventLog.open(path, self._config.synchronous, migrate=True)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        task = asyncio.create_task(self.timers.run(), name=f"kvhandoff-timers-{self.number}")
        self._file = _File(log, lock, task)
        return log

    async def _keep_up(self) -> None:
        """Wait while more than `COMMITS_AHEAD` local commits are queued, the oldest first,
        then forget those that ended; the `StoreError` of one that failed."""
        while len(self.committing) > COMMITS_AHEAD:
            await asyncio.wait([self.committing[0][0]])
            self._forget_committed()
        self._forget_committed()

    def _forget_committed(self) -> None:
        """Forget the queued local commits that ended; the `StoreError` of one that failed."""
        while self.committing and self.committing[0][0].done():
            self.committing.popleft()[0].result()

    async def _all_committed(self) -> None:
        """Wait for every queued local commit; the `StoreError` of the first that failed."""
        failure: StoreError | None = None
        while self.committing:
            try:
                await self.committing.popleft()[0]
            except StoreError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def _observe_commit(self, committed: asyncio.Future[Committed]) -> None:
        """Count a local commit that ended: its group's time, or its group's failure (each
        batch of a failed group carries the group's one error)."""
        if committed.cancelled():
            return
        failure = committed.exception()
        if failure is None:
            if committed.result().leads:
                self._metrics.commit_seconds.observe(committed.result().seconds)
        elif failure is not self._last_commit_failure:
            self._last_commit_failure = failure
            self._metrics.commit_failures.inc()

    def _logged_state(self, records: bytes) -> LoggedState:
        try:
            return decode_state(
                records, f"partition {self.number}: the snapshot its log starts with"
            )
        except msgspec.DecodeError as exc:
            raise StoreCorrupt(
                f"partition {self.number}: the snapshot its replicated log starts with is not "
                f"a partition's state ({exc}); refusing to catch the local file up from it"
            ) from exc

    async def _tombstones(
        self, state: LoggedState | None, entries: list[LoggedRows]
    ) -> dict[UUID, Tombstone]:
        """The tombstones a claim starts with, oldest first, cut to --tombstone-ttl: the
        snapshot's, and those the entries after it carry (`LoggedRows.ended`). Without a
        snapshot (a log from before them), those the file got from snapshots and those of every
        handoff whose rows it holds that ended within the TTL, read with their events."""
        since_ms = now_ms() - int(self._config.tombstone_ttl_s * 1000)
        if state is not None:
            tombstones = [*state.tombstones, *(t for e in entries for t in e.ended)]
            known = {t.handoff_id for t in tombstones}
            # Entries written before they carried their tombstones: read those rows.
            ended = {
                row.handoff_id
                for e in entries
                for row in e.handoffs
                if _ended(row) and row.handoff_id not in known
            }
        else:
            tombstones = await self.log.tombstones(since_ms)
            ended = set(await self.log.ended_since(since_ms))
        for loaded in (await self.log.load(ended)).values():
            if isinstance(loaded, HandoffLog) and _ended(row := loaded.handoff):
                digests = sorted({e.digest for e in loaded.events if e.digest is not None})
                ended_ms = row.completed_at_ms or row.updated_at_ms
                tombstones.append(Tombstone(row.handoff_id, row.state_name, ended_ms, digests))
        tombstones.sort(key=lambda tombstone: tombstone.completed_at_ms)
        return {t.handoff_id: t for t in tombstones if t.completed_at_ms >= since_ms}

    async def _rebuild(self, tombstones: dict[UUID, Tombstone]) -> None:
        """Replace the planner's memory with the file's open handoffs and their timers;
        publish the backlog."""
        planner, log = self.planner, self.log
        planner.open.clear()
        planner.deferred.clear()
        planner.quarantined = await log.quarantined()
        planner.tombstones = tombstones
        quarantines = Batch()
        loaded = await log.open_handoffs()
        try:
            adopted = planner.adopt(loaded.values(), quarantines, now_ms(), diverging=True)
        except ReplayDivergence as exc:
            raise LogDiverges(
                f"partition {self.number}: {exc}; this build's coordinator does not re-derive "
                f"the log of an open handoff in {log.path}. Run `kvhandoff verify` on the "
                "data directory, and run the build that wrote it"
            ) from exc
        self.timers.rearm(adopted)  # before the backlog's publishes, which count as attempts
        backlog: dict[tuple[UUID, int], tuple[HandoffRow, int, Action]] = {}
        for unpublished in await log.unpublished_actions():
            if isinstance(unpublished, CorruptHandoff):
                planner.quarantine(
                    quarantines, now_ms(), unpublished.handoff_id, unpublished.reason
                )
                continue
            action = unpublished.record.action
            key = (action.handoff_id, action.action_id)
            backlog[key] = (unpublished.row, unpublished.seq, action)
        for handoff in planner.open.values():
            for action in handoff.coordinator.outstanding():
                key = (action.handoff_id, action.action_id)
                backlog.setdefault(key, (handoff.row, -1, action))
        if quarantines:
            await log.commit(quarantines)
        await self._publish(list(backlog.values()))  # marked with the next batch
        self._metrics.recovered.set(len(loaded))
        self._count_in_memory()

    # --- The outbox ---------------------------------------------------------------------

    async def _publish(
        self,
        actions: list[tuple[HandoffRow, int, Action]],
        rejections: Sequence[Rejection] = (),
        *,
        entry: int | None = None,
    ) -> None:
        """Publish actions and rejections; the actions' marks wait for the server's barrier,
        and all are published again if it fails, or if publishing fails (`_publish_again`). A
        seq of -1 is an action the file already marks (republished, not marked again)."""
        if not actions and not rejections:
            return
        barrier: asyncio.Future[None]
        try:
            barrier = await self._send(actions, rejections)
        except BusError as exc:  # NATS is out of reach: as good as a failed barrier
            barrier = asyncio.get_running_loop().create_future()
            barrier.set_exception(exc)
        sent = _Sent(actions, barrier, now_ms(), list(rejections), entry)
        self._published.append(sent)
        barrier.add_done_callback(partial(self._barrier_done, self.epoch, sent))

    async def _send(
        self, actions: list[tuple[HandoffRow, int, Action]], rejections: Sequence[Rejection]
    ) -> asyncio.Future[None]:
        """Publish the actions and rejections; the barrier that confirms them, whatever the
        other partitions publish and flush meanwhile on the same bus (see "The barrier" in
        worker.bus.publish)."""
        connection = self._bus.connection
        stored = []
        for row, _, action in actions:
            ack = await publish_action(self._bus, self._subjects, row, action)
            if ack is not None:
                stored.append(ack)
            self.timers.sent(action)
            self._leases.sent(self.planner.open.get(action.handoff_id), action)
        for rejection in rejections:
            await self._bus.publish(
                self._subjects.rejected(rejection.handoff_id), encode(rejection)
            )
        return asyncio.ensure_future(self._bus.confirm(connection, stored))

    def _barrier_done(self, epoch: int | None, sent: _Sent, barrier: asyncio.Future[None]) -> None:
        if not barrier.cancelled() and barrier.exception() is None:
            return
        # Published again only in the epoch it was published in: released since, or
        # claimed anew, the claim publishes it (what the file does not mark published).
        if epoch is None or self.epoch != epoch or sent.barrier is not barrier:
            return  # released or claimed anew since, or published again
        resend = asyncio.create_task(self._publish_again(epoch, sent))
        self._resends[resend] = None
        resend.add_done_callback(self._forget_resend)

    def _forget_resend(self, resend: asyncio.Task[None]) -> None:
        self._resends.pop(resend, None)

    async def _publish_again(self, epoch: int, sent: _Sent) -> None:
        """The barrier behind `sent` failed: the server may never have read its actions. Publish
        them again (at least once, with the same action ids), pausing longer after each
        failure, until a new barrier confirms them or the partition is released."""
        error = "" if sent.barrier.cancelled() else f" ({sent.barrier.exception()})"
        logger.warning(
            "partition %d: %d actions and %d rejections were published on a connection that "
            "NATS lost%s; publishing them again",
            self.number,
            len(sent.actions),
            len(sent.rejections),
            error,
        )
        pause_s = _RESEND_PAUSE_S[0]
        while self.epoch == epoch:
            await asyncio.sleep(pause_s)  # let the connection come back first
            if self.epoch != epoch:
                return
            try:
                barrier = await self._send(sent.actions, sent.rejections)
            except BusError as exc:
                logger.warning("partition %d: publishing again failed: %s", self.number, exc)
                pause_s = min(2 * pause_s, _RESEND_PAUSE_S[1])
                continue
            sent.at_ms = now_ms()
            sent.barrier = barrier
            sent.barrier.add_done_callback(partial(self._barrier_done, epoch, sent))
            return

    async def _republish(self, row: HandoffRow, action: Action) -> None:
        """A retry: publish the action again (its first publication carries its mark)."""
        await self._publish([(row, -1, action)])

    def _confirmed(self) -> list[tuple[UUID, int, int]]:
        """Take the outbox marks the server has confirmed, in publication order, up to the
        first lot not confirmed: one whose barrier failed is being published again
        (`_publish_again`), and a later mark of its handoff would say it was published."""
        confirmed: list[tuple[UUID, int, int]] = []
        while self._published and self._published[0].barrier.done():
            barrier = self._published[0].barrier
            if barrier.cancelled() or barrier.exception() is not None:
                break
            sent = self._published.pop(0)
            confirmed.extend(sent.marks())
            if sent.entry is not None:
                self._confirmed_through = sent.entry
        return confirmed

    async def _settle_marks(self) -> None:
        """Stopping: wait for the barriers, and commit what they confirm to the local file
        (the next owner republishes those actions: the replicated log does not mark them)."""
        for sent in self._published:
            with contextlib.suppress(BusError, asyncio.CancelledError):
                await sent.barrier
        batch = Batch()
        for handoff_id, seq, at_ms in self._confirmed():
            batch.mark_published(handoff_id, seq, at_ms)
        if batch:
            await self.log.commit(batch)

    def _canonical(self, inbound: Inbound) -> _Canonical:
        """`<prefix>.inp.<p>.<id>` read as `<prefix>.in.<id>`."""
        handoff = inbound.subject.removeprefix(self._inputs_of)
        subject = f"{self._config.nats.subject_prefix}.in.{handoff}"
        return _Canonical(inbound.data, subject, inbound.stream_seq, inbound.deliveries)


def _ended(row: HandoffRow) -> bool:
    """The handoff succeeded or was canceled: it has a tombstone."""
    return row.state in (HandoffState.SUCCEEDED, HandoffState.CANCELED)


def _int(mark: str | None) -> int | None:
    return None if mark is None else int(mark)


def _unconfirmed_rejections(entries: Sequence[LoggedRows]) -> list[Rejection]:
    """The rejections of the entries after the newest one that an entry names as confirmed
    (`LoggedRows.confirmed`): its owner may have died, or handed the partition over, before the
    server read them, and a frontend waits on a rejected start's. A quarantine's rejection row
    was never published (it is the file's note), so it is not now either."""
    position = {rows.inputs[0]: index for index, rows in enumerate(entries) if rows.inputs}
    confirmed = max(
        (position.get(rows.confirmed, -1) for rows in entries if rows.confirmed is not None),
        default=-1,
    )
    return [
        rejection_for(None if handoff_id is None else UUID(handoff_id), reason, payload)
        for rows in entries[confirmed + 1 :]
        for _, handoff_id, reason, payload in rows.rejections
        if not reason.startswith(QUARANTINE_PREFIX)
    ]
