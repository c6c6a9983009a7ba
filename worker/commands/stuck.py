"""`kvhandoff stuck LOG --older-than 30s`: open handoffs that wait, and what each waits for.

The first thing to run when handoffs hang. For every open handoff idle for at least the given
age (no event logged since), the coordinator is rebuilt from its log and asked what it waits
for: the outcome of an issued action, or a fact, and from which engine (the source or the
destination, by the role that owes it). "Since" is when the awaited action was logged, or, for
a fact, when the last input was. Longest idle first; handoffs past their deadline are marked
overdue (the worker should have timed them out).

Beside the engine it waits on, the engine's lease (`lease live`, `lease expired`) as the worker
last saw it, from the view the worker keeps beside its log (`worker.tier.lease_view`): the command
reads no bus, so that view's time is printed too. No lease shown: the worker knew of none.

Quarantined handoffs are listed whatever their age, since they never progress on their own:
they wait for an operator, since the worker set them aside, for the reason it gave. A handoff
whose state this build does not know is looked at like an open one, and named in a warning on
stderr. One handoff whose log cannot be read or replayed is shown as such, not an error.
"""

from __future__ import annotations

import argparse

import msgspec

from kvhandoff.events.coordinator import Mode, Waiting
from kvhandoff.events.errors import LogCorrupt
from kvhandoff.events.messages import Role
from kvhandoff.events.records import ActionRecord, InputRecord
from kvhandoff.events.replay import timeline
from kvhandoff.worker.clock import DURATION_HELP, duration_ms_arg
from kvhandoff.worker.commands import _offline, _text
from kvhandoff.worker.log.reader import LogSource, open_log
from kvhandoff.worker.log.reports import LoggedInput, StuckHandoff, StuckReport, WaitingFor
from kvhandoff.worker.log.rows import HandoffRow
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.tier.lease_view import read_view


def configure(parser: argparse.ArgumentParser) -> None:
    _offline.add_log_argument(parser)
    parser.add_argument(
        "--older-than",
        metavar="AGE",
        type=duration_ms_arg,
        default=0,
        help=f"only handoffs with no event logged for at least AGE (default 0); AGE is"
        f" {DURATION_HELP}",
    )
    _offline.add_now_argument(parser)
    _offline.add_report_arguments(parser)


@_offline.offline_command("stuck")
def execute(args: argparse.Namespace) -> int:
    now = _offline.resolve_now(args)
    view = read_view(args.log)
    leases = {} if view is None else view.engines
    with open_log(args.log) as log:
        rows = log.handoffs([HandoffState.OPEN, HandoffState.QUARANTINED, None])
        stuck = []
        for row in rows:
            if row.state is None:
                _offline.warn(
                    "stuck",
                    f"handoff {row.handoff_id}: state {row.state_name!r} is not one this build"
                    " knows; looked at like an open one",
                )
            handoff = _stuck(log, row, now, leases)
            if handoff is None:
                continue
            if handoff.idle_ms >= args.older_than or row.state is HandoffState.QUARANTINED:
                stuck.append(handoff)
    stuck.sort(key=lambda h: (-h.idle_ms, str(h.handoff.handoff_id)))
    report = StuckReport(
        now_ms=now,
        older_than_ms=args.older_than,
        open=sum(row.state is HandoffState.OPEN for row in rows),
        handoffs=stuck,
        quarantined=sum(row.state is HandoffState.QUARANTINED for row in rows),
        unknown_state=sum(row.state is None for row in rows),
        leases_at_ms=None if view is None else view.at_ms,
    )
    if args.json:
        _offline.print_json(report)
    else:
        _print(report)
    return _offline.EXIT_OK


