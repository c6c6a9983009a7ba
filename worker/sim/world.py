"""One simulated run of the tier: its workers, engines and frontend on the model, from one seed.

Theory of operation. `simulate(Scenario(seed))` builds, on a `worker.sim.loop.SimLoop` of that
seed, a three-node `SimCluster` (the model of NATS), `workers` tier workers
(`worker.tier.service.Worker`, the code `kvhandoff run` runs, each with its own partition files
in a temporary directory), one host of the mock engines (`worker.engines.MockEngines`) and the
load generator as the frontend (`worker.loadgen`): the very code of the product, each in its own
`SimProcess` (its clock, its ids, its host name), with nats-py pinned to the simulation
(`worker.sim.natspy`). The load starts handoffs at `rate_per_s` for `duration_s` of virtual
time, while the faults the seed drew happen (`worker.sim.faults`: `_Run.direct`); then every
fault heals, and the tier has `quiet_s` for every handoff to end. The run then asks the engines
what they still hold, stops the workers cleanly, and the checkers (`worker.sim.checks`) read
the history the model recorded (`worker.sim.history`) and the workers' files.

A worker that crashes is gone for good: the next incarnation of its slot (`_Slot`) is a new
process under the same name, in a new directory holding a copy of its predecessor's files (or
none: a new disk), since the dead one's file locks are never released in this process.

Everything a run does follows from the seed: the same seed gives the same trace, byte for byte
(`Outcome.trace_hash`), which is what makes a failure worth having: `kvhandoff sim --seed S`
replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from kvhandoff.client.connection import Connection
from kvhandoff.worker import ambient
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.config import TierConfig, WorkerConfig
from kvhandoff.worker.engines.faults import Faults
from kvhandoff.worker.engines.host import EnginesConfig, MockEngines
from kvhandoff.worker.engines.report import EnginesReport, settled
from kvhandoff.worker.loadgen.generator import LoadConfig, LoadReport, run_load
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.sim import faults, natspy, plants, pulls
from kvhandoff.worker.sim import loop as simloop
from kvhandoff.worker.sim.checks import Names, ReplicatedLog, check_hand_overs_claimed, check_run
from kvhandoff.worker.sim.disk import SimDisk
from kvhandoff.worker.sim.faults import Fault, FaultPlan
from kvhandoff.worker.sim.history import History
from kvhandoff.worker.sim.nats.cluster import SimCluster
from kvhandoff.worker.sim.process import SimProcess
from kvhandoff.worker.tier.metrics import Metrics
from kvhandoff.worker.tier.service import Worker, tier_settings

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
    # The fault kinds every seed has, the others none (worker.sim.faults); None: drawn.
    fault_kinds: tuple[str, ...] | None = None


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
    faults: list[str] = field(default_factory=list)  # the plan's, one line each

    @property
    def ok(self) -> bool:
        return not self.violations


class _Slot:
    """One worker of the run, across its incarnations: a crash ends one, a restart begins the
    next, under the same name (its host on the network), in a directory of its own."""

    def __init__(self, name: str, skew_s: float) -> None:
        self.name = name
        self.skew_s = skew_s
        self.incarnation = 0
        self.directory: Path | None = None
        self.process: SimProcess | None = None
        self.task: asyncio.Task[None] | None = None
        self.stop = asyncio.Event()
        self.disk = SimDisk()  # its machine's: a restart keeps it, full or slow as it was


class _Run:
    """The processes of one run on the loop, and the faults that befall them."""

    def __init__(
        self,
        scenario: Scenario,
        plan: FaultPlan,
        cluster: SimCluster,
        history: History,
        workdir: Path,
    ) -> None:
        self.scenario = scenario
        self.history = history
        self.plan = plan
        self.cluster = cluster
        self.workdir = workdir
        self.nats = NatsSettings(url=cluster.url)
        loop = asyncio.get_running_loop()
        if not isinstance(loop, simloop.SimLoop):
            raise RuntimeError(f"a simulated run needs the simulation's loop, not {loop!r}")
        self.loop = loop
        self._pids = iter(range(100, 1_000_000))
        self.slots = {
            name: _Slot(name, plan.skews_s.get(name, 0.0))
            for name in [*worker_names(scenario), "joiner"]
        }
        self.paused: set[str] = set()
        self.failures: list[str] = []  # what the run saw go wrong besides the checks
        self.engines: tuple[SimProcess, Connection, MockEngines] | None = None
        self.quiet = False  # every fault healed: the engines' own too

    def process(self, name: str, skew_s: float = 0.0, disk: SimDisk | None = None) -> SimProcess:
        """A new simulated process, with its own stream of the seed."""
        chance = random.Random(self.loop.chance.getrandbits(64))
        process = SimProcess(name, chance, pid=next(self._pids), skew_s=skew_s, disk=disk)
        self.history.processes[name] = process  # its latest incarnation's clock
        return process

    def spawn(self, process: SimProcess, work: Callable[[], Awaitable[T]]) -> asyncio.Task[T]:
        """Run `work` as `process`: its tasks read the process's ambient."""

        async def body() -> T:
            return await work()

        with ambient.using(process):
            return asyncio.create_task(body())

    # Workers.

    def start_worker(self, slot: _Slot, *, keep_files: bool = True) -> None:
        """Start the slot's next incarnation, in a new directory holding its last one's files
        if `keep_files` (the disk survived), or none (a new disk)."""
        slot.incarnation += 1
        directory = self.workdir / f"{slot.name}.{slot.incarnation}"
        directory.mkdir(parents=True)
        if keep_files and slot.directory is not None:
            # The crashed incarnation's flock on its files is never released (its descriptors
            # stay open in this process), so the next one gets a copy, as a restarted process
            # finds the disk its predecessor left.
            for path in sorted(slot.directory.iterdir()):
                if path.suffix != ".lock":
                    shutil.copy2(path, directory / path.name)
        slot.directory = directory
        slot.stop = asyncio.Event()
        slot.process = self.process(slot.name, slot.skew_s, slot.disk)
        slot.task = self.spawn(slot.process, lambda: self._serve(slot.name, directory, slot.stop))

    async def _serve(self, name: str, directory: Path, stop: asyncio.Event) -> None:
        config = WorkerConfig(
            nats=self.nats,
            db_path=directory / "worker.db",
            data_dir=directory,
            tier=TierConfig(partitions=self.scenario.partitions),
            metrics_port=0,
            # Snapshots often, so that runs of a minute take them and read them back.
            snapshot_every=64,
            snapshot_interval_s=10.0,
            synchronous="NORMAL",
        )
        bus = await Bus.connect(self.nats, name)
        try:
            worker = Worker(config, tier_settings(config), bus, Metrics(), label=name)
            await worker.run(stop)
        finally:
            await bus.close()

    def crash(self, slot: _Slot) -> None:
        """SIGKILL: none of its code runs again, and its connections reset."""
        if slot.process is None or slot.task is None:
            return
        self.loop.crash(slot.process)
        self.cluster.network.down(slot.name)
        self.paused.discard(slot.name)
        slot.process, slot.task = None, None

    def restart(self, slot: _Slot, keep_files: bool) -> None:
        if slot.process is None:
            self.cluster.network.up(slot.name)
            self.start_worker(slot, keep_files=keep_files)

    def pause(self, slot: _Slot) -> None:
        if slot.process is not None and slot.name not in self.paused:
            self.loop.pause(slot.process)
            self.paused.add(slot.name)

    def resume(self, slot: _Slot) -> None:
        if slot.process is not None and slot.name in self.paused:
            self.paused.discard(slot.name)
            self.loop.resume(slot.process)

    async def stop_worker(self, slot: _Slot) -> None:
        """A clean stop (SIGTERM): it hands its partitions over."""
        self.resume(slot)
        task = slot.task
        if task is not None:
            slot.stop.set()
            await asyncio.wait([task])
            slot.process, slot.task = None, None
            # A worker that ended by itself, not by the stop, failed as `kvhandoff run`
            # would have exited 1: that is for the checks to report.
            if task.cancelled():
                self.failures.append(f"{slot.name}: its worker was cancelled")
            elif (failure := task.exception()) is not None:
                self.failures.append(f"{slot.name}: its worker failed: {failure!r}")

    # Faults.

    async def direct(self) -> None:
        """Make each fault of the plan happen at its time, then heal every one of them."""
        jetstream = self.cluster.jetstream
        jetstream.faults.lost_ack_rate = self.plan.lost_acks
        self.cluster.consumers.faults.late_acks_accepted = self.plan.late_acks
        self.cluster.consumers.faults.pin_overlap_s = self.plan.pin_overlap_s
        ends: list[asyncio.Task[None]] = []
        for fault in self.plan.faults:
            await asyncio.sleep(max(0.0, fault.at_s - self.loop.time()))
            self.loop.note(f"fault {fault}")
            ends.append(asyncio.create_task(self._befall(fault)))
        await asyncio.sleep(max(0.0, self.scenario.duration_s - self.loop.time()))
        self.loop.note("quiet: every fault heals")
        self.quiet = True
        if self.engines is not None:
            self.engines[2].heal()
        jetstream.faults.lost_ack_rate = 0.0
        jetstream.faults.unavailable_until = 0.0
        self.cluster.consumers.faults.late_acks_accepted = False
        self.cluster.consumers.faults.pin_overlap_s = 0.0
        self.cluster.network.set_delay(*_DELAY_S)
        for host in self.cluster.hosts:
            self.cluster.node_up(host)
        for task in ends:
            task.cancel()
        await asyncio.gather(*ends, return_exceptions=True)
        for slot in self.slots.values():
            slot.disk.heal()
            if slot.name in self.paused:
                self.resume(slot)
            elif slot.name != "joiner" and slot.process is None:
                self.restart(slot, keep_files=True)
        await self.start_engines()

    async def _befall(self, fault: Fault) -> None:
        """One fault, from its start to its end (or the quiet phase, which cancels it)."""
        slot = self.slots.get(fault.target)
        match fault.kind:
            case "crash" if slot is not None:
                self.crash(slot)
                await asyncio.sleep(fault.for_s)
                self.restart(slot, fault.keep_files)
            case "pause" if slot is not None:
                self.pause(slot)
                await asyncio.sleep(fault.for_s)
                self.resume(slot)
            case "node":
                self.cluster.node_down(fault.target)
                await asyncio.sleep(fault.for_s)
                self.cluster.node_up(fault.target)
            case "election":
                until = self.loop.time() + fault.for_s
                self.cluster.jetstream.faults.unavailable_until = until
            case "delay":
                self.cluster.network.set_delay(0.005, 0.05)
                await asyncio.sleep(fault.for_s)
                self.cluster.network.set_delay(*_DELAY_S)
            case "churn" if slot is not None:
                self.start_worker(slot)
                await asyncio.sleep(fault.for_s)
                await self.stop_worker(slot)
            case "reset":
                self.cluster.network.pause(fault.target)
                try:
                    await asyncio.sleep(fault.for_s)
                finally:  # the quiet phase cancels it: the connection is reset all the same
                    self.cluster.network.reset(fault.target)
                    self.cluster.network.resume(fault.target)
            case "full" if slot is not None:
                slot.disk.fill()
                await asyncio.sleep(fault.for_s)
                slot.disk.empty()
            case "slow" if slot is not None:
                slot.disk.slow_down(fault.latency_s)
                await asyncio.sleep(fault.for_s)
                slot.disk.slow_down(0.0)
            case "engines":
                self.crash_engines()
                await asyncio.sleep(fault.for_s)
                await self.start_engines()

    # The engines: one host of every engine of the roster, restarted after a crash.

    async def start_engines(self) -> MockEngines:
        """The engines' host, started if it is down."""
        if self.engines is not None:
            return self.engines[2]
        self.cluster.network.up("engines")
        process = self.process("engines")
        with ambient.using(process):
            connection = await Connection.open(self.nats, "engines")
            faults = Faults() if self.quiet else self.plan.engines
            engines = MockEngines(connection, EnginesConfig(faults=faults))
            await engines.start()
        self.engines = (process, connection, engines)
        return engines

    def crash_engines(self) -> None:
        """SIGKILL: its engines hold nothing any more, and their leases lapse."""
        if self.engines is not None:
            process, _, _ = self.engines
            self.loop.crash(process)
            self.cluster.network.down("engines")
            self.engines = None

    async def settle_engines(self, within_s: float) -> EnginesReport:
        """The engines' report once they hold blocks only for decodes still running, or after
        `within_s`: what they leaked (the frontend's own report misses a host that was down
        when it asked)."""
        engines = await self.start_engines()
        give_up_at = self.loop.time() + within_s
        while True:
            report = engines.report()
            if settled([report]) or self.loop.time() >= give_up_at:
                return report
            await asyncio.sleep(0.1)  # decodes end in their own time

    async def stop_engines(self) -> None:
        if self.engines is not None:
            process, connection, engines = self.engines
            with ambient.using(process):
                await engines.stop()
                await connection.close()
            self.engines = None


