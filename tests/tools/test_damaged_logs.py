"""The offline tools on logs that are not as this build's worker would leave them: edited inputs,
undecodable records, lost events, states this build does not know, quarantined handoffs, in
either layout (input digests are layout 1's only; layout 2 has damage of its own: a record that
cannot be put back together, events filed under no handoff).

`verify` must name every bad handoff, each under its own id, and exit 1; `list`, `stuck` and
`replay` must say which handoff is odd and carry on with the rest, never end in a traceback.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import msgspec
import pytest

from kvhandoff.events.messages import ActionFailed, ActionOutcome, SourceHeld
from kvhandoff.events.records import ActionRecord, InputRecord, LogRecord
from kvhandoff.worker.log.reports import (
    FindingKind,
    ListReport,
    ReplayReport,
    StuckReport,
    VerifyReport,
)
from kvhandoff.worker.log.schema import TOMBSTONES
from tests.tools import logedit
from tests.tools.conftest import IDS, V1, Run
from tests.tools.test_commands import report

NOW = "2025-01-01T00:15:20Z"
QUARANTINED_AT = 1_735_690_000_000


def more_tokens(record: LogRecord) -> LogRecord:
    """frontend-cancel's SourceHeld (seq 3) with another prompt length: the handoff was canceled
    before the transfer, so no action depends on it, and only the digest can tell."""
    assert isinstance(record, InputRecord) and isinstance(record.input, SourceHeld)
    timing = msgspec.structs.replace(record.input.timing, full_prompt_tokens=8192)
    return msgspec.structs.replace(
        record, input=msgspec.structs.replace(record.input, timing=timing)
    )


def other_reason(record: LogRecord) -> LogRecord:
    """failed-outcome's ActionFailed (seq 2) with another reason: the same actions follow."""
    assert isinstance(record, InputRecord) and isinstance(record.input, ActionOutcome)
    outcome = ActionFailed("tampered with")
    return msgspec.structs.replace(
        record, input=msgspec.structs.replace(record.input, outcome=outcome)
    )


# --- verify: input digests ------------------------------------------------------------------


def test_verify_finds_an_input_edited_after_it_was_logged(
    kvhandoff: Run, writable_log: Path
) -> None:
    cancel = IDS["frontend-cancel"]
    logedit.rewrite(writable_log, cancel, 3, more_tokens, digest=False)
    for args in ([], [cancel]):
        result = kvhandoff("verify", writable_log, *args, "--json")
        assert result.code == 1
        verified = report(VerifyReport, result.out)
        (finding,) = verified.findings
        assert (str(finding.handoff_id), finding.kind, finding.seq) == (
            cancel,
            "digest_mismatch",
            3,
        )
        assert verified.diverged == [] and verified.digests_checked

    text = kvhandoff("verify", writable_log).out.splitlines()
    assert re.fullmatch(
        f"handoff {cancel}: digest mismatch at seq 3: stored digest [0-9a-f]{{32}},"
        " the logged input's is [0-9a-f]{32}",
        text[0],
    )
    assert text[1] == "verified 9 handoffs, 93 events: 1 bad (digest_mismatch 1)"


def test_verify_takes_an_input_whose_digest_was_stored_with_it(
    kvhandoff: Run, writable_log: Path
) -> None:
    # The same edit, made the way the worker would have logged such an input: nothing to find.
    logedit.rewrite(writable_log, IDS["frontend-cancel"], 3, more_tokens, digest=True)
    assert kvhandoff("verify", writable_log).code == 0


def test_verify_finds_an_input_stored_without_a_digest(kvhandoff: Run, writable_log: Path) -> None:
    logedit.execute(
        writable_log,
        "UPDATE events SET digest = NULL WHERE handoff_id = ? AND seq = 2",
        IDS["failed-outcome"],
    )
    result = kvhandoff("verify", writable_log, "--json")
    (finding,) = report(VerifyReport, result.out).findings
    assert (finding.kind, finding.seq) == ("digest_mismatch", 2)
    assert finding.detail.startswith("stored digest none, the logged input's is ")


# --- verify: every bad handoff --------------------------------------------------------------


@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    """The tampered log (two divergences) with four more handoffs damaged, each differently."""
    path = tmp_path / "damaged.sqlite3"
    path.write_bytes((V1 / "tampered.sqlite3").read_bytes())
    logedit.rewrite(path, IDS["failed-outcome"], 2, other_reason, digest=False)
    logedit.execute(
        path,
        "UPDATE events SET record = ? WHERE handoff_id = ? AND seq = 4",
        b"\xc1 not msgpack",
        IDS["deadline-timed-out"],
    )
    logedit.execute(
        path, "DELETE FROM events WHERE handoff_id = ? AND seq = 5", IDS["stuck-on-transfer"]
    )
    logedit.set_state(path, IDS["just-started"], "frozen")
    return path


