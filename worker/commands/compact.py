"""`kvhandoff compact LOG --older-than AGE`: remove completed handoffs and rejections older
than AGE.

Deletes every handoff that completed (succeeded or canceled) more than AGE ago, with its whole
log, and every rejection (which keeps the refused input's whole payload) logged more than AGE
ago, in one transaction, through the worker's own `EventLog.compact`. Open and quarantined
handoffs, and the rejections of quarantined ones, are never touched. Safe while a worker runs
on the same file: it does not take the worker's lock, and both wait for SQLite's write lock.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from kvhandoff.worker.clock import DURATION_HELP, duration_ms_arg
from kvhandoff.worker.commands import _offline, _text
from kvhandoff.worker.log.store import Compacted, EventLog


def configure(parser: argparse.ArgumentParser) -> None:
    _offline.add_log_argument(parser, sqlite_only=True)
    parser.add_argument(
        "--older-than",
        metavar="AGE",
        type=duration_ms_arg,
        required=True,
        help="remove handoffs that completed, and rejections logged, more than AGE ago; AGE is"
        f" {DURATION_HELP}",
    )
    _offline.add_now_argument(parser)


@_offline.offline_command("compact")
def execute(args: argparse.Namespace) -> int:
    if not args.log.is_file():
        # EventLog.open would create an empty log; compacting a typo must not.
        return _offline.fail("compact", f"no event log at {args.log}")
    cutoff = _offline.resolve_now(args) - args.older_than
    removed = asyncio.run(_compact(args.log, cutoff))
    print(
        f"removed {_text.count(removed.handoffs, 'handoff')} completed and"
        f" {_text.count(removed.rejections, 'rejection')} logged before {_text.instant(cutoff)}"
    )
    return _offline.EXIT_OK


async def _compact(path: Path, before_ms: int) -> Compacted:
    log = await EventLog.open(path)
    try:
        return await log.compact(before_ms)
    finally:
        await log.close()