_DELAY_S = (0.0005, 0.002)  # the network's delays when nothing is wrong with it
# How soon after a hand-over its partition must be claimed again, once faults healed: the
# priority timeout (3 s), a second for the vacancy poll, a membership key's TTL (5 s) for a
# worker that woke or restarted at the heal, a round (1 s), and the claim's catch-up.
_CLAIMED_WITHIN_S = 15.0
_LINGER_POLL_S = 1.0  # how often the frontend reads the log for handoffs still open


async def _until_logged_ended(history: History, *, until_s: float) -> None:
    """Until the log ends every handoff it holds, or the quiet phase is over. The frontend's
    waits end at a handoff's first Complete, but a late terminal fact may reopen a success, and
    its cleanup can end later (a dropped cancel waits for its retry): the frontend listens on
    meanwhile, so that its final states are the log's, and the tier has the whole quiet phase
    for every handoff to end."""
    loop = asyncio.get_running_loop()
    while True:
        if loop.time() >= until_s or not _open_in_log(ReplicatedLog.read(history, Names())):
            return
        await asyncio.sleep(_LINGER_POLL_S)


def _open_in_log(log: ReplicatedLog) -> bool:
    return any(rows[-1].state is HandoffState.OPEN for rows in log.rows.values())


def worker_names(scenario: Scenario) -> list[str]:
    return [f"worker-{n}" for n in range(scenario.workers)]


