"""Checks the reference conformance vectors (`tests/core/conformance/`) against the coordinator.

Each case drives one coordinator through a list of ops and records, after every op, what the
reference returned. We compare against `expect_atomic`: ok versus err, the issued actions (kind,
id, order, delay within a relative 1e-9), and `complete`/`completion` after the op. On top of
the reference we check our own atomicity promise: a rejected op leaves `snapshot()` unchanged.

The cases come in as decoded JSON objects: reading them from their files is IO, and so the
shell's (`worker.conformance.vectors`), as for everything else of the core.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from kvhandoff.events.coordinator import HandoffCoordinator
from kvhandoff.events.errors import InputRejected
from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    Action,
    ActionFailed,
    Canceled,
    DestinationReserved,
    Fact,
    Failed,
    HandoffOrder,
    HandoffTransferTiming,
    KvTransferTimingMode,
    Outcome,
    SourceHeld,
    StartTransfer,
    TimedOut,
    TransferCompleted,
)

EXPECTATION = "expect_atomic"
OTHER_HANDOFF = UUID("00000000-0000-0000-0000-00000000dead")

_ORDERS = {
    "SourceFirst": HandoffOrder.SOURCE_FIRST,
    "DestinationFirst": HandoffOrder.DESTINATION_FIRST,
}
_MODES = {
    "FullPrompt": KvTransferTimingMode.FULL_PROMPT,
    "DestinationMissing": KvTransferTimingMode.DESTINATION_MISSING,
}
_OUTCOMES: dict[str, Outcome] = {
    "Submitted": SUBMITTED,
    "Accepted": ACCEPTED,
    "Scheduled": SCHEDULED,
    "Applied": APPLIED,
    "Noop": NOOP,
}
_SIMPLE_FACTS: dict[str, type[TransferCompleted | Failed | TimedOut | Canceled]] = {
    "TransferCompleted": TransferCompleted,
    "Failed": Failed,
    "TimedOut": TimedOut,
    "Canceled": Canceled,
}
_COMPLETIONS = {None: None, "Success": "success", "Canceled": "canceled"}


@dataclass
class Mismatch:
    case: str
    step: int
    op: Any
    expected: Any
    actual: Any

    def __str__(self) -> str:
        return (
            f"case {self.case}, step {self.step}: op {self.op}\n"
            f"  expected {self.expected}\n  actual   {self.actual}"
        )


@dataclass
class Report:
    passed: int = 0
    failed: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    def summary(self) -> str:
        return f"{self.passed} passed, {self.failed} failed"


def _number(value: float | str | None) -> float | None:
    # The vectors spell non-finite floats as strings, since JSON cannot.
    return None if value is None else float(value)


def _fact(op: dict[str, Any], own: UUID) -> Fact:
    handoff_id = own if op["handoff"] == "own" else OTHER_HANDOFF
    kind = op["type"]
    if kind == "SourceHeld":
        t = op["timing"]
        timing = HandoffTransferTiming(
            mode=_MODES[t["mode"]],
            full_prompt_tokens=t["full_prompt_tokens"],
            kv_bytes_per_token=t["kv_bytes_per_token"],
            bandwidth_gb_s=_number(t["bandwidth_gb_s"]),
        )
        return SourceHeld(handoff_id, timing)
    if kind == "DestinationReserved":
        return DestinationReserved(handoff_id, op["transferable_prompt_tokens"])
    return _SIMPLE_FACTS[kind](handoff_id)


def _outcome(raw: str | dict[str, str]) -> Outcome:
    if isinstance(raw, dict):
        return ActionFailed(raw["Failed"])
    return _OUTCOMES[raw]


def _apply(coordinator: HandoffCoordinator, op: dict[str, Any]) -> list[Action]:
    match op["op"]:
        case "start":
            return coordinator.start()
        case "fact":
            return coordinator.on_fact(_fact(op, coordinator.handoff_id))
        case "outcome":
            return coordinator.on_action_outcome(op["action_id"], _outcome(op["outcome"]))
    raise ValueError(f"unknown op {op!r}")


def _same_delay(expected: float | str, actual: float) -> bool:
    want = float(expected)
    if math.isnan(want) or math.isinf(want):
        return want == actual or (math.isnan(want) and math.isnan(actual))
    return math.isclose(want, actual, rel_tol=1e-9, abs_tol=0.0)


def _same_actions(expected: list[dict[str, Any]], actual: list[Action]) -> bool:
    if len(expected) != len(actual):
        return False
    for want, got in zip(expected, actual, strict=True):
        if want["action"] != type(got).__name__ or want["id"] != got.action_id:
            return False
        if isinstance(got, StartTransfer) and not _same_delay(want["delay_ms"], got.delay_ms):
            return False
    return True


def run_case(case: dict[str, Any]) -> Mismatch | None:
    """The first step at which the coordinator departs from the case, or None."""
    coordinator = HandoffCoordinator(UUID(case["handoff_id"]), _ORDERS[case["order"]])
    for step, (op, expected) in enumerate(zip(case["ops"], case[EXPECTATION], strict=True)):
        before = coordinator.snapshot()
        result: dict[str, Any]
        try:
            actions = _apply(coordinator, op)
        except InputRejected as exc:
            result = {"err": exc.reason}
            ok = "err" in expected["result"] and coordinator.snapshot() == before
        else:
            result = {"ok": [f"{type(a).__name__}#{a.action_id}" for a in actions]}
            ok = "ok" in expected["result"] and _same_actions(expected["result"]["ok"], actions)
        completion = coordinator.completion
        ok = (
            ok
            and coordinator.is_complete == expected["complete"]
            and completion == _COMPLETIONS[expected["completion"]]
        )
        if not ok:
            actual = {
                "result": result,
                "complete": coordinator.is_complete,
                "completion": completion,
            }
            return Mismatch(case["case"], step, op, expected, actual)
    return None


def check(cases: Iterable[dict[str, Any]], keep: int = 5) -> Report:
    """Run every case; keep the first `keep` mismatches for display."""
    report = Report()
    for case in cases:
        mismatch = run_case(case)
        if mismatch is None:
            report.passed += 1
            continue
        report.failed += 1
        if len(report.mismatches) < keep:
            report.mismatches.append(mismatch)
    return report