EVERY_FINDING = [
    ("frontend-cancel", FindingKind.DIVERGENCE, 5),
    ("source-first-success", FindingKind.DIVERGENCE, 6),
    ("failed-outcome", FindingKind.DIGEST_MISMATCH, 2),
    ("deadline-timed-out", FindingKind.CORRUPT_RECORD, 4),
    ("stuck-on-transfer", FindingKind.SEQUENCE, None),
    ("just-started", FindingKind.UNKNOWN_STATE, None),
]


def test_verify_reports_every_bad_handoff_not_just_the_first(kvhandoff: Run, damaged: Path) -> None:
    result = kvhandoff("verify", damaged, "--json")
    assert result.code == 1
    verified = report(VerifyReport, result.out)
    assert (verified.handoffs, verified.events) == (9, 92)
    found = [(str(f.handoff_id), f.kind, f.seq) for f in verified.findings]
    assert found == sorted((IDS[name], kind, seq) for name, kind, seq in EVERY_FINDING)
    assert verified.bad == 6
    details = {f.kind: f.detail for f in verified.findings}
    assert details[FindingKind.SEQUENCE] == "log skips from sequence 4 to 6"
    assert details[FindingKind.CORRUPT_RECORD].startswith("undecodable log record")
    assert "'frozen' is not one this build knows" in details[FindingKind.UNKNOWN_STATE]
    assert {str(d.handoff_id) for d in verified.diverged} == {
        IDS["frontend-cancel"],
        IDS["source-first-success"],
    }

    named = kvhandoff("verify", damaged, *(IDS[name] for name, _, _ in EVERY_FINDING), "--json")
    assert named.code == 1
    assert [
        (str(f.handoff_id), f.kind, f.seq) for f in report(VerifyReport, named.out).findings
    ] == found


def test_verify_prints_every_finding_for_people(kvhandoff: Run, damaged: Path) -> None:
    result = kvhandoff("verify", damaged)
    assert result.code == 1 and result.err == ""
    lines = result.out.splitlines()
    assert f"handoff {IDS['stuck-on-transfer']}: sequence: log skips from sequence 4 to 6" in lines
    assert any(
        line.startswith(f"handoff {IDS['deadline-timed-out']}: corrupt record at seq 4: ")
        for line in lines
    )
    assert (
        f"handoff {IDS['frontend-cancel']} diverges at step 5 (2025-01-01T00:02:00.700Z)" in lines
    )
    assert lines[-1] == (
        "verified 9 handoffs, 92 events: 6 bad (divergence 2, digest_mismatch 1,"
        " corrupt_record 1, sequence 1, unknown_state 1)"
    )


def test_a_handoff_whose_events_run_on_from_another_is_checked_alone(
    kvhandoff: Run, writable_log: Path
) -> None:
    # reopened-after-success loses seqs 0 and 1; its seq 2 follows just-started's last (1) in
    # the scan, as if one log. just-started is fine; reopened-after-success is what is wrong.
    logedit.delete_events(writable_log, IDS["reopened-after-success"], 0, 1)
    (finding,) = report(VerifyReport, kvhandoff("verify", writable_log, "--json").out).findings
    assert (str(finding.handoff_id), finding.kind) == (IDS["reopened-after-success"], "sequence")
    assert finding.detail == "log begins at sequence 2, not 0"


def test_stuck_on_a_handoff_whose_log_diverges_waits_since_its_last_input(
    kvhandoff: Run, writable_golden: Path
) -> None:
    # stuck-on-reserve logged reserve_destination(1) at seq 4; make it another action id, so
    # that the action the rebuilt coordinator waits for is not in the log.
    def renumbered(record: LogRecord) -> LogRecord:
        assert isinstance(record, ActionRecord)
        return msgspec.structs.replace(
            record, action=msgspec.structs.replace(record.action, action_id=7)
        )

    logedit.rewrite(writable_golden, IDS["stuck-on-reserve"], 4, renumbered)
    result = kvhandoff("stuck", writable_golden, "--now", NOW, "--json")
    assert result.code == 0
    reserve = report(StuckReport, result.out).handoffs[0]
    assert str(reserve.handoff.handoff_id) == IDS["stuck-on-reserve"]
    (waits,) = reserve.waiting
    assert reserve.last_input is not None and waits.since_ms == reserve.last_input.at_ms


# --- states this build does not know ---------------------------------------------------------