def _stuck(
    source: LogSource, row: HandoffRow, now: int, leases: dict[str, str]
) -> StuckHandoff | None:
    """What the handoff waits for, or None if it waits for nothing (its log says complete)."""
    quarantined = row.state is HandoffState.QUARANTINED
    stuck = StuckHandoff(
        handoff=row,
        state=_quarantine_reason(row) if quarantined else "",
        age_ms=now - row.started_at_ms,
        idle_ms=now - row.updated_at_ms,
        overdue=now > row.deadline_at_ms,
        waiting=[],
        last_input=None,
        outstanding=[],
    )
    try:
        log = source.load(row.handoff_id)
    except LogCorrupt as exc:
        # One handoff whose log does not decode must not hide the others; `verify` says more.
        return (
            stuck
            if quarantined
            else msgspec.structs.replace(stuck, state=f"cannot read its log: {exc}")
        )
    last_input = next(
        (
            LoggedInput(e.seq, e.at_ms, e.record.input)
            for e in reversed(log.events)
            if isinstance(e.record, InputRecord)
        ),
        None,
    )
    if last_input is not None:
        stuck = msgspec.structs.replace(
            stuck, idle_ms=now - log.events[-1].at_ms, last_input=last_input
        )
    if quarantined:
        # Set aside by the worker: whatever its log says, only an operator moves it on.
        return stuck
    try:
        # The timeline, not a rebuild: it shows a log that diverges too (`verify` says how).
        replayed = timeline(log.records())
    except LogCorrupt as exc:
        return msgspec.structs.replace(stuck, state=f"cannot replay: {exc}")
    refused = next((step for step in replayed.steps if step.rejection is not None), None)
    if refused is not None:  # this build's coordinator refuses a logged input
        return msgspec.structs.replace(
            stuck, state=f"cannot replay: step {refused.step}: {refused.rejection}"
        )
    if replayed.state.mode is Mode.COMPLETE:
        return None
    start = replayed.start
    assert last_input is not None  # the replay found a start, which is an input
    since_input = last_input.at_ms
    logged_at = {
        e.record.action.action_id: e.at_ms for e in log.events if isinstance(e.record, ActionRecord)
    }
    engines = {Role.SOURCE: start.source, Role.DESTINATION: start.destination}

    def waiting_for(w: Waiting) -> WaitingFor:
        # An action the log does not hold (it diverges: `verify` says how) waits since the input.
        since = since_input if w.action is None else logged_at.get(w.action.action_id, since_input)
        engine = engines.get(w.role, w.role.value)
        return WaitingFor(
            w.role, engine, w.fact, w.action, since, now - since, lease=leases.get(engine)
        )

    return msgspec.structs.replace(
        stuck,
        state=replayed.steps[-1].state,
        waiting=[waiting_for(w) for w in replayed.waiting],
        outstanding=list(replayed.outstanding),
    )


def _quarantine_reason(row: HandoffRow) -> str:
    if row.quarantine is None:
        return "quarantined (the log holds no reason)"
    return row.quarantine.reason


def _print(report: StuckReport) -> None:
    columns = ["HANDOFF", "IDLE", "WAITING FOR", "FROM", "SINCE", "LAST INPUT", "OUTSTANDING"]
    rows = []
    for h in report.handoffs:
        idle = _text.duration(h.idle_ms) + (" overdue" if h.overdue else "")
        last = "-"
        if h.last_input is not None:
            last = f"{h.last_input.seq}: {_text.brief(h.last_input.input)}"
        first = [str(h.handoff.handoff_id), idle]
        tail = [last, ", ".join(map(str, h.outstanding)) or "-"]
        if h.handoff.state is HandoffState.QUARANTINED:
            q = h.handoff.quarantine
            since = "-" if q is None else _text.instant(q.at_ms)
            rows.append([*first, _text.printable(h.state), "an operator", since, *tail])
        elif not h.waiting:
            rows.append([*first, f"nothing ({_text.printable(h.state)})", "-", "-", *tail])
        for i, w in enumerate(h.waiting):
            what = f"fact {w.fact}" if w.action is None else f"outcome of {_text.action(w.action)}"
            engine = f"{w.role.value} {_text.printable(w.engine)}"
            if w.lease is not None:
                engine += f" (lease {w.lease})"
            cells = [what, engine, _text.instant(w.since_ms)]
            rows.append([*first, *cells, *tail] if i == 0 else ["", "", *cells, "", ""])
    _text.print_table(columns, rows)
    waiting = sum(h.handoff.state is not HandoffState.QUARANTINED for h in report.handoffs)
    looked_at = report.open + report.unknown_state
    line = (
        f"{waiting} of {_text.count(looked_at, 'open handoff')} idle for at least"
        f" {_text.duration(report.older_than_ms)}"
    )
    if report.unknown_state:
        line += f" ({report.unknown_state} in a state this build does not know)"
    if report.quarantined:
        line += f", and {report.quarantined} quarantined"
    print(f"{line} (now {_text.instant(report.now_ms)})")
    if report.leases_at_ms is not None:
        print(f"leases as the worker saw them at {_text.instant(report.leases_at_ms)}")
