"""`kvhandoff verify LOG [HANDOFF...]`: re-derive every logged action and compare.

Each handoff's logged inputs are fed, in order, to this build's coordinator, and the actions it
issues are compared with the logged ones: kind, action id, every field, and order. A handoff
diverges at the first step where they differ, or where the coordinator now rejects a logged
input. Run it against production logs before deploying a coordinator change: a divergence means
the new coordinator would have acted differently on history, so recovery of an open handoff
could act differently from what the engines were told.

Without HANDOFF ids the whole log is checked in one ordered pass. Exit status 1 if any handoff
diverges, 0 if none does.
"""

from __future__ import annotations

import argparse

from events.errors import LogCorrupt
from events.replay import Divergence, find_divergence, find_divergence_stored
from worker.commands import _offline, _text
from worker.logreader import LogSource, open_log
from worker.reports import VerifyReport


def configure(parser: argparse.ArgumentParser) -> None:
    _offline.add_log_argument(parser)
    parser.add_argument("handoffs", nargs="*", metavar="HANDOFF", help="only these (or prefixes)")
    _offline.add_report_arguments(parser)


@_offline.offline_command("verify")
def execute(args: argparse.Namespace) -> int:
    with open_log(args.log) as log:
        report = verify_log(log, args.handoffs)
    code = _offline.EXIT_FAILED if report.diverged else _offline.EXIT_OK
    with _offline.printing():
        if args.json:
            _offline.print_json(report)
        else:
            _print(report)
    return code


def verify_log(log: LogSource, handoffs: list[str] | None = None) -> VerifyReport:
    """Verify the named handoffs, or every handoff of the log in one ordered pass."""
    checked = events = 0
    diverged: list[Divergence] = []
    if handoffs:
        for handoff_id in map(log.resolve, handoffs):
            records = log.load(handoff_id).records()
            checked, events = checked + 1, events + len(records)
            try:
                divergence = find_divergence(records)
            except LogCorrupt as exc:
                raise LogCorrupt(f"handoff {handoff_id}: {exc}") from exc
            if divergence is not None:
                diverged.append(divergence)
    else:
        for rows in log.scan():
            checked, events = checked + 1, events + len(rows)
            if (divergence := find_divergence_stored(rows)) is not None:
                diverged.append(divergence)
    return VerifyReport(handoffs=checked, events=events, diverged=diverged)


def _print(report: VerifyReport) -> None:
    for d in report.diverged:
        print(f"handoff {d.handoff_id} diverges at step {d.step} ({_text.instant(d.at_ms)})")
        _text.print_fields(
            [
                ("input", _text.message(d.input)),
                ("logged", _text.actions(d.logged)),
                ("re-derived", _text.actions(d.rederived)),
                ("difference", d.detail),
            ]
        )
    outcome = f"{len(report.diverged)} diverge" if report.diverged else "all match"
    handoffs, events = _text.count(report.handoffs, "handoff"), _text.count(report.events, "event")
    print(f"verified {handoffs}, {events}: {outcome}")
