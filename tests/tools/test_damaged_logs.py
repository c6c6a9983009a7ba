"""The offline tools on logs that are not as this build's worker would leave them."""

from __future__ import annotations

from pathlib import Path

import msgspec

from events.records import ActionRecord, LogRecord
from tests.tools import logedit
from tests.tools.conftest import IDS, Run
from tests.tools.test_commands import report
from worker.reports import StuckReport

NOW = "2025-01-01T00:15:20Z"


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
