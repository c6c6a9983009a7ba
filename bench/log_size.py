"""Bytes per handoff in the event log, and what a group commit costs, on the success path.

Run from the repository root as `python bench/log_size.py [--handoffs N] [--window N]
[--batch-size N] [--runs N] [--synchronous FULL|NORMAL] [--keep PATH]`.

What is written
---------------
`--handoffs` (default 20,000) success handoffs, half source-first (vLLM) and half
destination-first (SGLang), through the worker's own code: each input, as the JSON an engine
publishes, goes through `worker.tier.planner.Planner` (decode, load what is not in memory, plan)
into the plan's `Batch`, and the batch is committed by `worker.log.store.EventLog`, one group
commit per `--batch-size` inputs (default 512, the worker's default). So the rows are exactly the
worker's: one input row and its action rows per accepted input, the handoff's row upserted once per
batch, and the outbox marks of a batch's actions riding on the next commit (as
`worker.tier.service` adds them). Nothing is published: no NATS. The inputs come from the protocol
itself (the scripted engines' success answers to the coordinator's actions,
`tests.worker.scripted_engine`), and are interleaved as a closed loop of `--window` (default 256)
handoffs in flight would interleave them (a seeded random pick among the open handoffs emits that
handoff's next input), so a batch mixes many handoffs and their rows land in the log the way a live
worker's do.

What is measured
----------------
- ``bytes/handoff``: the file's size once the log is closed and its WAL checkpointed into it,
  divided by the handoffs written; with where the bytes are, per table and index (SQLite's
  `dbstat`, payload and page fill).
- ``rows/handoff``: rows of the `events` table per handoff.
- ``commit ms/batch``: the wall time of each `EventLog.commit` (the transaction, its fsync with
  `--synchronous FULL`, the worker's default), the median over every batch of a run; and
  ``commit us/handoff``, all commits of a run divided by its handoffs.
- ``plan us/handoff``: the planner's time (decode, load, apply, encode the rows), all batches
  of a run divided by its handoffs, for what the layout costs before the commit.
- ``load us/handoff``: reading every handoff back and rebuilding it, as recovery does for the
  open ones and a batch for a handoff that comes back into memory (`EventLog.load` by id, in
  chunks of 500, then `Planner.adopt`, which also collects each input's digest), on the
  reopened log.

Each run writes a fresh file; the sizes are the same in every run (the traffic is seeded), the
times are the median of `--runs` runs (default 3). `--keep PATH` keeps the last run's log there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

# Runnable from a checkout (`python bench/log_size.py`).
_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))

from kvhandoff.events.codec import encode  # noqa: E402
from kvhandoff.events.coordinator import HandoffCoordinator  # noqa: E402
from kvhandoff.events.messages import EngineType, HandoffCompletion, Input, StartHandoff  # noqa: E402
from kvhandoff.events.subjects import Subjects  # noqa: E402
from kvhandoff.worker.ambient import now_ms  # noqa: E402
from kvhandoff.worker.engines.healthy import success_script  # noqa: E402
from kvhandoff.worker.log.rows import Batch  # noqa: E402
from kvhandoff.worker.log.store import EventLog  # noqa: E402
from kvhandoff.worker.tier.planner import Planner  # noqa: E402

_SUBJECTS = Subjects()
_DEADLINE_MS = 600_000  # far beyond any run: no handoff may time out
_ACK_WAIT_S = 30.0  # the worker's default; nothing here is early, so nothing waits on it


@dataclass(frozen=True, slots=True)
class Delivery:
    """An input as the planner reads it from JetStream (`worker.tier.planner.Delivery`)."""

    data: bytes
    subject: str
    deliveries: int
    stream_seq: int


def _handoff(i: int) -> list[Input]:
    """The i-th handoff's inputs, first issued first answered: engine types alternate."""
    engine_type = EngineType.VLLM if i % 2 == 0 else EngineType.SGLANG
    start = StartHandoff(
        uuid.UUID(int=random.Random(i).getrandbits(128), version=4),
        engine_type,
        f"{engine_type}-prefill-{i % 4}",
        f"{engine_type}-decode-{i % 4}",
        _DEADLINE_MS,
    )
    coordinator = HandoffCoordinator.for_start(start)
    pending: deque[Input] = deque([start])
    inputs: list[Input] = []
    while pending:
        message = pending.popleft()
        inputs.append(message)
        for action in coordinator.handle(message):
            pending.extend(success_script(action))
    assert coordinator.completion is HandoffCompletion.SUCCESS
    return inputs


def traffic(handoffs: int, window: int, seed: int = 20261201) -> list[Delivery]:
    """Every input of `handoffs` handoffs, interleaved as a closed loop of `window` would be."""
    rng = random.Random(seed)
    pending: Iterator[list[Input]] = (_handoff(i) for i in range(handoffs))
    open_: list[Iterator[Input]] = [iter(h) for _, h in zip(range(window), pending, strict=False)]
    deliveries: list[Delivery] = []
    while open_:
        i = rng.randrange(len(open_))
        message = next(open_[i], None)
        if message is not None:
            subject = _SUBJECTS.input(message.handoff_id)
            deliveries.append(Delivery(encode(message), subject, 1, len(deliveries) + 1))
            continue
        following = next(pending, None)
        if following is not None:
            open_[i] = iter(following)
        else:
            open_[i] = open_[-1]
            open_.pop()
    return deliveries


@dataclass(frozen=True, slots=True)
class Run:
    plans: float  # seconds planning, in all
    commits: list[float]  # seconds per commit
    loads: float  # seconds reading every handoff back, in all
    size: int  # bytes, checkpointed
    rows: int  # events rows
    tables: list[tuple[str, int, int, int]]  # (name, bytes, payload bytes, unused bytes)