@pytest.fixture
def frozen(writable_golden: Path) -> Path:
    """just-started, in a state a newer worker might have: "frozen"."""
    logedit.set_state(writable_golden, IDS["just-started"], "frozen")
    return writable_golden


def _warning(command: str, name: str) -> str:
    return (
        f"kvhandoff {command}: warning: handoff {IDS[name]}: state 'frozen' is not one this"
        " build knows"
    )


def test_list_shows_a_state_it_does_not_know_as_written(kvhandoff: Run, frozen: Path) -> None:
    result = kvhandoff("list", frozen, "--json")
    assert result.code == 0 and result.err == _warning("list", "just-started") + "\n"
    by_id = {str(h.handoff.handoff_id): h.handoff for h in report(ListReport, result.out).handoffs}
    odd = by_id[IDS["just-started"]]
    assert (odd.state, odd.unknown_state, odd.state_name) == (None, "frozen", "frozen")
    assert by_id[IDS["stuck-on-reserve"]].unknown_state is None

    text = kvhandoff("list", frozen, "--sort", "state")
    assert text.code == 0
    row = next(line for line in text.out.splitlines() if line.startswith(IDS["just-started"]))
    assert row.split()[1] == "frozen(unknown)"
    assert text.out.splitlines()[-1] == "9 handoffs"
    # A state filter names known states only, so it leaves the odd one out, and quietly.
    filtered = kvhandoff("list", frozen, "--state", "open", "--json")
    assert filtered.err == "" and IDS["just-started"] not in filtered.out


def test_replay_and_stuck_name_a_state_they_do_not_know(kvhandoff: Run, frozen: Path) -> None:
    replay = kvhandoff("replay", frozen, IDS["just-started"])
    assert replay.code == 0 and replay.err == _warning("replay", "just-started") + "\n"
    assert replay.out.splitlines()[0].endswith("vllm-prefill-0 -> vllm-decode-0  frozen(unknown)")
    as_json = report(ReplayReport, kvhandoff("replay", frozen, "2860", "--format", "json").out)
    assert as_json.handoff.unknown_state == "frozen"

    stuck = kvhandoff("stuck", frozen, "--now", NOW, "--json")
    assert stuck.code == 0
    assert stuck.err == _warning("stuck", "just-started") + "; looked at like an open one\n"
    stuck_report = report(StuckReport, stuck.out)
    assert (stuck_report.open, stuck_report.unknown_state) == (2, 1)
    last = kvhandoff("stuck", frozen, "--now", NOW).out.splitlines()[-1]
    assert last == (
        "3 of 3 open handoffs idle for at least 0ms (1 in a state this build does not know)"
        " (now 2025-01-01T00:15:20.000Z)"
    )
    odd = next(h for h in stuck_report.handoffs if str(h.handoff.handoff_id) == IDS["just-started"])
    (waits,) = odd.waiting
    assert waits.action is not None and waits.action.__struct_config__.tag == "submit_prefill"


def test_an_export_keeps_a_state_this_build_does_not_know(
    kvhandoff: Run, frozen: Path, tmp_path: Path
) -> None:
    export = tmp_path / "frozen.jsonl"
    assert kvhandoff("export", frozen, IDS["just-started"], "-o", export).code == 0
    header = msgspec.json.decode(export.read_bytes().splitlines()[0])
    assert (header["handoff"]["state"], header["handoff"]["unknown_state"]) == (None, "frozen")
    (listed,) = report(ListReport, kvhandoff("list", export, "--json").out).handoffs
    assert listed.handoff.unknown_state == "frozen"

    # An export by a build that knows the state spells it out; this build reads it all the same.
    newer = tmp_path / "newer.jsonl"
    lines = (V1 / "frontend-cancel.jsonl").read_bytes().splitlines()
    lines[0] = lines[0].replace(b'"state":"canceled"', b'"state":"archived"')
    newer.write_bytes(b"\n".join(lines))
    (listed,) = report(ListReport, kvhandoff("list", newer, "--json").out).handoffs
    assert (listed.handoff.state, listed.handoff.unknown_state) == (None, "archived")
    assert kvhandoff("replay", newer).code == 0


# --- quarantined handoffs ---------------------------------------------------------------------

REASON = "quarantined: cannot rebuild from its log: undecodable log record at seq 4"


