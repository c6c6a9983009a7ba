"""What both demos (`kvhandoff demo`, on one worker, and `kvhandoff demo --cluster`, on a tier
of workers) do the same way: the mock engines as one child process, waiting until they answer
(and until an external engine listens), the load of handoffs with its progress bar and summary,
and the closing lines that point at the event log.

The two differ in what runs under the engines (worker.commands.demo runs one worker on one
embedded nats-server, worker.commands._demo_cluster three workers on a three-node cluster, of
which it kills a worker and a node midway).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from kvhandoff.client import Connection
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.commands.load import run_with_progress
from kvhandoff.worker.engines import Roster, request_reports
from kvhandoff.worker.errors import ChildError
from kvhandoff.worker.harness.child import Child
from kvhandoff.worker.loadgen.generator import LoadConfig, LoadProgress, LoadReport
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.log.schema import HandoffState

READY_TIMEOUT_S = 30.0


def faults() -> list[str]:
    """The faults the engines inject: frequent enough that every path shows up in a few
    thousand handoffs, rare enough that most complete; modelled times sped up 20x. A dropped
    action is one the worker publishes again after its retry interval."""
    return [
        "--speedup",
        "20",
        "--fail-rate",
        "0.02",
        "--drop-rate",
        "0.02",
        "--duplicate-rate",
        "0.02",
        "--delay-ms",
        "20",
    ]


def engines_child(
    url: str,
    folder: Path,
    args: argparse.Namespace,
    engine_faults: list[str],
    *,
    left_out: Sequence[str] = (),
    name: str = "engines",
) -> Child:
    """`kvhandoff engines` on `url`, leaving out `--external-engine` and `left_out`, logging to
    the folder; in a session of its own, so that Ctrl-C reaches only the demo, which stops its
    children in order."""
    external = [] if args.external_engine is None else [args.external_engine]
    leave_out = [arg for engine in (*external, *left_out) for arg in ("--leave-out", engine)]
    return Child(
        [
            sys.executable,
            "-m",
            "kvhandoff.worker.cli",
            "engines",
            "--nats-url",
            url,
            "--seed",
            str(args.seed),
            *engine_faults,
            *leave_out,
        ],
        folder / f"{name}.log",
        name=f"the {name}",
        new_session=True,
    )


async def engines_ready(url: str, engines: Child, console: Console, external: str | None) -> None:
    """Until the mock engines answer a report request, and the external engine (if any)
    listens; `ChildError` if the engines exit or do not answer in time. Ctrl-C gives up."""
    async with await Connection.open(NatsSettings(url=url), "kvhandoff-demo") as connection:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not await request_reports(connection):
            if not engines.running():
                raise ChildError("the engines exited; see engines.log")
            if time.monotonic() > deadline:
                raise ChildError(
                    f"the engines did not answer within {READY_TIMEOUT_S:.0f}s; see engines.log"
                )
        if external is None:
            return
        role = "destination" if "-decode-" in external else "source"
        console.print(
            f"waiting for engine {external}; run:  python examples/engine.py "
            f"--nats-url {url} {role} {external}",
            soft_wrap=True,
        )
        while not await connection.engine_listening(external):
            pass  # each presence probe waits a second for an answer


def load_config(
    url: str, args: argparse.Namespace, handoffs: int, *, wait_timeout_s: float | None = None
) -> LoadConfig:
    """The demo's load: every engine type, its share of frontend cancels, the seed."""
    return LoadConfig(
        nats=NatsSettings(url=url),
        handoffs=handoffs,
        concurrency=args.concurrency,
        cancel_share=args.cancel_share,
        roster=Roster(),
        deadline_ms=5_000,
        wait_timeout_s=wait_timeout_s,
        seed=args.seed,
    )


async def run_load(
    config: LoadConfig,
    args: argparse.Namespace,
    console: Console,
    on_progress: Callable[[LoadProgress], None] | None = None,
) -> LoadReport:
    """The load, with a progress bar on a terminal (not with `--quiet`)."""
    show = not args.quiet and sys.stdout.isatty()
    return await run_with_progress(config, console if show else None, on_progress)


def print_external(report: LoadReport, external: str | None, console: Console) -> None:
    """Whether the engine run outside the demo reported, and its leaks: the summary counts
    every engine, or says which it could not."""
    if external is None:
        return
    if external in report.unreported:
        console.print(
            f"external engine {external} did not report: its leaks are not counted "
            "(see docs/contract.md, Reports)",
            soft_wrap=True,
        )
        return
    leaks = sum(leak.engine_id == external for leak in report.leak_details)
    console.print(f"external engine {external}: reported, {leaks} leaks", soft_wrap=True)


def point_at_the_log(log_path: Path, console: Console) -> None:
    """Where the log is (a file, or a tier worker's data directory), and commands that read
    it: the replay of a canceled handoff, if there is one, and the list."""
    with open_log(log_path) as log:
        canceled = log.handoffs([HandoffState.CANCELED])
    # Whole lines, never wrapped, so they can be copied.
    console.print(f"\nevent log: {log_path}", soft_wrap=True)
    if canceled:
        handoff = canceled[0].handoff_id
        console.print(
            f"replay a canceled handoff:  kvhandoff replay {log_path} {handoff}", soft_wrap=True
        )
    console.print(f"list them all:              kvhandoff list {log_path}", soft_wrap=True)