def write(path: Path, deliveries: Sequence[Delivery], batch_size: int, sync: str) -> Run:
    """Write the traffic to a new log at `path` as the worker would, and measure it."""
    plans, commits = asyncio.run(_write(path, deliveries, batch_size, sync))
    loads = asyncio.run(_load(path, {uuid.UUID(d.subject.rsplit(".", 1)[1]) for d in deliveries}))
    with closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (rows,) = db.execute("SELECT count(*) FROM events").fetchone()
        tables = _tables(db)
    return Run(plans, commits, loads, path.stat().st_size, int(rows), tables)


async def _write(
    path: Path, deliveries: Sequence[Delivery], batch_size: int, sync: str
) -> tuple[float, list[float]]:
    planner = Planner(_SUBJECTS, batch_size, _ACK_WAIT_S)
    log = await EventLog.open(path, sync)
    plans = 0.0
    commits: list[float] = []
    marks: list[tuple[uuid.UUID, int]] = []  # the last batch's actions, published meanwhile
    clock = time.perf_counter
    try:
        for first in range(0, len(deliveries), batch_size):
            batch = deliveries[first : first + batch_size]
            planning = clock()
            decoded = planner.decode(batch)
            missing = planner.missing(decoded)
            loaded = await log.load(missing) if missing else {}
            now = now_ms()
            plan = planner.plan(batch, decoded, loaded, now, time.time())
            plans += clock() - planning
            if plan.rejections or plan.naks or plan.duplicates:
                raise SystemExit(f"the traffic went wrong: {plan.reasons}")
            for handoff_id, seq in marks:
                plan.batch.mark_published(handoff_id, seq, now)
            began = clock()
            await log.commit(plan.batch)
            commits.append(clock() - began)
            marks = [(action.handoff_id, seq) for _, seq, action in plan.publish]
        if marks:  # the last batch's marks, as the worker's drain commits them
            last = Batch()
            for handoff_id, seq in marks:
                last.mark_published(handoff_id, seq, now_ms())
            await log.commit(last)
    finally:
        await log.close()
    return plans, commits


async def _load(path: Path, handoff_ids: set[uuid.UUID]) -> float:
    log = await EventLog.open(path)
    ids = sorted(handoff_ids)
    try:
        began = time.perf_counter()
        for first in range(0, len(ids), 500):
            loaded = await log.load(ids[first : first + 500])
            Planner(_SUBJECTS, 1, _ACK_WAIT_S).adopt(loaded.values(), Batch(), 0)
        return time.perf_counter() - began
    finally:
        await log.close()


def _tables(db: sqlite3.Connection) -> list[tuple[str, int, int, int]]:
    """Bytes per table and index, from SQLite's dbstat (absent from some builds)."""
    try:
        found = db.execute(
            "SELECT name, sum(pgsize), sum(payload), sum(unused) FROM dbstat"
            " GROUP BY name ORDER BY sum(pgsize) DESC"
        ).fetchall()
    except sqlite3.OperationalError:
        return []
    return [(str(n), int(size), int(payload), int(unused)) for n, size, payload, unused in found]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=20_000, help="success handoffs written")
    parser.add_argument("--window", type=int, default=256, help="handoffs in flight")
    parser.add_argument("--batch-size", type=int, default=512, help="inputs per group commit")
    parser.add_argument("--runs", type=int, default=3, help="runs (times are medians)")
    parser.add_argument("--synchronous", default="FULL", choices=["FULL", "NORMAL"])
    parser.add_argument("--keep", type=Path, help="keep the last run's log at this path")
    args = parser.parse_args(argv)
    if min(args.handoffs, args.window, args.batch_size, args.runs) < 1:
        parser.error("--handoffs, --window, --batch-size and --runs must be at least 1")

    deliveries = traffic(args.handoffs, args.window)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="kvhandoff-log-size-") as scratch:
        for i in range(args.runs):
            path = Path(scratch) / f"run-{i}.sqlite3"
            runs.append(write(path, deliveries, args.batch_size, args.synchronous))
            if args.keep is not None and i == args.runs - 1:
                shutil.copyfile(path, args.keep)
            path.unlink()
    if len({(r.size, r.rows) for r in runs}) != 1:
        raise SystemExit("runs wrote different logs")
    n = args.handoffs
    last = runs[-1]
    batches = len(last.commits)
    per_batch_ms = statistics.median(statistics.median(r.commits) for r in runs) * 1e3
    per_handoff_us = statistics.median(sum(r.commits) for r in runs) / n * 1e6
    plan_us = statistics.median(r.plans for r in runs) / n * 1e6
    load_us = statistics.median(r.loads for r in runs) / n * 1e6
    print(
        f"python {sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}, {n:,} handoffs,"
        f" {len(deliveries):,} inputs in {batches:,} batches of up to {args.batch_size},"
        f" window {args.window}, synchronous={args.synchronous}, {args.runs} runs,"
        f" load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"bytes/handoff {last.size / n:,.0f}   rows/handoff {last.rows / n:.1f}"
        f"   commit ms/batch {per_batch_ms:.2f} (median)   commit us/handoff {per_handoff_us:.0f}"
        f"   plan us/handoff {plan_us:.0f}   load us/handoff {load_us:.0f}"
    )
    if last.tables:
        print(f"{'table or index':<32} {'bytes/handoff':>13} {'payload':>8} {'fill':>5}")
        for name, size, payload, unused in last.tables:
            fill = 1 - unused / size if size else 0.0
            print(f"{name:<32} {size / n:>13,.0f} {payload / n:>8,.0f} {fill:>5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