@pytest.fixture
def quarantined(writable_golden: Path) -> Path:
    """stuck-on-transfer with an undecodable record, set aside by the worker; stuck-on-reserve
    set aside although its log reads (the worker's build could not replay it)."""
    transfer, reserve = IDS["stuck-on-transfer"], IDS["stuck-on-reserve"]
    logedit.set_record(writable_golden, transfer, 4, b"\xc1")
    # A rejection of an input before it was set aside, which is not the reason.
    logedit.execute(
        writable_golden,
        "INSERT INTO rejections (at_ms, handoff_id, reason, payload) VALUES (?, ?, ?, ?)",
        QUARANTINED_AT - 5,
        transfer,
        "premature: transfer_completed",
        b"",
    )
    logedit.quarantine(writable_golden, transfer, QUARANTINED_AT, REASON)
    logedit.quarantine(writable_golden, reserve, QUARANTINED_AT + 1, "quarantined: diverges")
    return writable_golden


def test_list_filters_on_the_quarantined_state_and_gives_the_reason(
    kvhandoff: Run, quarantined: Path
) -> None:
    result = kvhandoff("list", quarantined, "--state", "quarantined", "--json")
    assert result.code == 0 and result.err == ""
    listed = report(ListReport, result.out).handoffs
    assert [str(h.handoff.handoff_id) for h in listed] == [
        IDS["stuck-on-reserve"],
        IDS["stuck-on-transfer"],
    ]
    assert listed[1].handoff.state == "quarantined"
    assert listed[1].handoff.quarantine is not None
    assert (listed[1].handoff.quarantine.at_ms, listed[1].handoff.quarantine.reason) == (
        QUARANTINED_AT,
        REASON,
    )
    text = kvhandoff("list", quarantined, "--state", "quarantined").out.splitlines()
    assert [line.split()[1] for line in text[1:-1]] == ["quarantined", "quarantined"]


def test_stuck_shows_quarantined_handoffs_whatever_their_age(
    kvhandoff: Run, quarantined: Path
) -> None:
    # Neither has been idle for a day: only quarantine puts them in the report.
    result = kvhandoff("stuck", quarantined, "--older-than", "1d", "--now", NOW, "--json")
    assert result.code == 0 and result.err == ""
    stuck = report(StuckReport, result.out)
    assert (stuck.open, stuck.quarantined) == (1, 2)
    by_id = {str(h.handoff.handoff_id): h for h in stuck.handoffs}
    assert set(by_id) == {IDS["stuck-on-transfer"], IDS["stuck-on-reserve"]}

    unreadable = by_id[IDS["stuck-on-transfer"]]
    assert unreadable.state == REASON
    assert (unreadable.waiting, unreadable.last_input, unreadable.outstanding) == ([], None, [])
    readable = by_id[IDS["stuck-on-reserve"]]
    assert readable.state == "quarantined: diverges" and readable.waiting == []
    assert readable.last_input is not None and readable.last_input.seq == 3

    text = kvhandoff("stuck", quarantined, "--older-than", "1d", "--now", NOW).out.splitlines()
    row = next(line for line in text if line.startswith(IDS["stuck-on-transfer"]))
    assert f"{REASON}  an operator  2025-01-01T00:06:40.000Z  -" in row
    assert text[-1] == (
        "0 of 1 open handoff idle for at least 1d00h, and 2 quarantined"
        " (now 2025-01-01T00:15:20.000Z)"
    )


def test_a_quarantined_handoffs_export_keeps_the_reason(
    kvhandoff: Run, quarantined: Path, tmp_path: Path
) -> None:
    export = tmp_path / "reserve.jsonl"
    assert kvhandoff("export", quarantined, IDS["stuck-on-reserve"], "-o", export).code == 0
    stuck = report(StuckReport, kvhandoff("stuck", export, "--now", NOW, "--json").out)
    (handoff,) = stuck.handoffs
    assert handoff.state == "quarantined: diverges" and stuck.quarantined == 1


@pytest.mark.parametrize("command", ["list", "stuck", "replay"])
def test_every_report_schema_knows_the_quarantined_state(kvhandoff: Run, command: str) -> None:
    schema = msgspec.json.decode(kvhandoff(command, "--print-schema").out)
    assert "quarantined" in schema["$defs"]["HandoffState"]["enum"]
    summary = schema["$defs"]["HandoffRow"]
    assert {"unknown_state", "quarantine"} <= set(summary["properties"])


def test_the_verify_schema_names_every_kind_of_finding(kvhandoff: Run) -> None:
    schema = msgspec.json.decode(kvhandoff("verify", "--print-schema").out)
    assert set(schema["$defs"]["FindingKind"]["enum"]) == set(FindingKind)
    assert {"findings", "digests_checked"} <= set(schema["$defs"]["VerifyReport"]["properties"])


# --- layout 2 ---------------------------------------------------------------------------------


