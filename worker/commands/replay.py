"""`kvhandoff replay LOG HANDOFF`: the timeline of one handoff, step by step.

Every logged input is one step, numbered by its sequence in the log: when it came, what it was,
which fields of the coordinator's state it changed (grouped by the record they belong to:
`journal`, `source`, `destination`, `transfer`), and the actions it issued. The actions are
re-derived by this build's coordinator; if they differ from the logged ones the step says so
(`kvhandoff verify` checks a whole log that way). `--at N` stops after step N and prints the
full state there. LOG may be the SQLite log or a JSONL export (HANDOFF is then optional).

Formats: `table` (default), `json` (a `ReplayReport`, see `--print-schema`), and `mermaid`, a
sequence diagram of the frontend, source, coordinator and destination that GitHub renders
when pasted into an issue or a pull request inside a ```mermaid block.

The timeline comes from the log alone, so a handoff whose row holds a state this build does
not know replays as usual: its state is shown as written, marked `(unknown)`, and named in a
warning on stderr.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from msgspec import Struct

from kvhandoff.events.messages import (
    Action,
    ActionOutcome,
    Canceled,
    DestinationReserved,
    Failed,
    Role,
    SourceHeld,
    StartHandoff,
    TimedOut,
    TransferCompleted,
)
from kvhandoff.events.replay import Change, Step, timeline
from kvhandoff.worker.commands import _offline, _text
from kvhandoff.worker.errors import ConfigError
from kvhandoff.worker.log.reader import LogSource, open_log
from kvhandoff.worker.log.reports import ReplayReport


def configure(parser: argparse.ArgumentParser) -> None:
    _offline.add_log_argument(parser)
    parser.add_argument(
        "handoff", nargs="?", help="handoff id or a unique prefix (optional for a JSONL export)"
    )
    parser.add_argument("--at", type=int, metavar="N", help="stop after step N, print the state")
    parser.add_argument(
        "--format",
        choices=["table", "json", "mermaid"],
        default="table",
        help="table (default); json, a ReplayReport (see --print-schema); mermaid, a sequence"
        " diagram to paste into an issue or a pull request",
    )
    _offline.add_report_arguments(parser, json_flag=False)


@_offline.offline_command("replay")
def execute(args: argparse.Namespace) -> int:
    with open_log(args.log) as log:
        loaded = log.load(_chosen(log, args.handoff))
    row = loaded.handoff
    if row.state is None:
        _offline.warn(
            "replay",
            f"handoff {row.handoff_id}: state {row.state_name!r} is not one this build knows",
        )
    report = ReplayReport(
        handoff=loaded.handoff, at=args.at, timeline=timeline(loaded.records(), until=args.at)
    )
    match args.format:
        case "json":
            _offline.print_json(report)
        case "mermaid":
            print(mermaid(report))
        case _:
            _print(report)
    return _offline.EXIT_OK


def _chosen(log: LogSource, handoff: str | None) -> UUID:
    if handoff is not None:
        return log.resolve(handoff)
    rows = log.handoffs()
    if len(rows) != 1:
        raise ConfigError(f"name a handoff: {log.path} holds {len(rows)}")
    return rows[0].handoff_id


def _print(report: ReplayReport) -> None:
    row, tl = report.handoff, report.timeline
    start = tl.start
    print(
        f"handoff {row.handoff_id}  {start.engine_type.value} ({start.engine_type.order.value})"
        f"  {_text.printable(start.source)} -> {_text.printable(start.destination)}"
        f"  {_text.state(row)}"
    )
    print(
        f"started {_text.instant(row.started_at_ms)}, deadline {start.deadline_ms}ms,"
        f" {row.last_seq + 1} events"
    )
    out = _text.console()
    if out.is_terminal:
        _text.print_table(
            ["STEP", "TIME", "INPUT", "CHANGES", "ACTIONS", "STATE"],
            [
                [
                    str(s.step),
                    f"+{s.at_ms - row.started_at_ms}ms",
                    _text.message(s.input),
                    "\n".join(_changes(s.changes)) or "-",
                    _actions(s),
                    s.state,
                ]
                for s in tl.steps
            ],
        )
    else:
        for s in tl.steps:
            print()
            print(f"step {s.step}  +{s.at_ms - row.started_at_ms}ms  {_text.message(s.input)}")
            _text.print_fields(
                [
                    ("changes", "; ".join(_changes(s.changes)) or "-"),
                    ("actions", _actions(s)),
                    ("state", s.state),
                ]
            )
    print()
    last = tl.steps[-1]
    if report.at is None:
        print(f"after step {last.step}: {last.state}")
        return
    print(f"state after step {last.step}:")
    fields = [(name, _state_value(getattr(tl.state, name))) for name in tl.state.__struct_fields__]
    waiting = [
        f"fact {w.fact}" if w.action is None else f"outcome of {_text.action(w.action)}"
        for w in tl.waiting
    ]
    fields.append(("waiting for", ", ".join(waiting) or "nothing"))
    fields.append(("outstanding", ", ".join(map(str, tl.outstanding)) or "-"))
    _text.print_fields(fields)


def _state_value(v: object) -> str:
    """A field of the state; one of its four records as `field=value` pairs on one line."""
    if isinstance(v, Struct):
        return " ".join(f"{f}={_text.value(_listed(getattr(v, f)))}" for f in v.__struct_fields__)
    return _text.value(v)


def _changes(changes: Sequence[Change]) -> list[str]:
    """One entry per changed top-level field, and one per record with its changed fields:
    `source: held false → true, transfer_timing none → {...}`."""
    shown: list[str] = []
    record = None
    for c in changes:
        name, dot, field = c.field.partition(".")
        if not dot:
            shown.append(_text.change(c))
            record = None
            continue
        change = _text.change(Change(field, _listed(c.before), _listed(c.after)))
        if name == record:
            shown[-1] += f", {change}"
        else:
            shown.append(f"{name}: {change}")
            record = name
    return shown


def _listed(v: Any) -> Any:
    """The journal's maps by action id as lists: its actions (each says its id), and its
    outcomes as (action id, outcome) pairs, which `_text` prints as `0:submitted`."""
    if isinstance(v, dict):
        return (
            tuple(v.values())
            if all(isinstance(a, Action) for a in v.values())
            else tuple(v.items())
        )
    return v


def _actions(s: Step) -> str:
    text = _text.actions(s.actions)
    if s.rejection is not None:
        rejection = _text.printable(s.rejection)
        return f"REJECTED by this build: {rejection}; logged: {_text.actions(s.logged)}"
    if s.actions != s.logged:
        return f"{text}; DIVERGES, logged: {_text.actions(s.logged)}"
    return text


# --- Mermaid --------------------------------------------------------------------------------

_PARTICIPANT = {Role.FRONTEND: "F", Role.SOURCE: "S", Role.DESTINATION: "D"}


def mermaid(report: ReplayReport) -> str:
    """A Mermaid sequence diagram of the timeline (no `#` or `;`, which Mermaid would parse)."""
    tl = report.timeline
    start = tl.start
    lines = [
        "sequenceDiagram",
        "    participant F as frontend",
        f"    participant S as source {_safe(start.source)}",
        f"    participant C as coordinator ({start.engine_type.value})",
        f"    participant D as destination {_safe(start.destination)}",
    ]
    executors: dict[int, str] = {}
    for s in tl.steps:
        label = f"{s.step}. {_text.brief(s.input)}"
        match s.input:
            case StartHandoff() | Canceled():
                lines.append(f"    F->>C: {label}")
            case SourceHeld() | TransferCompleted():
                lines.append(f"    S->>C: {label}")
            case DestinationReserved():
                lines.append(f"    D->>C: {label}")
            case TimedOut():
                lines.append(f"    C->>C: {label} (deadline)")
            case ActionOutcome(by_tier=True):
                lines.append(f"    C->>C: {label}")
            case Failed():
                # The fact does not say which engine lost the request.
                lines.append(f"    Note over S,D: {label} (an engine lost the request)")
            case ActionOutcome(action_id=action_id) if action_id in executors:
                lines.append(f"    {executors[action_id]}-->>C: {label}")
            case ActionOutcome():
                lines.append(f"    Note over C: {label} (for an action never issued)")
        if s.rejection is not None:
            lines.append(f"    Note over C: rejected by this build: {_safe(s.rejection)}")
        for a in s.actions:
            executors[a.action_id] = _PARTICIPANT[a.executor]
            lines.append(f"    C->>{_PARTICIPANT[a.executor]}: {_safe(_text.action(a))}")
        if s.actions != s.logged and s.rejection is None:
            logged = ", ".join(_safe(_text.action(a)) for a in s.logged) or "nothing"
            lines.append(f"    Note over C: DIVERGES from the log, which has {logged}")
        changed = {c.field: c.after for c in s.changes}
        if "mode" in changed:
            mode = str(changed["mode"])
            if "completion" in changed:
                mode = f"{mode} ({changed['completion']})"
            lines.append(f"    Note over C: {mode}")
    return "\n".join(lines)


def _safe(text: str) -> str:
    return _text.printable(text).replace("#", " ").replace(";", ",").replace('"', "'")
