"""What a healthy engine answers to each action: the expected outcome, then the fact it leads
to. The worker's tests script their engines with it, and the benches drive their traffic with
it, so both exercise exactly the protocol's success path (the mock engines in `worker.engines`
model capacity and faults on top of the same answers)."""

from __future__ import annotations

from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    SCHEDULED,
    SUBMITTED,
    Action,
    ActionOutcome,
    ActivateDestination,
    CancelDestination,
    CancelSource,
    Complete,
    DestinationReserved,
    HandoffTransferTiming,
    Input,
    KvTransferTimingMode,
    ReleaseSource,
    ReserveDestination,
    SourceHeld,
    StartTransfer,
    SubmitPrefill,
    TransferCompleted,
)

#: The transfer timing a healthy source reports: 128 prompt tokens of 1 KiB at 10 GB/s.
TIMING = HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, 128, 1024, 10.0)


def success_script(action: Action) -> list[Input]:
    """The inputs a healthy engine sends in answer to `action`, in order."""
    h, i = action.handoff_id, action.action_id
    match action:
        case SubmitPrefill():
            return [ActionOutcome(h, i, SUBMITTED), SourceHeld(h, TIMING)]
        case ReserveDestination():
            return [ActionOutcome(h, i, ACCEPTED), DestinationReserved(h, 128)]
        case StartTransfer():
            return [ActionOutcome(h, i, SCHEDULED), TransferCompleted(h)]
        case ActivateDestination() | ReleaseSource() | CancelSource() | CancelDestination():
            return [ActionOutcome(h, i, APPLIED)]
        case Complete():
            return []
    raise AssertionError(f"no scripted answer to {action!r}")