async def _run(
    scenario: Scenario, plan: FaultPlan, cluster: SimCluster, history: History, workdir: Path
) -> tuple[LoadReport, list[str]]:
    run = _Run(scenario, plan, cluster, history, workdir)
    for name in worker_names(scenario):
        run.start_worker(run.slots[name])
    await run.start_engines()
    director = asyncio.create_task(run.direct())
    handoffs = max(1, round(scenario.rate_per_s * scenario.duration_s))
    load = LoadConfig(
        nats=run.nats,
        handoffs=handoffs,
        rate_per_s=scenario.rate_per_s,
        cancel_share=scenario.cancel_share,
        cancel_within_ms=2_000,
        deadline_ms=scenario.deadline_ms,
        wait_timeout_s=scenario.duration_s + scenario.quiet_s,
        engines_wait_s=10.0,
        seed=scenario.seed,
        linger=lambda: _until_logged_ended(history, until_s=scenario.duration_s + scenario.quiet_s),
    )
    report = await run.spawn(run.process("frontend"), lambda: run_load(load))
    await director
    engines = await run.settle_engines(within_s=10.0)
    if engines.leaks:
        run.failures.append(f"the engines leaked {len(engines.leaks)} blocks: {engines.leaks}")
    # Before the workers stop: each hands its partitions over as it goes.
    log = ReplicatedLog.read(history, Names())
    now = asyncio.get_running_loop().time()
    run.failures += check_hand_overs_claimed(log, until_s=now, within_s=_CLAIMED_WITHIN_S)
    for slot in run.slots.values():
        await run.stop_worker(slot)
    await run.stop_engines()
    return report, run.failures


