"""What an engine process reports: each engine's accounting and the leaks it found.

Engines subscribe to `<prefix>.done.>`. A leak is a handoff whose `Complete` the engine saw while
it still holds blocks or a slot for it, or still waits for them, other than a destination whose
decode is legitimately running after activation. Each engine process answers requests on
`<prefix>.engines.report` with one `EnginesReport` (`request_reports` is the scatter-gather
client) and returns the same report when it stops.
"""

from __future__ import annotations

import logging

import msgspec
from msgspec import Struct

from kvhandoff.client import Connection
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import EngineType, Role

logger = logging.getLogger(__name__)


class EngineCounters(Struct):
    """What one engine did since it started."""

    executed: int = 0  # action ids executed (first receipts)
    repeated: int = 0  # repeated action ids answered with the stored outcome
    malformed: int = 0  # messages that did not decode as an action
    dropped: int = 0  # receipts dropped by fault injection
    ignored: int = 0  # receipts ignored while silent
    delayed: int = 0  # receipts delayed by fault injection
    duplicated: int = 0  # outcomes and facts published twice
    injected_failures: int = 0


class EngineStatus(Struct, frozen=True):
    engine_id: str
    engine_type: EngineType
    role: Role
    silent: bool
    blocks_total: int
    blocks_held: int
    blocks_decoding: int
    slots_total: int
    slots_held: int
    waiting: int
    open_handoffs: int
    counters: EngineCounters


class Leak(Struct, frozen=True):
    """Blocks or a slot held (or still awaited) for a handoff that the worker completed."""

    engine_id: str
    handoff_id: HandoffId
    state: str
    blocks: int
    waiting: bool


class EnginesReport(Struct, frozen=True, tag="engines_report", tag_field="type"):
    """One engine process's answer on `<prefix>.engines.report`."""

    process: str
    engines: list[EngineStatus]
    leaks: list[Leak]


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
