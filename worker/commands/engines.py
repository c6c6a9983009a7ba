"""`kvhandoff engines`: mock source and destination engines on the bus, until SIGINT or SIGTERM.

On stop it prints each engine's accounting and the leaks it found, and exits 0 if there were
none, 1 otherwise. A NATS that is not up yet is waited for (a signal ends the wait, exit 1); one
that refuses our credentials or TLS ends the command at once with exit 2 and one line naming the
setting to check, as for the worker. The roster options (`--engine-types`, `--sources`,
`--destinations`) are also the load generator's, so that both name the same engines.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from rich.console import Console
from rich.table import Table

from kvhandoff.client import BusUnavailable, Connection, Refused
from kvhandoff.client.lease import DEFAULT_LEASE_TTL_S
from kvhandoff.events.messages import EngineType, KvTransferTimingMode
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.config import add_nats_arguments, nats_settings
from kvhandoff.worker.engines import (
    DEFAULT_DESTINATIONS,
    DEFAULT_ENGINE_TYPES,
    DEFAULT_SOURCES,
    EngineModel,
    EnginesConfig,
    EnginesReport,
    Faults,
    Leak,
    MockEngines,
    Roster,
)
from kvhandoff.worker.errors import ConfigError
from kvhandoff.worker.logging_setup import configure_logging


def _engine_types(text: str) -> tuple[EngineType, ...]:
    try:
        return tuple(EngineType(name.strip()) for name in text.split(",") if name.strip())
    except ValueError as exc:
        choices = ",".join(EngineType)
        raise argparse.ArgumentTypeError(f"{exc}; choose from {choices}") from exc


def _prompt_range(text: str) -> tuple[int, int]:
    shortest, _, longest = text.partition(":")
    try:
        return int(shortest), int(longest or shortest)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX tokens, got {text!r}") from exc


def add_roster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engines")
    group.add_argument(
        "--engine-types",
        type=_engine_types,
        default=DEFAULT_ENGINE_TYPES,
        help=f"comma-separated engine types (default {','.join(DEFAULT_ENGINE_TYPES)})",
    )
    group.add_argument(
        "--sources",
        type=int,
        default=DEFAULT_SOURCES,
        help="prefill engines <type>-prefill-<i> per type (default %(default)s)",
    )
    group.add_argument(
        "--destinations",
        type=int,
        default=DEFAULT_DESTINATIONS,
        help="decode engines <type>-decode-<i> per type (default %(default)s)",
    )


def roster(args: argparse.Namespace) -> Roster:
    """The roster the options name; `ConfigError` if it is empty."""
    return Roster(args.engine_types, args.sources, args.destinations)


def _add_field_option(
    group: argparse._ArgumentGroup, defaults: EngineModel | Faults, name: str, help: str
) -> None:
    """`--<name>` for one field of the model or the faults, typed and defaulted by the field, so
    that an option cannot drift from the field it sets."""
    default = getattr(defaults, name)
    group.add_argument(
        f"--{name.replace('_', '-')}", type=type(default), default=default, help=help
    )


def configure(parser: argparse.ArgumentParser) -> None:
    add_nats_arguments(parser)
    add_roster_arguments(parser)
    defaults = EngineModel()
    model = parser.add_argument_group("model (durations are divided by --speedup)")
    _add_field_option(model, defaults, "block_size", "tokens per KV block (default %(default)s)")
    _add_field_option(model, defaults, "kv_blocks", "KV blocks per engine (default %(default)s)")
    _add_field_option(
        model, defaults, "max_slots", "handoffs an engine holds at once (default %(default)s)"
    )
    model.add_argument(
        "--prompt-tokens",
        type=_prompt_range,
        default=(defaults.shortest_prompt, defaults.longest_prompt),
        metavar="MIN:MAX",
        help="prompt length range; derived from each handoff id, so give every engine process "
        f"the same range (default {defaults.shortest_prompt}:{defaults.longest_prompt})",
    )
    _add_field_option(
        model, defaults, "prefill_tokens_per_s", "prefill speed (default %(default)s)"
    )
    _add_field_option(
        model, defaults, "decode_ms", "decode time after activation (default %(default)s)"
    )
    _add_field_option(
        model, defaults, "kv_bytes_per_token", "reported in SourceHeld (default %(default)s)"
    )
    _add_field_option(
        model, defaults, "bandwidth_gb_s", "reported in SourceHeld (default %(default)s)"
    )
    model.add_argument(
        "--timing-mode",
        type=KvTransferTimingMode,
        choices=list(KvTransferTimingMode),
        default=defaults.timing_mode,
        help="reported in SourceHeld (default %(default)s)",
    )
    _add_field_option(
        model, defaults, "speedup", "divide prefill, transfer and decode times by this (default 1)"
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=DEFAULT_LEASE_TTL_S,
        metavar="SECONDS",
        help="each engine's lease on its id (docs/leases.md): the tier answers for an engine "
        "that has not renewed it for this long; 0 takes no lease (default %(default)s)",
    )
    parser.add_argument(
        "--leave-out",
        action="append",
        default=[],
        metavar="ENGINE_ID",
        help="an engine id of the roster that another process serves (repeatable)",
    )
    fault_defaults = Faults()
    faults = parser.add_argument_group("faults (seeded, wall-clock)")
    _add_field_option(
        faults,
        fault_defaults,
        "fail_rate",
        "share of forward actions that fail, as an outcome or a Failed fact",
    )
    _add_field_option(
        faults,
        fault_defaults,
        "drop_rate",
        "share of action receipts ignored (the worker's retry recovers)",
    )
    _add_field_option(
        faults, fault_defaults, "duplicate_rate", "share of outcomes and facts published twice"
    )
    _add_field_option(
        faults,
        fault_defaults,
        "delay_ms",
        "random extra delay, up to this, before answering an action",
    )
    _add_field_option(
        faults,
        fault_defaults,
        "silent",
        "engines per type and role (indexes 0..N-1) that stop answering",
    )
    _add_field_option(
        faults,
        fault_defaults,
        "silent_ms",
        "how long a silent engine ignores actions, from its first one (default %(default)s)",
    )
    _add_field_option(faults, fault_defaults, "seed", "fault seed (default %(default)s)")
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-format", choices=["text", "json"], default="text")
    logs.add_argument("--log-level", type=str.upper, default="INFO")


def bus_unavailable(command: str, exc: BusUnavailable) -> int:
    """Say on stderr why `kvhandoff <command>` could not use the bus; the exit status: 2 if NATS
    refused our credentials or TLS (a setting to fix, not worth retrying), 1 if it never
    answered."""
    print(f"kvhandoff {command}: {exc}", file=sys.stderr)
    return 2 if isinstance(exc, Refused) else 1


def execute(args: argparse.Namespace) -> int:
    try:
        settings = nats_settings(args)
        config = EnginesConfig(
            roster=roster(args),
            left_out=frozenset(args.leave_out),
            lease_ttl_s=args.lease_ttl or None,
            model=EngineModel(
                block_size=args.block_size,
                kv_blocks=args.kv_blocks,
                max_slots=args.max_slots,
                shortest_prompt=args.prompt_tokens[0],
                longest_prompt=args.prompt_tokens[1],
                prefill_tokens_per_s=args.prefill_tokens_per_s,
                decode_ms=args.decode_ms,
                kv_bytes_per_token=args.kv_bytes_per_token,
                bandwidth_gb_s=args.bandwidth_gb_s,
                timing_mode=args.timing_mode,
                speedup=args.speedup,
            ),
            faults=Faults(
                seed=args.seed,
                fail_rate=args.fail_rate,
                drop_rate=args.drop_rate,
                duplicate_rate=args.duplicate_rate,
                delay_ms=args.delay_ms,
                silent=args.silent,
                silent_ms=args.silent_ms,
            ),
        )
    except ConfigError as exc:
        print(f"kvhandoff engines: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    try:
        report = asyncio.run(serve(settings, config))
    except BusUnavailable as exc:
        return bus_unavailable("engines", exc)
    if report is None:
        return 1
    print_report(report, Console())
    return 0 if not report.leaks else 1


async def serve(settings: NatsSettings, config: EnginesConfig) -> EnginesReport | None:
    """Run the engines until SIGINT or SIGTERM; their final report, or None if NATS never
    answered before the signal."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    connection = await Connection.open_unless(stop, settings, "kvhandoff-engines")
    if connection is None:
        return None
    async with connection:
        engines = MockEngines(connection, config)
        await engines.start()
        await stop.wait()
        return await engines.stop()


