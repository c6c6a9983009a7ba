"""`kvhandoff schema`: the JSON Schema of every message on the bus."""

from __future__ import annotations

import argparse
import json

from kvhandoff.events.codec import wire_schema
from kvhandoff.worker.commands import _offline


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--indent", type=int, default=2)


@_offline.printing_command
def execute(args: argparse.Namespace) -> int:
    print(json.dumps(wire_schema(), indent=args.indent, sort_keys=True))
    return 0