def test_verify_finds_layout_2_records_that_cannot_be_put_back_together(
    kvhandoff: Run, writable_log_v2: Path
) -> None:
    timed_out, failed = IDS["deadline-timed-out"], IDS["failed-outcome"]
    logedit.set_record(writable_log_v2, timed_out, 4, b"\xc1 not msgpack")
    logedit.execute(
        writable_log_v2,
        f"UPDATE events SET type = 99 WHERE handoff_key = {logedit.KEY_OF} AND seq = 2",
        failed,
    )

    result = kvhandoff("verify", writable_log_v2, "--json")
    assert result.code == 1
    verified = report(VerifyReport, result.out)
    wrong = [
        (timed_out, 4, "log record's fields are not a msgpack map of a message's fields"),
        (failed, 2, "log record of unknown type 99"),
    ]
    assert [(str(f.handoff_id), f.kind, f.seq) for f in verified.findings] == [
        (handoff_id, "corrupt_record", seq) for handoff_id, seq, _ in wrong
    ]
    assert all(why in f.detail for f, (*_, why) in zip(verified.findings, wrong, strict=True))
    assert (verified.handoffs, verified.events, verified.digests_checked) == (9, 93, False)
    # The commands that read one handoff say what is wrong with the record, and where.
    for handoff_id, seq, why in wrong:
        replay = kvhandoff("replay", writable_log_v2, handoff_id)
        assert replay.code == 2
        assert replay.err == f"kvhandoff replay: handoff {handoff_id} seq {seq}: {why}\n"


def test_a_layout_2_handoff_that_lost_events_is_the_one_reported(
    kvhandoff: Run, writable_log_v2: Path
) -> None:
    # Layout 2 scans one handoff key at a time: no run of rows can hide another's.
    logedit.delete_events(writable_log_v2, IDS["reopened-after-success"], 0, 1)
    logedit.delete_events(writable_log_v2, IDS["frontend-cancel"], 4)
    verified = report(VerifyReport, kvhandoff("verify", writable_log_v2, "--json").out)
    assert [(str(f.handoff_id), f.kind, f.detail) for f in verified.findings] == [
        (IDS["reopened-after-success"], "sequence", "log begins at sequence 2, not 0"),
        (IDS["frontend-cancel"], "sequence", "log skips from sequence 3 to 5"),
    ]


def test_events_filed_under_no_handoff_belong_to_none(
    kvhandoff: Run, writable_log_v2: Path
) -> None:
    """An event whose key no handoff row has (a row deleted by hand) has no handoff id to be
    read back with: the tools leave it out, and the rest of the log reads as before."""
    logedit.execute(
        writable_log_v2,
        "INSERT INTO events SELECT 99, seq, type, at_ms, record FROM events"
        f" WHERE handoff_key = {logedit.KEY_OF}",
        IDS["just-started"],
    )
    logedit.execute(
        writable_log_v2,
        "INSERT INTO events SELECT 0, seq, type, at_ms, record FROM events"
        f" WHERE handoff_key = {logedit.KEY_OF}",
        IDS["failed-outcome"],
    )
    verified = kvhandoff("verify", writable_log_v2)
    assert (verified.code, verified.out) == (
        0,
        "verified 9 handoffs, 93 events (no input digests in a layout-2 log): all match\n",
    )
    listed = report(ListReport, kvhandoff("list", writable_log_v2, "--json").out)
    assert len(listed.handoffs) == 9


# --- tombstones a snapshot left ---------------------------------------------------------------


def test_verify_finds_a_tombstone_that_the_files_own_rows_contradict(
    kvhandoff: Run, writable_log_v2: Path
) -> None:
    """A file caught up from a snapshot keeps the tombstones of the handoffs that ended
    (worker.log.store); one that says another end than the file's own rows of the handoff is a
    finding, one that agrees is none."""
    agreed, contradicted = IDS["source-first-success"], IDS["frontend-cancel"]
    with sqlite3.connect(writable_log_v2) as db:
        db.execute(TOMBSTONES)
        far_future = 4_000_000_000_000  # ended after any start in the golden log
        db.executemany(
            "INSERT INTO tombstones VALUES (?, ?, ?, ?)",
            [
                (agreed, "succeeded", far_future, b"\x90"),
                (contradicted, "succeeded", far_future, b"\x90"),
            ],
        )
    result = kvhandoff("verify", writable_log_v2, "--json")
    assert result.code == 1
    (finding,) = report(VerifyReport, result.out).findings
    assert (str(finding.handoff_id), finding.kind) == (contradicted, FindingKind.TOMBSTONE)
    assert finding.detail == "a snapshot's tombstone says it ended succeeded, its rows say canceled"