def print_report(report: EnginesReport, console: Console) -> None:
    table = Table(title=f"mock engines ({report.process})")
    table.add_column("engine")
    for column in ("blocks", "decoding", "waiting", "executed", "repeated"):
        table.add_column(column, justify="right")
    table.add_column("faults")
    for status in report.engines:
        counters = status.counters
        faults = {
            "dropped": counters.dropped,
            "ignored": counters.ignored,
            "delayed": counters.delayed,
            "duplicated": counters.duplicated,
            "failed": counters.injected_failures,
        }
        table.add_row(
            status.engine_id + (" (silent)" if status.silent else ""),
            f"{status.blocks_held}/{status.blocks_total}",
            str(status.blocks_decoding),
            str(status.waiting),
            str(counters.executed),
            str(counters.repeated),
            ", ".join(f"{name} {count}" for name, count in faults.items() if count) or "-",
        )
    console.print(table)
    print_leaks(report.leaks, console)


def print_leaks(leaks: list[Leak], console: Console) -> None:
    """One plain line per leak, so the handoff id is never cut and the lines can be grepped."""
    if not leaks:
        console.print("no leaks")
        return
    console.print(f"{len(leaks)} leaks (held for handoffs the worker completed):")
    for leak in leaks:
        what = "waits for blocks" if leak.waiting else f"holds {leak.blocks} blocks"
        console.print(
            f"leak: {leak.engine_id} {what} for handoff {leak.handoff_id} ({leak.state})",
            soft_wrap=True,
            highlight=False,
        )
