"""Replay speed of `kvhandoff verify` over a large event log, beside a bare read of the same rows.

Run as `python bench/replay.py [--events N] [--runs N] [--db PATH]`.

The log
-------
At least `--events` events (default 1,000,000), written by the worker's own writer
(`worker.log.store.EventLog` and `Batch`, so in the layout this build writes) from copies of the
golden log (`tests/tools/golden/v2/log.sqlite3`): each copy of each golden handoff gets a fresh
id and shifted times, so the mix of orders, successes, cancels, failures, timeouts and open
handoffs is the golden one (about ten events per handoff). The file is kept at `--db` and
reused while it holds enough events (delete it after a change of layout).

What is measured
----------------
- ``bare read``: `SELECT type, at_ms, record FROM events ORDER BY handoff_key, seq`, and per
  row the record put back together (`events.codec.join_record`, with any handoff id) and one
  msgpack decode into a `LogRecord`, with a decoder built for the purpose: the floor any replay
  of this table pays, in the same process, on the same file, in the same run.
- ``verify``: `worker.commands.verify.verify_log` over the whole log, the exact work of
  `kvhandoff verify LOG` minus printing: one ordered scan of the events beside one of the
  handoffs' ids (`worker.log.reader.SqliteLog.scan`), every record put back together, grouped by
  handoff, a fresh coordinator per handoff, every input decoded through the codec's upcasting
  `decode_record` and re-applied, and every logged action compared with the re-derived one (by
  its bytes, decoding only on a difference: `events.replay.check_stored`). A layout-2 log keeps
  no input digests, so none is recomputed or compared (a layout-1 log's verify does both).
- ``timeline``: `events.replay.timeline` (the `replay` command's data, with a state snapshot
  and diff per step) over the first `--timeline` handoffs, for scale; it is not on the hot path.

Every figure is the median of `--runs` runs (default 5) after one warm-up of each, alternating
the two so that both see the same page cache and machine load. Both wall-clock and process CPU
seconds are reported: on a shared machine the CPU figures move far less. The ratio verify/bare
(events per second) is the figure to watch across commits; the target is 0.5 or more.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

# Runnable from a checkout (`python bench/replay.py`) without installing the package.
_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))

from kvhandoff.events.codec import join_record  # noqa: E402
from kvhandoff.events.records import ActionRecord, InputRecord, LogRecord  # noqa: E402
from kvhandoff.events.replay import timeline  # noqa: E402
from kvhandoff.worker.commands.verify import verify_log  # noqa: E402
from kvhandoff.worker.log.reader import SqliteLog  # noqa: E402
from kvhandoff.worker.log.rows import Batch, HandoffLog, HandoffRow  # noqa: E402
from kvhandoff.worker.log.store import EventLog  # noqa: E402

GOLDEN = _ROOT / "tests" / "tools" / "golden" / "v2" / "log.sqlite3"
BARE_QUERY = "SELECT type, at_ms, record FROM events ORDER BY handoff_key, seq"


def _rekeyed(log: HandoffLog, handoff_id: uuid.UUID, shift_ms: int, batch: Batch) -> None:
    """Append a copy of a golden handoff under a new id, `shift_ms` later."""
    replace = msgspec.structs.replace
    for e in log.events:
        record: LogRecord = e.record
        at_ms = e.at_ms + shift_ms
        if isinstance(record, InputRecord):
            message = replace(record.input, handoff_id=handoff_id)
            batch.append_input(e.seq, InputRecord(at_ms, message))
        else:
            action = replace(record.action, handoff_id=handoff_id)
            batch.append_action(e.seq, ActionRecord(at_ms, action))
    row = log.handoff
    assert row.state is not None  # the golden handoffs' states are all known
    completed = row.completed_at_ms
    batch.upsert_handoff(
        HandoffRow(
            handoff_id,
            row.engine_type,
            row.source,
            row.destination,
            row.started_at_ms + shift_ms,
            row.deadline_at_ms + shift_ms,
            row.state,
            None if completed is None else completed + shift_ms,
            row.last_seq,
            row.updated_at_ms + shift_ms,
        )
    )


async def _write(path: Path, templates: list[HandoffLog], copies: int) -> None:
    log = await EventLog.open(path, synchronous="NORMAL")
    try:
        per_batch = 500
        for first in range(0, copies, per_batch):
            batch = Batch()
            for copy in range(first, min(first + per_batch, copies)):
                for k, template in enumerate(templates):
                    handoff_id = uuid.UUID(int=copy * len(templates) + k + 1)
                    _rekeyed(template, handoff_id, copy * 1_000, batch)
            await log.commit(batch)
    finally:
        await log.close()


def _count_events(path: Path) -> int:
    if not path.exists():
        return 0
    with sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True) as db:
        try:
            (n,) = db.execute("SELECT count(*) FROM events").fetchone()
        except sqlite3.Error:
            return 0
    return int(n)


def ensure_log(path: Path, events: int) -> tuple[int, int]:
    """Build the log unless `path` already holds enough events; (events, handoffs)."""
    if _count_events(path) < events:
        path.unlink(missing_ok=True)
        with SqliteLog(GOLDEN) as golden:
            templates = [golden.load(h.handoff_id) for h in golden.handoffs()]
        per_copy = sum(len(t.events) for t in templates)
        copies = -(-events // per_copy)
        t0 = time.perf_counter()
        asyncio.run(_write(path, templates, copies))
        print(f"wrote {path} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    with sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True) as db:
        (n_events,) = db.execute("SELECT count(*) FROM events").fetchone()
        (n_handoffs,) = db.execute("SELECT count(*) FROM handoffs").fetchone()
    return int(n_events), int(n_handoffs)


@dataclass(frozen=True)
class Timing:
    wall: float
    cpu: float
    events: int


def _timed(work: Callable[[], int]) -> Timing:
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    events = work()
    return Timing(time.perf_counter() - wall, time.process_time() - cpu, events)


def run_bare(path: Path) -> Timing:
    """Read and decode every record in replay order."""
    decode = msgspec.msgpack.Decoder(LogRecord).decode
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)

    def work() -> int:
        n = 0
        handoff_id = bytes(16)
        for code, at_ms, fields in db.execute(BARE_QUERY):
            decode(join_record(handoff_id, code, at_ms, fields))
            n += 1
        return n

    try:
        return _timed(work)
    finally:
        db.close()


def run_verify(path: Path) -> Timing:
    """`verify_log` over the whole log."""
    with SqliteLog(path) as log:
        report = None

        def work() -> int:
            nonlocal report
            report = verify_log(log)
            return report.events

        timing = _timed(work)
    assert report is not None
    if report.diverged:
        raise SystemExit(f"verify found divergences: {report.diverged[0]}")
    return timing


def run_timeline(path: Path, handoffs: int) -> tuple[Timing, int]:
    """The timelines of the first `handoffs` handoffs, already read and decoded."""
    with SqliteLog(path) as log:
        logs = [log.load(h.handoff_id).records() for h in log.handoffs()[:handoffs]]

    def work() -> int:
        for records in logs:
            timeline(records)
        return sum(map(len, logs))

    return _timed(work), len(logs)


@dataclass(frozen=True)
class Figure:
    name: str
    wall: float
    cpu: float
    events: int
    handoffs: int

    @classmethod
    def median(cls, name: str, timings: Sequence[Timing], handoffs: int) -> Figure:
        events = {t.events for t in timings}
        assert len(events) == 1, f"{name}: runs saw different logs"
        wall = statistics.median(t.wall for t in timings)
        cpu = statistics.median(t.cpu for t in timings)
        return cls(name, wall, cpu, events.pop(), handoffs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="events in the log")
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--timeline", type=int, default=10_000, help="handoffs for timeline")
    parser.add_argument(
        "--db",
        type=Path,
        default=Path(tempfile.gettempdir()) / "kvhandoff-bench-replay.sqlite3",
        help="where the log is kept between runs",
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.events < 1:
        parser.error("--runs and --events must be at least 1")

    n_events, n_handoffs = ensure_log(args.db, args.events)
    run_bare(args.db)  # warm-ups: page cache, imports, allocator
    run_verify(args.db)
    bare_runs: list[Timing] = []
    verify_runs: list[Timing] = []
    for _ in range(args.runs):
        bare_runs.append(run_bare(args.db))
        verify_runs.append(run_verify(args.db))
    bare = Figure.median("bare read", bare_runs, n_handoffs)
    verify = Figure.median("verify", verify_runs, n_handoffs)
    assert bare.events == verify.events == n_events
    tl_timing, tl_handoffs = run_timeline(args.db, args.timeline)
    tl = Figure.median("timeline", [tl_timing], tl_handoffs)

    print(
        f"python {sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}, "
        f"{n_events:,} events in {n_handoffs:,} handoffs, {args.runs} runs, medians"
    )
    header = (
        f"{'':<10} {'wall s':>7} {'cpu s':>7} {'events/s':>11} {'handoffs/s':>11} "
        f"{'x bare':>7} {'x bare cpu':>10}"
    )
    print(header)
    print("-" * len(header))
    for f in (bare, verify, tl):
        # Rates per event, so that the timeline's subset compares with the whole-log figures.
        wall_ratio = (f.events / f.wall) / (bare.events / bare.wall)
        cpu_ratio = (f.events / f.cpu) / (bare.events / bare.cpu)
        print(
            f"{f.name:<10} {f.wall:>7.3f} {f.cpu:>7.3f} {f.events / f.wall:>11,.0f} "
            f"{f.handoffs / f.wall:>11,.0f} {wall_ratio:>7.2f} {cpu_ratio:>10.2f}"
        )
    print(
        f"verify/bare events per second: {bare.wall / verify.wall:.2f} wall-clock, "
        f"{bare.cpu / verify.cpu:.2f} CPU (target >= 0.50)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
