"""One worker's part in the tier: it announces itself, and owns the partitions of its share.

Theory of operation. A `Tier` announces its worker in the membership bucket (see "Membership" in
worker.tier.members) and keeps the announcement alive. Every `rebalance_s` it lists the live workers
and applies the balance rule (`worker.tier.balance.rebalance`): for each partition of its share that
it does not run it starts a `worker.tier.owner.PartitionOwner`, and each one it runs outside its
share it stops, which hands the partition over (finish the batch, nak what is in hand, unpin). An
owner that was fenced ends by itself; the tier forgets it, and takes the partition up again at the
next round if it is still in its share (its pull then waits while another worker holds the pin).

An owner that fails is started again at the next round, unless it failed with `LogDiverges`
(this build's coordinator does not re-derive an open handoff of the partition's log) or
`NewerLogVersion` (a newer build wrote the partition's log): that stops the worker, which hands
the rest of its share over, as it would refuse to start.

Set-up. The streams and the consumers are created if absent (idempotent: every worker does it)
before the worker announces itself; while the cluster cannot answer (forming, or without a meta
leader) it keeps trying, so a worker that starts before its cluster is ready joins the tier
later rather than exits. Only another partition count than the stream's stops it.

What decides what. Membership only sizes the shares; the pin decides who is served a
partition's inputs; the compare-and-set log decides who acted (worker.tier.ownership). So two
workers that disagree for a moment on who is live both pull a partition at worst, and one of
them is kept waiting by the pin, or fenced.

Failover. A worker that dies stops refreshing its key; once the key expires (`MEMBER_TTL_S`),
the next round of every other worker gives its partitions to the living; their pulls are
pinned once the dead worker's pin has gone without a pull for the consumer's
`priority_timeout` (long since, by then), and the new owner catches up on the partition's log
and claims it. So a partition has a new owner within about MEMBER_TTL_S + rebalance_s +
the catch-up, and priority_timeout when that is longer. A worker that joins takes its share
at its first round; the others hand that share over at theirs.

Metrics (`worker.tier.metrics.TierMetrics`, if given): the partitions it runs an owner for, set at
each round; its owners count their claims, fences and hand-overs there. Health: `unserved`
names the partitions of its share that no owner of it serves yet (not claimed since this
worker took it, or since its owner failed, e.g. on a full disk); the worker's /healthz is red
while there is one.

The coordinator is not here: the tier is given, per partition, the `worker.tier.owner.Steps`
its owner drives (worker.tier.partition's `Partition`, made by worker.tier.service's `Worker`:
the records to log, the actions to publish, the partition's SQLite file, its timers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.config import TierConfig
from kvhandoff.worker.errors import (
    BusError,
    ConfigError,
    LogDiverges,
    NewerLogVersion,
    StreamMismatch,
)
from kvhandoff.worker.stoppable import cancel_until_done, unless_stopped
from kvhandoff.worker.tier.balance import rebalance
from kvhandoff.worker.tier.members import Member, Membership, announce, members
from kvhandoff.worker.tier.metrics import TierMetrics
from kvhandoff.worker.tier.owner import PartitionOwner, SnapshotPolicy, Steps, max_ack_pending
from kvhandoff.worker.tier.ownership import PartitionLog
from kvhandoff.worker.tier.streams import (
    open_completions,
    open_partition_consumer,
    open_partition_log,
    open_partitions,
    open_rejections,
)

logger = logging.getLogger(__name__)

_OWNERS_KEPT = 1024  # `Tier.owners`


@dataclass(frozen=True)
class TierSettings(TierConfig):
    """The `TierConfig` every worker of a tier shares (its streams, partition count and
    consumers' timings), and what running the tier adds to it."""

    prefix: str = "kvhandoff"
    pull_expires_s: float = 1.0
    rebalance_s: float = 1.0
    # When owners snapshot their partitions (worker.tier.owner); None: never, so that
    # claims read the whole log (a measure's baseline, bench/catchup.py).
    snapshots: SnapshotPolicy | None = field(default_factory=SnapshotPolicy)

    @property
    def max_pending(self) -> int:
        """The partition consumers' max_ack_pending, for owners that pull `batch_size`."""
        return max_ack_pending(self.batch_size)

    def __post_init__(self) -> None:
        super().__post_init__()
        # The ack wait is shorter than the priority timeout less the pull expiry, so that a new
        # owner is pinned only once the old owner's unacknowledged inputs are due again.
        floor_s = self.ack_wait_s + self.pull_expires_s
        if self.priority_timeout_s <= floor_s:
            raise ConfigError(
                f"--priority-timeout must be more than {floor_s:g}s (--ack-wait plus the "
                "pull's expiry), so that a new owner is pinned only after the old owner's "
                "unacknowledged inputs are due again"
            )


class Tier:
    """This worker's owners, one per partition of its share; `run` it until stopped."""

    def __init__(
        self,
        bus: Bus,
        settings: TierSettings,
        partition: Callable[[int], Steps],
        label: str,
        *,
        metrics: TierMetrics | None = None,
    ) -> None:
        self._bus = bus
        self._metrics = metrics
        self._settings = settings
        self._partition = partition  # the coordinator of a partition, for its owner to drive
        self.member = Member.this_process()
        self.owner_name = f"{label}/{self.member.instance}"  # in the log's Claimed records
        self._running: dict[int, tuple[PartitionOwner, asyncio.Task[None], asyncio.Event]] = {}
        self._consumers: dict[int, str] = {}
        # What it did, for metrics and tests.
        # The last owners it ran, in order: bounded, as a worker whose partitions move back and
        # forth for months runs new owners all along.
        self.owners: deque[tuple[int, PartitionOwner]] = deque(maxlen=_OWNERS_KEPT)
        self.rounds = 0  # completed
        self._share: set[int] = set()  # the partitions the last round left it owning

    @property
    def owned(self) -> set[int]:
        """The partitions it runs an owner for now."""
        return set(self._running)

    @property
    def unserved(self) -> set[int]:
        """The partitions of its share that no owner serves: the owner has not claimed the
        partition yet (it waits for the pin, or for the partition to be vacant: see
        worker.tier.owner), or it ended (it failed, e.g. on a full disk), until the round
        that replaced it, or gave the partition to another worker, is over."""
        running = self._running
        return {
            p
            for p in self._share
            if p not in running or running[p][1].done() or not running[p][0].claims
        }

    async def run(self, stop: asyncio.Event) -> None:
        """Set up (retried while NATS cannot answer; a `StreamMismatch` is final), and own
        this worker's share until `stop` is set; then hand every partition over and withdraw."""
        settings = self._settings
        while True:
            try:
                # A JetStream that does not answer holds each request for its timeout.
                membership = await unless_stopped(stop, self._set_up())
                if membership is None:
                    return
                break
            except StreamMismatch:
                raise
            except BusError as exc:
                # A cluster that is forming, or electing a leader, answers JetStream's API
                # late: keep asking rather than leave the tier a worker short.
                logger.warning("tier: cannot set up yet (%s); retrying", exc)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(settings.rebalance_s):
                        await stop.wait()
                if stop.is_set():
                    return
        keeper = asyncio.create_task(membership.keep(), name="kvhandoff-membership")
        try:
            while not stop.is_set():
                try:
                    await self._round()
                except BusError as exc:
                    logger.warning("tier: cannot rebalance (%s); keeping what it owns", exc)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(settings.rebalance_s):
                        await stop.wait()
        finally:
            await self._stop_owners(set(self._running))
            self._count_owned()
            await cancel_until_done(keeper)
            await membership.leave()

    async def _set_up(self) -> Membership:
        """Open the streams (the inputs', the completions', the rejections', the log's) and the
        consumers (idempotent), and announce this worker."""
        settings = self._settings
        # The input stream first: it names the tier, so a worker started on another tier's
        # streams is told about that one (`StreamMismatch`), not about a stream named after it.
        await open_partitions(self._bus, settings.stream, settings.prefix, settings.partitions)
        await open_completions(
            self._bus,
            settings.done_stream,
            Subjects(settings.prefix).completions,
            settings.completion_ttl_s,
        )
        await open_rejections(
            self._bus,
            settings.rejections_stream,
            Subjects(settings.prefix).rejections,
            settings.completion_ttl_s,
        )
        await open_partition_log(self._bus, settings.log_stream, settings.prefix)
        for partition in range(settings.partitions):
            self._consumers[partition] = await open_partition_consumer(
                self._bus,
                settings.stream,
                settings.prefix,
                settings.consumer,
                partition,
                ack_wait_s=settings.ack_wait_s,
                max_pending=settings.max_pending,
                priority_timeout_s=settings.priority_timeout_s,
                partitions=settings.partitions,
            )
        return await announce(self._bus, self.member, self._settings.stream)

    async def _round(self) -> None:
        for partition, (_, task, _) in list(self._running.items()):
            if task.done():  # fenced, or failed: forget it, and take it up again if still ours
                del self._running[partition]
                failure = None if task.cancelled() else task.exception()
                if isinstance(failure, LogDiverges | NewerLogVersion):
                    # This build does not re-derive, or read, the partition's log: every claim
                    # of it would fail alike. Stop, handing the rest over, for a worker that
                    # does.
                    raise failure
                if failure is not None:
                    logger.error("partition %d: its owner failed: %s", partition, failure)
        live = [member.instance for member in await members(self._bus, self._settings.stream)]
        moves = rebalance(self._settings.partitions, live, self.member.instance, self.owned)
        if moves.take or moves.hand_over:
            logger.info(
                "tier: %d live worker(s); taking %s, handing over %s",
                len(set(live) | {self.member.instance}),
                sorted(moves.take),
                sorted(moves.hand_over),
            )
        await self._stop_owners(set(moves.hand_over))
        for partition in sorted(moves.take):
            self._start_owner(partition)
        # Only now: an owner forgotten above stays in the share (unserved) until it is replaced.
        self._share = set(self._running)
        self.rounds += 1  # completed: health reads the share this one left
        self._count_owned()

    def _count_owned(self) -> None:
        if self._metrics is not None:
            self._metrics.owned.set(len(self._running))

    def _start_owner(self, partition: int) -> None:
        settings = self._settings
        log = PartitionLog(
            self._bus, settings.log_stream, settings.prefix, partition, self.owner_name
        )
        owner = PartitionOwner(
            self._bus,
            settings.stream,
            self._consumers[partition],
            log,
            self._partition(partition),
            batch=settings.batch_size,
            expires_s=settings.pull_expires_s,
            heartbeat_s=settings.pull_expires_s / 4,
            claim_vacant_after_s=settings.priority_timeout_s,
            metrics=self._metrics,
            snapshots=settings.snapshots,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(owner.run(stop), name=f"kvhandoff-partition-{partition}")
        self._running[partition] = (owner, task, stop)
        self.owners.append((partition, owner))

    async def _stop_owners(self, partitions: set[int]) -> None:
        """Stop these owners (each hands its partition over) and wait for them."""
        stopping = [self._running.pop(p) for p in partitions if p in self._running]
        for _, _, stop in stopping:
            stop.set()
        for _, task, _ in stopping:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task  # a failure was logged by the owner, or is logged here next round
