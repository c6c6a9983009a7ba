"""`kvhandoff list LOG`: the handoffs in an event log, with state, engines, age and completion.

Filters combine (all must hold): `--state` (repeatable), `--engine-type`, `--engine` (the source
or the destination), and `--since`/`--until` on the start time. Sorted by start time unless
`--sort` says otherwise. In a partitioned worker's data directory, the handoffs of every
partition file are filtered, sorted and cut to `--limit` as one list.

A handoff whose row holds a state this build does not know (a newer worker's log, or a damaged
row) is listed all the same, its state shown as written with `(unknown)` after it (in JSON:
`state` null, `unknown_state` as written), and named in a warning on stderr; only a listing
without `--state` includes it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvhandoff.events.messages import EngineType, HandoffOrder
from kvhandoff.worker.commands import _offline, _text
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.log.reports import ListedHandoff, ListReport
from kvhandoff.worker.log.rows import HandoffRow
from kvhandoff.worker.log.schema import HandoffState

# Each key gives None for a handoff that has no such value (an open handoff has no completion);
# those sort last in either direction.
_SORT_KEYS: dict[str, Callable[[ListedHandoff], tuple[Any, ...] | None]] = {
    "started": lambda h: (h.handoff.started_at_ms, str(h.handoff.handoff_id)),
    "completed": lambda h: (
        None if h.handoff.completed_at_ms is None else (h.handoff.completed_at_ms,)
    ),
    "duration": lambda h: None if h.duration_ms is None else (h.duration_ms,),
    "state": lambda h: (h.handoff.state_name,),
    "engine": lambda h: (h.handoff.engine_type, h.handoff.source),
    "events": lambda h: (h.events,),
}


def configure(parser: argparse.ArgumentParser) -> None:
    _offline.add_log_argument(parser)
    parser.add_argument(
        "--state",
        action="append",
        type=HandoffState,
        choices=list(HandoffState),
        help="only handoffs in this state (repeatable)",
    )
    parser.add_argument(
        "--engine-type", type=EngineType, choices=list(EngineType), help="only this engine type"
    )
    parser.add_argument(
        "--engine", metavar="ID", help="only handoffs with this source or destination"
    )
    parser.add_argument("--since", metavar="TIME", help="only handoffs started at or after TIME")
    parser.add_argument("--until", metavar="TIME", help="only handoffs started before TIME")
    parser.add_argument(
        "--sort", choices=list(_SORT_KEYS), default="started", help="order (default: started)"
    )
    parser.add_argument("--reverse", action="store_true", help="newest (or largest) first")
    parser.add_argument("--limit", type=int, metavar="N", help="at most N handoffs")
    _offline.add_now_argument(parser)
    _offline.add_report_arguments(parser)
    parser.epilog = (
        "TIME is epoch milliseconds, ISO 8601 (UTC by default), or an age such as 10m or 1h30m."
    )


@_offline.offline_command("list")
def execute(args: argparse.Namespace) -> int:
    now = _offline.resolve_now(args)
    since = None if args.since is None else _offline.parse_time_ms(args.since, now)
    until = None if args.until is None else _offline.parse_time_ms(args.until, now)
    with open_log(args.log) as log:
        rows = log.handoffs(args.state or ())
    listed = [
        _listed(row, now)
        for row in rows
        if (args.engine_type is None or row.engine_type == args.engine_type)
        and (args.engine is None or args.engine in (row.source, row.destination))
        and (since is None or row.started_at_ms >= since)
        and (until is None or row.started_at_ms < until)
    ]
    listed = _sorted(listed, _SORT_KEYS[args.sort], args.reverse)
    if args.limit is not None:
        listed = listed[: args.limit]
    for h in listed:
        if h.handoff.state is None:
            _offline.warn("list", f"handoff {h.handoff.handoff_id}: {_unknown(h.handoff)}")
    report = ListReport(now_ms=now, handoffs=listed)
    if args.json:
        _offline.print_json(report)
    else:
        _print(report)
    return _offline.EXIT_OK


def _sorted(
    listed: list[ListedHandoff],
    key: Callable[[ListedHandoff], tuple[Any, ...] | None],
    reverse: bool,
) -> list[ListedHandoff]:
    # Already in start order, and sorts are stable: ties stay in start order.
    keyed = [(key(h), h) for h in listed]
    present = [(k, h) for k, h in keyed if k is not None]
    present.sort(key=lambda pair: pair[0], reverse=reverse)
    return [h for _, h in present] + [h for k, h in keyed if k is None]


def _listed(row: HandoffRow, now: int) -> ListedHandoff:
    try:
        order: HandoffOrder | None = EngineType(row.engine_type).order
    except ValueError:  # an engine type newer than this build
        order = None
    completed = row.completed_at_ms
    return ListedHandoff(
        handoff=row,
        order=order,
        events=row.last_seq + 1,
        age_ms=now - row.started_at_ms,
        duration_ms=None if completed is None else completed - row.started_at_ms,
    )


def _unknown(row: HandoffRow) -> str:
    return f"state {row.state_name!r} is not one this build knows"


def _print(report: ListReport) -> None:
    columns = ["HANDOFF", "STATE", "ENGINE", "ORDER", "SOURCE", "DESTINATION", "STARTED", "AGE"]
    columns += ["COMPLETED", "EVENTS"]
    rows = [
        [
            str(h.handoff.handoff_id),
            _text.state(h.handoff),
            _text.printable(h.handoff.engine_type),
            "-" if h.order is None else h.order.value,
            _text.printable(h.handoff.source),
            _text.printable(h.handoff.destination),
            _text.instant(h.handoff.started_at_ms),
            _text.duration(h.age_ms),
            "-" if h.duration_ms is None else f"after {_text.duration(h.duration_ms)}",
            str(h.events),
        ]
        for h in report.handoffs
    ]
    _text.print_table(columns, rows)
    print(_text.count(len(rows), "handoff"))
