"""The worker: `kvhandoff run`, one worker of a tier, with the real coordinator.

Every worker is one of a tier (worker.tier.membership), and a tier of one partition is the embedded
default: `kvhandoff run --db FILE` is the only worker of partition 0, whose local file is FILE
(under the writer lock that `run` takes first). With `--partitions P --data-dir DIR` each partition
it owns has its file at `DIR/partition-<p>.db` (the offline tools read `DIR/partition-*.db`), held
under its own `WriterLock` from first claim until the worker stops. One code path serves both.

Theory of operation. A `Worker` is the process-level wiring: it runs a
`worker.tier.membership.Tier`, which runs a `worker.tier.owner.PartitionOwner` for each
partition of its share, and gives each owner the partition's `worker.tier.partition.Partition`
to drive (its planner, its local file, its timers and its outbox: claim, decide, act, release;
that module's docstring holds their invariants). A worker makes one `Partition` per partition
number, the first time an owner asks for it, and keeps it until it stops, so that a partition
that comes back to this worker finds its file open. What spans the partitions stays here: the
engine leases (`worker.tier.leases.EngineLeases`, whose lost leases are answered in every
partition it owns), the gauges of the handoffs in memory, health, and closing every file at
the end.

Retention. `--retention` (a week unless given) bounds only the debugging history: the files
drop their completed handoffs and rejections older than that, hourly. The replicated log has
no age limit, since an open handoff's entries must stay for a new owner on another machine to
rebuild it, whatever its deadline; snapshots bound it. A file compacted this way still catches
up from its mark: the entries after it never need a handoff that was completed before them.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.config import WorkerConfig
from kvhandoff.worker.log.store import EventLog
from kvhandoff.worker.tier.lease_view import view_path
from kvhandoff.worker.tier.leases import EngineLeases
from kvhandoff.worker.tier.membership import Tier, TierSettings
from kvhandoff.worker.tier.metrics import Metrics, TierMetrics
from kvhandoff.worker.tier.owner import SnapshotPolicy
from kvhandoff.worker.tier.partition import Partition


def tier_settings(config: WorkerConfig) -> TierSettings:
    """The tier's settings as `kvhandoff run` gives them from its configuration."""
    snapshots = None
    if config.snapshot_every:
        snapshots = SnapshotPolicy(config.snapshot_every, config.snapshot_interval_s)
    return TierSettings(
        **asdict(config.tier), prefix=config.nats.subject_prefix, snapshots=snapshots
    )


class Worker:
    """The tier's worker with the real coordinator; `run` it until stopped."""

    def __init__(
        self,
        config: WorkerConfig,
        settings: TierSettings,
        bus: Bus,
        metrics: Metrics,
        *,
        label: str,
    ) -> None:
        self._config = config
        self._bus = bus
        self._metrics = metrics
        self._subjects = Subjects(config.nats.subject_prefix)
        self._partitions: dict[int, Partition] = {}
        # Engine leases (issue #34): the bucket's watch, and the answers for gone engines.
        self.leases = EngineLeases(
            bus,
            self._subjects,
            metrics,
            require=config.require_leases,
            view=view_path(config.data_dir or config.db_path),
        )
        self.leases.on_gone(self._lease_gone)
        self.tier = Tier(
            bus, settings, self.partition, label, metrics=TierMetrics(metrics.registry)
        )

    @property
    def healthy(self) -> bool:
        """Connected, and in the tier: its streams are open, it has taken its share, and it
        serves every partition of it: claimed, caught up and recovered (an owner that failed,
        e.g. on a full disk, serves nothing until a claim succeeds again)."""
        return self._bus.is_connected and self.tier.rounds > 0 and not self.tier.unserved

    def logs(self) -> list[EventLog]:
        """The partition files open now (every partition it owned since it started)."""
        return [part.log for part in self._partitions.values() if part.opened]

    def partition(self, number: int) -> Partition:
        """The partition's coordinator, made the first time (its file opens at its first
        claim), for the tier's owner of it to drive."""
        part = self._partitions.get(number)
        if part is None:
            part = self._partitions[number] = Partition(
                number,
                self._config,
                self._bus,
                self._metrics,
                self.leases,
                count_in_memory=self._count_in_memory,
            )
        return part

    async def run(self, stop: asyncio.Event) -> None:
        """Own this worker's share until `stop` is set, then close every partition file."""
        try:
            await self.leases.start(stop)  # before any claim: an owner answers for gone engines
            await self.tier.run(stop)
        finally:
            await self.leases.stop()
            for part in self._partitions.values():
                part.stop_publishing_again()  # every partition's, before any file closes
            for part in self._partitions.values():
                await part.close()
            self._partitions.clear()

    def _count_in_memory(self) -> None:
        """The gauges of the handoffs in memory, over the partitions it owns now."""
        parts = self._partitions.values()
        self._metrics.open_handoffs.set(sum(len(p.planner.open) for p in parts))
        self._metrics.quarantined.set(sum(len(p.planner.quarantined) for p in parts))

    def _lease_gone(self, engine_id: str, incarnation: str) -> None:
        """An engine's lease went: answer for it in every handoff this worker owns."""
        for part in self._partitions.values():
            self.leases.sweep(part.planner.open.values(), {engine_id: incarnation})
