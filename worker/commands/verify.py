"""`kvhandoff verify LOG [HANDOFF...]`: check every handoff's log, re-deriving every action.

Each handoff's logged inputs are fed, in order, to this build's coordinator, and the actions it
issues are compared with the logged ones: kind, action id, every field, and order. A handoff
diverges at the first step where they differ, or where the coordinator now rejects a logged
input. Run it against production logs before deploying a coordinator change: a divergence means
the new coordinator would have acted differently on history, so recovery of an open handoff
could act differently from what the engines were told.

The log itself is checked too: a record that does not decode, a sequence that skips, repeats or
does not begin with the handoff's start, an input whose stored digest is not its own (a
layout-1 log keeps one per input; a layout-2 log and an export keep none, and the report says
that no digest was checked), a `handoffs` row whose state this build does not know, and a
tombstone that a snapshot left in the file (worker.log.store) that the file's own rows of that
handoff contradict. Every bad handoff is reported, each under its own id, not just the first.

Without HANDOFF ids the whole log is checked in one ordered pass that does not read handoff
ids (`LogSource.scan`); only when a run of rows fails its check are their ids read, in one
more pass, so that each finding names the handoff whose rows they are. A partitioned worker's
data directory is checked file after file in that one pass, and reported as one log. Exit
status 1 if anything was found, 0 if not.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator, Sequence
from uuid import UUID

from kvhandoff.events.codec import decode_record, input_digest
from kvhandoff.events.records import InputRecord
from kvhandoff.events.replay import Divergence, StoredCheck, StoredRecord, check_stored
from kvhandoff.worker.commands import _offline, _text
from kvhandoff.worker.log.reader import LogSource, open_log
from kvhandoff.worker.log.reports import Finding, FindingKind, VerifyReport
from kvhandoff.worker.log.rows import HandoffRow
from kvhandoff.worker.log.schema import HandoffState


def configure(parser: argparse.ArgumentParser) -> None:
    _offline.add_log_argument(parser)
    parser.add_argument("handoffs", nargs="*", metavar="HANDOFF", help="only these (or prefixes)")
    _offline.add_report_arguments(parser)


@_offline.offline_command("verify")
def execute(args: argparse.Namespace) -> int:
    with open_log(args.log) as log:
        report = verify_log(log, args.handoffs)
    code = _offline.EXIT_FAILED if report.findings else _offline.EXIT_OK
    with _offline.printing():
        if args.json:
            _offline.print_json(report)
        else:
            _print(report, log.form)
    return code


def verify_log(log: LogSource, handoffs: list[str] | None = None) -> VerifyReport:
    """Verify the named handoffs, or every handoff of the log in one ordered pass."""
    found = _Found(log.keeps_digests)
    if handoffs:
        for handoff_id in dict.fromkeys(map(log.resolve, handoffs)):
            found.state(log.summary(handoff_id))
            rows = log.stored(handoff_id)
            found.handoff(handoff_id, rows, check_stored(rows, digests=log.keeps_digests))
    else:
        _verify_all(log, found)
        for handoff_id, ended, state in log.disagreeing_tombstones():
            detail = f"a snapshot's tombstone says it ended {ended}, its rows say {state}"
            found.findings.append(Finding(handoff_id, FindingKind.TOMBSTONE, None, detail))
    return found.report()


def _verify_all(log: LogSource, found: _Found) -> None:
    # A run that passes is one handoff's log (check_stored proves it from the records), and
    # needs no id. The rows of a run that fails are kept until their owners are known.
    failed: list[tuple[int, list[StoredRecord], StoredCheck]] = []
    position = 0
    for rows in log.scan():
        check = check_stored(rows, digests=log.keeps_digests)
        if check.ok:
            found.checked(len(rows))
        else:
            failed.append((position, rows, check))
        position += len(rows)
    if failed:
        owners = log.owners([(first, len(rows)) for first, rows, _ in failed])
        for (_, rows, check), ids in zip(failed, owners, strict=True):
            for handoff_id, run in _runs(ids, rows):
                if len(run) != len(rows):  # several handoffs ran together: check each alone
                    found.handoff(handoff_id, run, check_stored(run, digests=log.keeps_digests))
                else:
                    found.handoff(handoff_id, run, check)
    for row in log.handoffs([None]):
        found.state(row)


def _runs(
    ids: Sequence[UUID], rows: list[StoredRecord]
) -> Iterator[tuple[UUID, list[StoredRecord]]]:
    """Split rows into runs of one handoff each, by the handoff id of each row."""
    start = 0
    for handoff_id, same in itertools.groupby(ids):
        end = start + sum(1 for _ in same)
        yield handoff_id, rows[start:end]
        start = end


class _Found:
    """The report under construction: what was checked, and every finding."""

    def __init__(self, digests: bool) -> None:
        self.digests = digests
        self.handoffs = self.events = 0
        self.findings: list[Finding] = []
        self.diverged: list[Divergence] = []

    def checked(self, events: int) -> None:
        """Count one handoff of that many events as checked."""
        self.handoffs, self.events = self.handoffs + 1, self.events + events

    def handoff(self, handoff_id: UUID, rows: list[StoredRecord], check: StoredCheck) -> None:
        self.checked(len(rows))

        def add(kind: FindingKind, seq: int | None, detail: str) -> None:
            self.findings.append(Finding(handoff_id, kind, seq, detail))

        for seq, why in check.corrupt:
            add(FindingKind.CORRUPT_RECORD, seq, why)
        if check.malformed is not None:
            add(FindingKind.SEQUENCE, None, check.malformed)
        by_seq = {seq: (digest, blob) for seq, digest, blob in rows}
        for seq in check.digest_mismatches:
            add(FindingKind.DIGEST_MISMATCH, seq, _digest_detail(*by_seq[seq]))
        if (d := check.divergence) is not None:
            self.diverged.append(d)
            add(FindingKind.DIVERGENCE, d.step, d.detail)

    def state(self, row: HandoffRow) -> None:
        if row.state is None:
            known = ", ".join(HandoffState)
            detail = f"state {row.state_name!r} is not one this build knows ({known})"
            self.findings.append(Finding(row.handoff_id, FindingKind.UNKNOWN_STATE, None, detail))

    def report(self) -> VerifyReport:
        self.findings.sort(key=lambda f: (str(f.handoff_id), -1 if f.seq is None else f.seq))
        self.diverged.sort(key=lambda d: str(d.handoff_id))
        return VerifyReport(
            handoffs=self.handoffs,
            events=self.events,
            diverged=self.diverged,
            findings=self.findings,
            digests_checked=self.digests,
        )


def _digest_detail(stored: bytes | None, blob: bytes) -> str:
    logged = "none" if stored is None else stored.hex()
    # It decoded in check_stored, which compares the digests of inputs only; read from disk
    # again, it is still said for what it is rather than assumed.
    match decode_record(blob):
        case InputRecord(input=message):
            return f"stored digest {logged}, the logged input's is {input_digest(message).hex()}"
        case record:
            return f"stored digest {logged} beside {record.action!r}, which has none"


def _print(report: VerifyReport, form: str) -> None:
    divergences = {d.handoff_id: d for d in report.diverged}
    for f in report.findings:
        d = divergences.get(f.handoff_id)
        if f.kind is FindingKind.DIVERGENCE and d is not None:
            print(f"handoff {d.handoff_id} diverges at step {d.step} ({_text.instant(d.at_ms)})")
            _text.print_fields(
                [
                    ("input", _text.message(d.input)),
                    ("logged", _text.actions(d.logged)),
                    ("re-derived", _text.actions(d.rederived)),
                    ("difference", _text.printable(d.detail)),
                ]
            )
            continue
        where = "" if f.seq is None else f" at seq {f.seq}"
        what = f.kind.value.replace("_", " ")
        print(f"handoff {f.handoff_id}: {what}{where}: {_text.printable(f.detail)}")
    handoffs, events = _text.count(report.handoffs, "handoff"), _text.count(report.events, "event")
    checked = "" if report.digests_checked else f" (no input digests in {form})"
    if not report.findings:
        print(f"verified {handoffs}, {events}{checked}: all match")
        return
    kinds = {
        kind: {f.handoff_id for f in report.findings if f.kind is kind} for kind in FindingKind
    }
    counts = ", ".join(f"{kind.value} {len(ids)}" for kind, ids in kinds.items() if ids)
    print(f"verified {handoffs}, {events}{checked}: {report.bad} bad ({counts})")
