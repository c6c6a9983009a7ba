"""The `kvhandoff` command line: a table of subcommands, each imported only when chosen."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module under worker.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "run the worker: NATS in, SQLite event log, actions out"),
    "demo": ("demo", "embedded NATS + worker + mock engines + load, then a summary"),
    "engines": ("engines", "run mock source and destination engines on the bus"),
    "load": ("load", "start handoffs, wait for each to end, report throughput and latency"),
    "list": ("list", "list handoffs in an event log"),
    "stuck": ("stuck", "open handoffs that wait, and what each waits for"),
    "replay": ("replay", "the timeline of one handoff, step by step"),
    "verify": ("verify", "re-derive every logged action and compare"),
    "export": ("export", "write one handoff's log as self-contained JSONL"),
    "compact": ("compact", "remove completed handoffs and rejections older than an age"),
    "conformance": ("conformance", "run reference conformance vectors through the coordinator"),
    "engine-check": (
        "engine_check",
        "hold an engine to the wire contract, rule by rule",
    ),
    "schema": ("schema", "print the JSON Schema of the wire vocabulary"),
    "sim": ("sim", "the deterministic simulation of the tier: run seeds, replay one"),
    "health": ("health", "exit 0 if the local worker answers its health endpoint"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvhandoff", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(f"kvhandoff.worker.commands.{module_name}")
            module.configure(command)
            command.set_defaults(execute=module.execute)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(args_list).parse_args(args_list)
    code: int = args.execute(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
