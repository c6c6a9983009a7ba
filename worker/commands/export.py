"""`kvhandoff export LOG HANDOFF [-o FILE]`: one handoff's log as self-contained JSONL.

A header line (format name and version, the handoff's id and its `handoffs` row), then one
line per event: seq, at_ms, when it was published, and the record as JSON. Attach the file to
a bug report; `kvhandoff replay FILE.jsonl` (and `verify`, `list`, `stuck`) read it anywhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from worker.commands import _offline, _text
from worker.logreader import open_log, write_jsonl


def configure(parser: argparse.ArgumentParser) -> None:
    _offline.add_log_argument(parser)
    parser.add_argument("handoff", help="handoff id or a unique prefix")
    parser.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="write here instead of stdout"
    )


@_offline.offline_command("export")
def execute(args: argparse.Namespace) -> int:
    with open_log(args.log) as log:
        handoff = log.load(log.resolve(args.handoff))
    if args.output is None:
        write_jsonl(handoff, sys.stdout.buffer)
        sys.stdout.buffer.flush()
        return _offline.EXIT_OK
    try:
        with args.output.open("wb") as out:
            write_jsonl(handoff, out)
    except OSError as exc:
        return _offline.fail("export", f"cannot write {args.output}: {exc.strerror}")
    events = _text.count(len(handoff.events), "event")
    print(f"wrote {events} of handoff {handoff.handoff.handoff_id} to {args.output}",
          file=sys.stderr)  # fmt: skip
    return _offline.EXIT_OK
