"""Rebuilding a coordinator from its logged inputs.

Only accepted inputs are logged, and an accepted input does the same thing every time it is
applied to the same state, so feeding a handoff's `InputRecord`s, in sequence order, to a fresh
coordinator rebuilds exactly the coordinator that logged them. The first input of every
handoff's log is its `StartHandoff`.
"""

from __future__ import annotations

from collections.abc import Iterable

from events.coordinator import HandoffCoordinator
from events.errors import InputRejected, LogCorrupt
from events.messages import StartHandoff
from events.records import InputRecord, LogRecord


def rebuild(records: Iterable[LogRecord]) -> tuple[StartHandoff, HandoffCoordinator]:
    """The handoff's start command and its coordinator after every logged input."""
    start: StartHandoff | None = None
    coordinator: HandoffCoordinator | None = None
    for record in records:
        if not isinstance(record, InputRecord):
            continue
        message = record.input
        if coordinator is None:
            if not isinstance(message, StartHandoff):
                raise LogCorrupt(f"handoff {message.handoff_id}: log does not begin with a start")
            start = message
            coordinator = HandoffCoordinator.for_start(message)
        try:
            coordinator.handle(message)
        except InputRejected as exc:
            raise LogCorrupt(f"logged input no longer accepted: {exc}") from exc
    if start is None or coordinator is None:
        raise LogCorrupt("empty handoff log")
    return start, coordinator
