"""`kvhandoff load`: start handoffs, wait for each to end, report throughput, latency and leaks.

Exits 0 when every handoff ended with a `Complete` (completed or canceled) and no engine reports
a leak, 1 otherwise or when NATS cannot be reached, 2 on invalid options or when NATS refuses our
credentials or TLS (one line naming the setting to check). A progress bar runs
while it works if stdout is a terminal (not with `--quiet`); a summary table follows, and
`--json PATH` (or `-` for stdout) writes the report as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvhandoff.client import BusUnavailable
from kvhandoff.worker.clock import DURATION_HELP, duration_arg
from kvhandoff.worker.commands.engines import (
    add_roster_arguments,
    bus_unavailable,
    print_leaks,
    roster,
)
from kvhandoff.worker.config import add_nats_arguments, nats_settings
from kvhandoff.worker.errors import ConfigError
from kvhandoff.worker.loadgen.generator import LoadConfig, LoadProgress, LoadReport, run_load
from kvhandoff.worker.logging_setup import configure_logging


def configure(parser: argparse.ArgumentParser) -> None:
    add_nats_arguments(parser)
    add_roster_arguments(parser)
    load = parser.add_argument_group("load", f"DURATION is {DURATION_HELP}.")
    load.add_argument("--handoffs", type=int, required=True, help="how many handoffs to start")
    pacing = load.add_mutually_exclusive_group()
    pacing.add_argument(
        "--concurrency",
        type=int,
        default=LoadConfig.concurrency,
        help="closed loop: handoffs open at once (default %(default)s)",
    )
    pacing.add_argument("--rate", type=float, help="open loop: handoffs started per second")
    load.add_argument(
        "--cancel-share",
        type=float,
        default=0.0,
        help="share of handoffs the frontend cancels (default %(default)s)",
    )
    load.add_argument(
        "--cancel-within-ms",
        type=float,
        default=LoadConfig.cancel_within_ms,
        help="a cancel goes out a random 0..this after the start (default %(default)s)",
    )
    load.add_argument(
        "--deadline-ms",
        type=int,
        default=LoadConfig.deadline_ms,
        help="each StartHandoff's deadline (default %(default)s)",
    )
    load.add_argument(
        "--fallback-delay-ms",
        type=float,
        default=0.0,
        help="each StartHandoff's transfer delay when there is no bandwidth model",
    )
    load.add_argument(
        "--wait-timeout",
        type=duration_arg,
        metavar="DURATION",
        help="a handoff with no Complete by then is timed out (default: deadline + 30 s)",
    )
    load.add_argument(
        "--settle-timeout",
        type=duration_arg,
        metavar="DURATION",
        default=f"{LoadConfig.settle_timeout_s:g}s",
        help="how long to wait for the engines to free all but running decodes (default "
        "%(default)s)",
    )
    load.add_argument(
        "--wait-for-engines",
        type=duration_arg,
        metavar="DURATION",
        help="first wait up to this long until every engine of the roster listens (the first "
        "actions sent to an engine that starts late wait out the worker's retry interval)",
    )
    load.add_argument("--seed", type=int, default=0, help="routing and cancel seed")
    output = parser.add_argument_group("output")
    output.add_argument("--json", metavar="PATH", help="write the report as JSON ('-': stdout)")
    output.add_argument("--quiet", action="store_true", help="no progress bar")
    output.add_argument("--log-format", choices=["text", "json"], default="text")
    output.add_argument("--log-level", type=str.upper, default="WARNING")


def execute(args: argparse.Namespace) -> int:
    try:
        config = LoadConfig(
            nats=nats_settings(args),
            handoffs=args.handoffs,
            concurrency=args.concurrency,
            rate_per_s=args.rate,
            cancel_share=args.cancel_share,
            cancel_within_ms=args.cancel_within_ms,
            roster=roster(args),
            deadline_ms=args.deadline_ms,
            fallback_delay_ms=args.fallback_delay_ms,
            wait_timeout_s=args.wait_timeout,
            settle_timeout_s=args.settle_timeout,
            engines_wait_s=args.wait_for_engines,
            seed=args.seed,
        )
    except ConfigError as exc:
        print(f"kvhandoff load: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    console = Console()
    show_progress = not args.quiet and sys.stdout.isatty()
    try:
        report = asyncio.run(run_with_progress(config, console if show_progress else None))
    except BusUnavailable as exc:
        return bus_unavailable("load", exc)
    if args.json != "-":
        print_summary(report, console)
    if args.json is not None:
        document = msgspec.json.format(msgspec.json.encode(report), indent=2)
        if args.json == "-":
            sys.stdout.buffer.write(document + b"\n")
        else:
            Path(args.json).write_bytes(document + b"\n")
    return 0 if report.ok else 1


async def run_with_progress(
    config: LoadConfig,
    console: Console | None,
    on_progress: Callable[[LoadProgress], None] | None = None,
) -> LoadReport:
    """Run the load, with a progress bar on `console` if one is given; `on_progress` is also
    told the counts each time a handoff ends (the cluster demo's cue to strike midway)."""
    if console is None:
        return await run_load(config, progress=on_progress)
    columns = (
        TextColumn("handoffs"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("handoffs", total=config.handoffs, counts="")

        def update(progress: LoadProgress) -> None:
            counts = (
                f"completed {progress.completed}  canceled {progress.canceled}  "
                f"timed out {progress.timed_out}  rejected {progress.rejected}"
            )
            bar.update(task, completed=progress.ended, counts=counts)
            if on_progress is not None:
                on_progress(progress)

        return await run_load(config, progress=update)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def print_summary(report: LoadReport, console: Console) -> None:
    table = Table(title="load", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("handoffs", str(report.handoffs)),
        ("completed", str(report.completed)),
        ("canceled", str(report.canceled)),
        ("timed out", str(report.timed_out)),
        ("rejected", str(report.rejected)),
        # What the log holds, after any Complete that came after a handoff's end.
        ("final: succeeded", str(report.final.succeeded)),
        ("final: canceled", str(report.final.canceled)),
        ("reopened (success, then canceled)", str(report.reopened)),
        ("leaks", str(report.leaks)),
        ("throughput", f"{report.throughput_per_s:.1f} /s"),
        ("latency p50", _ms(report.latency_ms.p50)),
        ("latency p90", _ms(report.latency_ms.p90)),
        ("latency p99", _ms(report.latency_ms.p99)),
        ("duration", f"{report.duration_s:.2f} s"),
        ("frontend cancels sent", str(report.cancels_sent)),
        ("other inputs rejected", str(report.input_rejections)),
        ("extra completions", str(report.extra_completions)),
        (
            "engine processes",
            f"{report.engine_processes}" + ("" if report.engines_settled else " (not settled)"),
        ),
    ]
    for what, value in rows:
        table.add_row(what, value)
    console.print(table)
    if report.leak_details:
        print_leaks(report.leak_details, console)
    if report.unreported:
        console.print(
            f"not counted: {', '.join(report.unreported)} did not report, so their leaks are"
            " unknown",
            soft_wrap=True,
        )
    console.print("ok" if report.ok else "NOT ok: some handoffs did not end, or engines leak")
