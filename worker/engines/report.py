"""What an engine process reports: each engine's accounting and the leaks it found.

Engines subscribe to `<prefix>.done.>`. A leak is a handoff whose `Complete` the engine saw while
it still holds blocks or a slot for it, or still waits for them, other than a destination whose
decode is legitimately running after activation. Each engine process answers requests on
`<prefix>.engines.report` with one `EnginesReport` (`request_reports` is the scatter-gather
client) and returns the same report when it stops. The report's types are wire vocabulary
(`events.reports`): engines in other languages answer with them too.
"""

from __future__ import annotations

import logging

import msgspec

from kvhandoff.client import Connection
from kvhandoff.events.reports import EngineCounters, EnginesReport, EngineStatus, Leak

logger = logging.getLogger(__name__)

__all__ = ["EngineCounters", "EngineStatus", "EnginesReport", "Leak", "request_reports", "settled"]


_report_decoder = msgspec.json.Decoder(EnginesReport)


def settled(reports: list[EnginesReport]) -> bool:
    """True when the engines hold blocks only for decodes that are still running."""
    statuses = [status for report in reports for status in report.engines]
    return all(s.blocks_held == s.blocks_decoding and s.waiting == 0 for s in statuses)


async def request_reports(
    connection: Connection, *, first_reply_s: float = 1.0, quiet_s: float = 0.2
) -> list[EnginesReport]:
    """Ask every engine process for its report (scatter-gather, `Connection.gather`).

    Waits up to `first_reply_s` for the first reply, then gathers replies until `quiet_s`
    passes without one. An undecodable reply is logged and skipped.
    """
    reports: list[EnginesReport] = []
    replies = await connection.gather(
        connection.subjects.engines_report, first_reply_s=first_reply_s, quiet_s=quiet_s
    )
    for reply in replies:
        try:
            reports.append(_report_decoder.decode(reply))
        except msgspec.DecodeError as exc:
            logger.warning("skipped an undecodable engines report: %s", exc)
    return reports
