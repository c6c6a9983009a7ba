"""The offline tools on logs that are not as this build's worker would leave them: edited inputs,
undecodable records, lost events.

`verify` must name every bad handoff, each under its own id, and exit 1; the other commands
must carry on with the rest, never end in a traceback.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from events.messages import ActionFailed, ActionOutcome, SourceHeld
from events.records import ActionRecord, InputRecord, LogRecord
from tests.tools import logedit
from tests.tools.conftest import IDS, V1, Run
from tests.tools.test_commands import report
from worker.reports import FindingKind, StuckReport, VerifyReport

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
            cancel, "digest_mismatch", 3
        )  # fmt: skip
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
    """The tampered log (two divergences) with three more handoffs damaged, each differently."""
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
    return path


EVERY_FINDING = [
    ("frontend-cancel", FindingKind.DIVERGENCE, 5),
    ("source-first-success", FindingKind.DIVERGENCE, 6),
    ("failed-outcome", FindingKind.DIGEST_MISMATCH, 2),
    ("deadline-timed-out", FindingKind.CORRUPT_RECORD, 4),
    ("stuck-on-transfer", FindingKind.SEQUENCE, None),
]


def test_verify_reports_every_bad_handoff_not_just_the_first(kvhandoff: Run, damaged: Path) -> None:
    result = kvhandoff("verify", damaged, "--json")
    assert result.code == 1
    verified = report(VerifyReport, result.out)
    assert (verified.handoffs, verified.events) == (9, 92)
    found = [(str(f.handoff_id), f.kind, f.seq) for f in verified.findings]
    assert found == sorted((IDS[name], kind, seq) for name, kind, seq in EVERY_FINDING)
    assert verified.bad == 5
    details = {f.kind: f.detail for f in verified.findings}
    assert details[FindingKind.SEQUENCE] == "log skips from sequence 4 to 6"
    assert details[FindingKind.CORRUPT_RECORD].startswith("undecodable log record")
    assert {str(d.handoff_id) for d in verified.diverged} == {
        IDS["frontend-cancel"], IDS["source-first-success"]
    }  # fmt: skip

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
        "verified 9 handoffs, 92 events: 5 bad (divergence 2, digest_mismatch 1,"
        " corrupt_record 1, sequence 1)"
    )


def test_a_handoff_whose_events_run_on_from_another_is_checked_alone(
    kvhandoff: Run, writable_log: Path
) -> None:
    # reopened-after-success loses seqs 0 and 1; its seq 2 follows just-started's last (1) in
    # the scan, as if one log. just-started is fine; reopened-after-success is what is wrong.
    for seq in (0, 1):
        logedit.execute(
            writable_log,
            "DELETE FROM events WHERE handoff_id = ? AND seq = ?",
            IDS["reopened-after-success"],
            seq,
        )
    (finding,) = report(VerifyReport, kvhandoff("verify", writable_log, "--json").out).findings
    assert (str(finding.handoff_id), finding.kind) == (IDS["reopened-after-success"], "sequence")
    assert finding.detail == "log begins at sequence 2, not 0"


def test_stuck_on_a_handoff_whose_log_diverges_waits_since_its_last_input(
    kvhandoff: Run, writable_log: Path
) -> None:
    # stuck-on-reserve logged reserve_destination(1) at seq 4; make it another action id, so
    # that the action the rebuilt coordinator waits for is not in the log.
    def renumbered(record: LogRecord) -> LogRecord:
        assert isinstance(record, ActionRecord)
        return msgspec.structs.replace(
            record, action=msgspec.structs.replace(record.action, action_id=7)
        )

    logedit.rewrite(writable_log, IDS["stuck-on-reserve"], 4, renumbered)
    result = kvhandoff("stuck", writable_log, "--now", NOW, "--json")
    assert result.code == 0
    reserve = report(StuckReport, result.out).handoffs[0]
    assert str(reserve.handoff.handoff_id) == IDS["stuck-on-reserve"]
    (waits,) = reserve.waiting
    assert reserve.last_input is not None and waits.since_ms == reserve.last_input.at_ms
