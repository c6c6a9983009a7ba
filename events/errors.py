"""The core's exceptions, rooted at one class so callers can catch everything the core raises.

HandoffError
├── InputRejected       an input the coordinator refused; the coordinator is unchanged
│                       (events.coordinator)
├── ReplayDivergence    a logged action differs from the one the coordinator re-derives
│                       (events.replay)
└── LogCorrupt          a stored record cannot be decoded or upcast, or a log breaks the
                        replay's rules (events.codec, events.replay)

The core reads no files: `LogCorrupt` is about records and their order, whoever stored them.
What surrounds records in the worker's storage (a SQLite file, its rows, the JSONL export
format) is the worker's to judge, as `worker.errors.StoreCorrupt`. A `TypeError` or
`ValueError` from the core is a bug in its caller (a value that no decoder would have let
through), not a condition to handle.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID


class HandoffError(Exception):
    """Root of every error the core raises."""


class InputRejected(HandoffError):
    """An input the coordinator refused. Nothing about the coordinator changed.

    Names the handoff, the coordinator's state when the input arrived, and the input, so a
    log line or a rejection message is enough to understand what happened. `premature` marks a
    fact that arrived before the input it depends on; it may be accepted once that input is.
    """

    def __init__(
        self,
        handoff_id: UUID,
        state: str,
        input_desc: str,
        reason: str,
        *,
        premature: bool = False,
    ) -> None:
        super().__init__(f"handoff {handoff_id} [{state}] rejected {input_desc}: {reason}")
        self.handoff_id = handoff_id
        self.state = state
        self.input_desc = input_desc
        self.reason = reason
        self.premature = premature


class ReplayDivergence(HandoffError):
    """Replaying a handoff's inputs re-derived actions that differ from the logged ones."""

    def __init__(self, handoff_id: UUID, step: int, detail: str, **context: Any) -> None:
        super().__init__(f"handoff {handoff_id} diverges at step {step}: {detail}")
        self.handoff_id = handoff_id
        self.step = step
        self.detail = detail
        self.context = context


class LogCorrupt(HandoffError):
    """A stored record that cannot be decoded, or whose schema version is unknown."""
