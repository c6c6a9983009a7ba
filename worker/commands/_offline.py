"""What the offline log commands (list, stuck, replay, verify, export, compact) share on the
command line: the log argument, times and ages as arguments, `--json`/`--print-schema`,
turning the errors they expect into a one-line message and exit status 2, and printing to a
reader that may stop reading.

Exit status: 0 success, 1 the check failed (`verify` found something wrong), 2 the command
could not do its job (no such file or handoff, an unreadable log, a bad argument). A reader
that stops reading (`kvhandoff list LOG | head`) is not a failure: the rest of the output is
dropped, silently, and the status is what the command's work made it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from kvhandoff.events.errors import HandoffError
from kvhandoff.worker.ambient import now_ms
from kvhandoff.worker.clock import parse_duration_ms
from kvhandoff.worker.commands import _text
from kvhandoff.worker.errors import ConfigError, WorkerError
from kvhandoff.worker.log.reports import json_schema

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2


def parse_time_ms(text: str, now_ms: int) -> int:
    """An instant: milliseconds since the epoch (a whole number), ISO 8601 (UTC unless it says
    otherwise), or an age with a unit such as `10m` or `1h30m`, meaning that long before
    `now_ms`. A bare number is epoch milliseconds here, never an age in seconds."""
    stripped = text.strip()
    if stripped.isdigit():
        return int(stripped)
    # An age needs its unit: a bare number is an instant, never seconds ago.
    if not stripped.replace(".", "", 1).isdigit():
        try:
            return now_ms - parse_duration_ms(stripped)
        except ConfigError:
            pass
    try:
        moment = datetime.fromisoformat(stripped)
    except ValueError:
        raise ConfigError(
            f"not a time: {text!r} (epoch ms, ISO 8601, or an age such as 10m)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return round(moment.timestamp() * 1000)


def add_log_argument(parser: argparse.ArgumentParser, *, sqlite_only: bool = False) -> None:
    if sqlite_only:
        help_text = "the worker's SQLite event log"
    else:
        help_text = (
            "the worker's SQLite event log, a partitioned worker's data directory (all its"
            " partition-<p>.db files), or one handoff exported as JSONL"
        )
    parser.add_argument("log", type=Path, nargs="?", help=help_text)


def add_now_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--now",
        metavar="TIME",
        help="the time that ages are measured from (default: the clock), for reproducible output",
    )


def resolve_now(args: argparse.Namespace) -> int:
    if args.now is None:
        return now_ms()
    return parse_time_ms(args.now, now_ms())


def add_report_arguments(parser: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--print-schema", action="store_true", help="print the JSON Schema of the report and exit"
    )


def print_schema(name: str) -> None:
    print(msgspec.json.format(msgspec.json.encode(json_schema(name)), indent=2).decode())


def print_json(report: object) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(report), indent=2).decode())
    sys.stdout.write("\n")


@contextlib.contextmanager
def printing() -> Iterator[None]:
    """Print inside this block to a reader that may stop reading (`| head`).

    If it does, the rest of the output goes to /dev/null (as the Python docs advise), with no
    traceback, and the code after the block runs as usual: a command whose exit status says
    something (`verify`) computes it first and prints inside the block. stdout is flushed at
    the end of the block, where a pipe that closed is most often noticed.
    """
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def printing_command(
    execute: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Wrap a command that prints: a reader that stops reading leaves its status at 0."""

    @functools.wraps(execute)
    def run(args: argparse.Namespace) -> int:
        with printing():
            return execute(args)
        return EXIT_OK  # the reader stopped reading before the command finished printing

    return run


def offline_command(
    name: str,
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Wrap a command's `execute`: `--print-schema`, a missing log, expected errors, and a
    reader that stops reading (see `printing`)."""

    def wrap(execute: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(execute)
        @printing_command
        def run(args: argparse.Namespace) -> int:
            if getattr(args, "print_schema", False):
                print_schema(name)
                return EXIT_OK
            if args.log is None:
                return fail(name, "the log argument is required")
            try:
                return execute(args)
            except (WorkerError, HandoffError) as exc:
                return fail(name, str(exc))

        return run

    return wrap


def warn(name: str, message: str) -> None:
    """A line on stderr that does not stop the command."""
    print(f"kvhandoff {name}: warning: {_text.printable(message)}", file=sys.stderr)


def fail(name: str, message: str) -> int:
    print(f"kvhandoff {name}: {_text.printable(message)}", file=sys.stderr)
    return EXIT_ERROR
