"""`kvhandoff stuck LOG --older-than 30s`: open handoffs that wait, and what each waits for.

The first thing to run when handoffs hang. For every open handoff idle for at least the given
age (no event logged since), the coordinator is rebuilt from its log and asked what it waits
for: the outcome of an issued action, or a fact, and from which engine (the source or the
destination, by the role that owes it). "Since" is when the awaited action was logged, or, for
a fact, when the last input was. Longest idle first; handoffs past their deadline are marked
overdue (the worker should have timed them out).
"""

from __future__ import annotations

import argparse

import msgspec

from events.coordinator import Waiting
from events.errors import LogCorrupt
from events.messages import Role
from events.records import ActionRecord, InputRecord
from events.replay import rebuild
from worker.commands import _offline, _text
from worker.logreader import HandoffLog, open_log
from worker.reports import LoggedInput, StuckHandoff, StuckReport, WaitingFor
from worker.schema import HandoffState


def configure(parser: argparse.ArgumentParser) -> None:
    _offline.add_log_argument(parser)
    parser.add_argument(
        "--older-than",
        metavar="AGE",
        type=_offline.parse_duration_ms,
        default=0,
        help="only handoffs with no event logged for at least AGE (30s, 5m, 1h30m; default 0)",
    )
    _offline.add_now_argument(parser)
    _offline.add_report_arguments(parser)


@_offline.offline_command("stuck")
def execute(args: argparse.Namespace) -> int:
    now = _offline.resolve_now(args)
    with open_log(args.log) as log:
        open_rows = log.handoffs([HandoffState.OPEN])
        stuck = []
        for row in open_rows:
            handoff = _stuck(log.load(row.handoff_id), now)
            if handoff is not None and handoff.idle_ms >= args.older_than:
                stuck.append(handoff)
    stuck.sort(key=lambda h: (-h.idle_ms, str(h.handoff.handoff_id)))
    report = StuckReport(
        now_ms=now, older_than_ms=args.older_than, open=len(open_rows), handoffs=stuck
    )
    if args.json:
        _offline.print_json(report)
    else:
        _print(report)
    return _offline.EXIT_OK


def _stuck(log: HandoffLog, now: int) -> StuckHandoff | None:
    row = log.handoff
    last_event = log.events[-1]
    last_input = next(e for e in reversed(log.events) if isinstance(e.record, InputRecord))
    assert isinstance(last_input.record, InputRecord)
    stuck = StuckHandoff(
        handoff=row,
        state="",
        age_ms=now - row.started_at_ms,
        idle_ms=now - last_event.at_ms,
        overdue=now > row.deadline_at_ms,
        waiting=[],
        last_input=LoggedInput(last_input.seq, last_input.at_ms, last_input.record.input),
        outstanding=[],
    )
    try:
        start, coordinator = rebuild(e.record for e in log.events)
    except LogCorrupt as exc:
        # One handoff this build cannot replay must not hide the others; `verify` says more.
        return msgspec.structs.replace(stuck, state=f"cannot replay: {exc}")
    if coordinator.is_complete:
        return None
    logged_at = {
        e.record.action.action_id: e.at_ms for e in log.events if isinstance(e.record, ActionRecord)
    }
    engines = {Role.SOURCE: start.source, Role.DESTINATION: start.destination}

    def waiting_for(w: Waiting) -> WaitingFor:
        # An action the log does not hold (it diverges: `verify` says how) waits since the input.
        since = (
            last_input.at_ms
            if w.action is None
            else logged_at.get(w.action.action_id, last_input.at_ms)
        )
        engine = engines.get(w.role, w.role.value)
        return WaitingFor(w.role, engine, w.fact, w.action, since, now - since)

    return msgspec.structs.replace(
        stuck,
        state=coordinator.describe(),
        waiting=[waiting_for(w) for w in coordinator.waiting_for()],
        outstanding=[a.action_id for a in coordinator.outstanding()],
    )


def _print(report: StuckReport) -> None:
    columns = ["HANDOFF", "IDLE", "WAITING FOR", "FROM", "SINCE", "LAST INPUT", "OUTSTANDING"]
    rows = []
    for h in report.handoffs:
        idle = _text.duration(h.idle_ms) + (" overdue" if h.overdue else "")
        last = f"{h.last_input.seq}: {_text.brief(h.last_input.input)}"
        first = [str(h.handoff.handoff_id), idle]
        tail = [last, ", ".join(map(str, h.outstanding)) or "-"]
        if not h.waiting:
            rows.append([*first, f"nothing ({h.state})", "-", "-", *tail])
        for i, w in enumerate(h.waiting):
            what = f"fact {w.fact}" if w.action is None else f"outcome of {_text.action(w.action)}"
            cells = [what, f"{w.role.value} {w.engine}", _text.instant(w.since_ms)]
            rows.append([*first, *cells, *tail] if i == 0 else ["", "", *cells, "", ""])
    _text.print_table(columns, rows)
    print(
        f"{len(report.handoffs)} of {_text.count(report.open, 'open handoff')} idle for at least "
        f"{_text.duration(report.older_than_ms)} (now {_text.instant(report.now_ms)})"
    )