def simulate(scenario: Scenario, *, keep_trace: bool = False) -> Outcome:
    """Run `scenario` to its end and check it."""
    began = time.perf_counter()
    chance = random.Random(scenario.seed)
    cluster = SimCluster(
        random.Random(chance.getrandbits(64)),
        origin=lambda: getattr(ambient.current(), "name", "client"),
    )
    plan = FaultPlan()
    if scenario.faults:
        plan = faults.draw(
            random.Random(chance.getrandbits(64)),
            workers=worker_names(scenario),
            nodes=cluster.hosts,
            duration_s=scenario.duration_s,
            kinds=scenario.fault_kinds,
        )
    history = History()
    cluster.record(history)
    with (
        tempfile.TemporaryDirectory(prefix="kvhandoff-sim-", dir=_ram_disk()) as workdir,
        natspy.pinned(),
        pulls.watched(history),
        _quiet_logs(),
        plants.planted(scenario.plant),
    ):
        finished = simloop.run(
            lambda: _run(scenario, plan, cluster, history, Path(workdir)),
            chance.getrandbits(64),
            keep_trace=keep_trace,
            connect=cluster.network.create_connection,
        )
        loop = finished.loop
        report, failures = finished.result
        # The run's own errors, before burying its dead adds the collector's findings.
        violations = [f"unhandled error in the loop: {e.get('message')}" for e in loop.errors]
        violations += failures
        # While the workers' files are still there.
        checked = check_run(history, Path(workdir), load=report)
        loop.bury()
        cluster.network.abandon()
    if report.timed_out:
        violations.append(f"{report.timed_out} handoffs did not end within the quiet phase")
    violations += checked
    return Outcome(
        seed=scenario.seed,
        trace_hash=loop.trace_hash(),
        steps=loop.steps,
        virtual_s=loop.time(),
        wall_s=time.perf_counter() - began,
        violations=violations,
        load=report,
        trace=loop.trace_lines() if keep_trace else None,
        faults=plan.describe(),
    )


# Where the workers' files go if the machine has room there: a RAM disk. The simulation's
# disks are its own (worker.sim.disk: full, slow), so a real disk's fsyncs add nothing to a run
# but wall time, a fifth of it. A run's files take a few MB; the margin keeps a small /dev/shm
# (a container's is 64 MB) from filling up under seeds run side by side.
_RAM_DISK = Path("/dev/shm")
_RAM_DISK_ROOM = 1 << 30


def _ram_disk() -> Path | None:
    """The RAM disk, if there is one with room; None: the system's temporary directory."""
    try:
        roomy = shutil.disk_usage(_RAM_DISK).free >= _RAM_DISK_ROOM
    except OSError:
        return None
    return _RAM_DISK if roomy and os.access(_RAM_DISK, os.W_OK) else None


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """The product logs what a simulated run does thousands of times over, and under faults
    its errors are the expected ones (a lease not renewed while JetStream elects a leader): a
    run's verdict is its checks', and its trace says what happened."""
    root = logging.getLogger("kvhandoff")
    level = root.level
    root.setLevel(max(level, logging.CRITICAL))
    try:
        yield
    finally:
        root.setLevel(level)
