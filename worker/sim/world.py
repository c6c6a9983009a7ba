"""One simulated run of the tier: its workers, engines and frontend on the model, from one seed.

Theory of operation. `simulate(Scenario(seed))` builds, on a `worker.sim.loop.SimLoop` of that
seed, a three-node `SimCluster` (the model of NATS), `workers` tier workers
(`worker.tier.service.Worker`, the code `kvhandoff run` runs, each with its own partition files
in a temporary directory), one host of the mock engines (`worker.engines.MockEngines`) and the
load generator as the frontend (`worker.loadgen`): the very code of the product, each in its own
`SimProcess` (its clock, its ids, its host name), with nats-py pinned to the simulation
(`worker.sim.natspy`). The load starts handoffs at `rate_per_s` for `duration_s` of virtual
time, while the faults the seed drew happen (`worker.sim.faults`); then every fault heals, and the
tier has `quiet_s` for every handoff to end. Then the workers stop, and the checkers
(`worker.sim.checks`) read the history the model recorded and the workers' files.

Everything a run does follows from the seed: the same seed gives the same trace, byte for byte
(`Outcome.trace_hash`), which is what makes a failure worth having: `kvhandoff sim --seed S`
replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvhandoff.client.connection import Connection
from kvhandoff.worker import ambient
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.config import TierConfig, WorkerConfig
from kvhandoff.worker.engines.host import EnginesConfig, MockEngines
from kvhandoff.worker.loadgen.generator import LoadConfig, LoadReport, run_load
from kvhandoff.worker.sim import loop as simloop
from kvhandoff.worker.sim import natspy, plants
from kvhandoff.worker.sim.nats.cluster import SimCluster
from kvhandoff.worker.sim.process import SimProcess
from kvhandoff.worker.tier.metrics import Metrics
from kvhandoff.worker.tier.service import Worker, tier_settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scenario:
    """What one run simulates. Everything not here is drawn from `seed`."""

    seed: int
    workers: int = 3
    partitions: int = 16
    duration_s: float = 60.0  # virtual: the load, and the faults, run this long
    quiet_s: float = 30.0  # then every fault heals, and every handoff must end within this
    rate_per_s: float = 4.0  # handoffs started per virtual second
    cancel_share: float = 0.2
    deadline_ms: int = 10_000  # each handoff's deadline, which the workers' timers keep
    faults: bool = True
    plant: str | None = None  # a planted bug (worker.sim.plants), by name


@dataclass
class Outcome:
    """What a run did, and whether it broke an invariant."""

    seed: int
    trace_hash: str
    steps: int
    virtual_s: float
    wall_s: float
    violations: list[str]
    load: LoadReport | None
    trace: list[str] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


class _Stage:
    """The processes of one run, on the loop, and what they share."""

    def __init__(self, scenario: Scenario, cluster: SimCluster, workdir: Path) -> None:
        self.scenario = scenario
        self.cluster = cluster
        self.workdir = workdir
        self.nats = NatsSettings(url=cluster.url)
        self.stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        if not isinstance(loop, simloop.SimLoop):
            raise RuntimeError(f"a simulated run needs the simulation's loop, not {loop!r}")
        self._loop = loop
        self._pids = iter(range(100, 1_000_000))

    def process(self, name: str) -> SimProcess:
        """A new simulated process, with its own stream of the seed."""
        chance = random.Random(self._loop.chance.getrandbits(64))
        return SimProcess(name, chance, pid=next(self._pids))

    def spawn(self, process: SimProcess, work: Callable[[], Awaitable[Any]]) -> asyncio.Task[Any]:
        """Run `work` as `process`: its tasks read the process's ambient."""

        async def body() -> Any:
            return await work()

        with ambient.using(process):
            return asyncio.create_task(body())

    def worker_config(self, directory: Path) -> WorkerConfig:
        directory.mkdir(parents=True, exist_ok=True)
        return WorkerConfig(
            nats=self.nats,
            db_path=directory / "worker.db",
            data_dir=directory,
            tier=TierConfig(partitions=self.scenario.partitions),
            metrics_port=0,
            # Snapshots often, so that runs of a minute take and read them.
            snapshot_every=64,
            snapshot_interval_s=10.0,
            synchronous="NORMAL",
        )

    async def run_worker(self, name: str, directory: Path) -> None:
        config = self.worker_config(directory)
        bus = await Bus.connect(self.nats, name)
        try:
            worker = Worker(config, tier_settings(config), bus, Metrics(), label=name)
            await worker.run(self.stop)
        finally:
            await bus.close()


async def _run(scenario: Scenario, cluster: SimCluster, workdir: Path) -> LoadReport:
    stage = _Stage(scenario, cluster, workdir)
    workers = [
        stage.spawn(
            stage.process(f"worker-{n}"),
            lambda n=n: stage.run_worker(f"worker-{n}", workdir / f"worker-{n}"),  # type: ignore[misc]
        )
        for n in range(scenario.workers)
    ]
    engines_process = stage.process("engines")
    with ambient.using(engines_process):
        connection = await Connection.open(stage.nats, "engines")
        engines = MockEngines(connection, EnginesConfig())
        await engines.start()
    handoffs = max(1, round(scenario.rate_per_s * scenario.duration_s))
    load = LoadConfig(
        nats=stage.nats,
        handoffs=handoffs,
        rate_per_s=scenario.rate_per_s,
        cancel_share=scenario.cancel_share,
        cancel_within_ms=2_000,
        deadline_ms=scenario.deadline_ms,
        wait_timeout_s=scenario.duration_s + scenario.quiet_s,
        engines_wait_s=10.0,
        seed=scenario.seed,
    )
    report: LoadReport = await stage.spawn(stage.process("frontend"), lambda: run_load(load))
    stage.stop.set()
    await asyncio.gather(*workers)
    with ambient.using(engines_process):
        await engines.stop()
        await connection.close()
    return report


def simulate(scenario: Scenario, *, keep_trace: bool = False) -> Outcome:
    """Run `scenario` to its end and check it."""
    began = time.perf_counter()
    chance = random.Random(scenario.seed)
    cluster = SimCluster(
        random.Random(chance.getrandbits(64)),
        origin=lambda: getattr(ambient.current(), "name", "client"),
    )
    with (
        tempfile.TemporaryDirectory(prefix="kvhandoff-sim-") as workdir,
        natspy.pinned(),
        _quiet_logs(),
        plants.planted(scenario.plant),
    ):
        finished = simloop.run(
            lambda: _run(scenario, cluster, Path(workdir)),
            chance.getrandbits(64),
            keep_trace=keep_trace,
            connect=cluster.network.create_connection,
        )
    loop = finished.loop
    report = finished.result
    violations = [f"unhandled error in the loop: {e.get('message')}" for e in loop.errors]
    if report.timed_out or report.unreported:
        violations.append(
            f"{report.timed_out} handoffs did not end within the quiet phase"
            f" ({len(report.unreported)} unreported)"
        )
    if report.leaks:
        violations.append(f"the engines leaked {report.leaks} blocks: {report.leak_details}")
    return Outcome(
        seed=scenario.seed,
        trace_hash=loop.trace_hash(),
        steps=loop.steps,
        virtual_s=loop.time(),
        wall_s=time.perf_counter() - began,
        violations=violations,
        load=report,
        trace=loop.trace_lines() if keep_trace else None,
    )


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """The product logs at INFO what a simulated run does thousands of times over; only
    warnings and worse are worth a look, and only when a seed fails."""
    root = logging.getLogger("kvhandoff")
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        root.setLevel(level)
