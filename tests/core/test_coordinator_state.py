"""The coordinator's state as four records, and the handoff id checked on every entry point.

Table-driven, beside the property tests: an input for another handoff is refused, whatever its
kind, whichever entry point takes it and whatever the coordinator's mode, naming this handoff,
the state and the input, and changing nothing; a snapshot holds copies of the four records that
later inputs do not touch, and survives a JSON round trip (it is part of `kvhandoff replay`'s
report).
"""

from __future__ import annotations

from collections.abc import Callable
from uuid import UUID

import msgspec
import pytest

from kvhandoff.events.coordinator import (
    ActionJournal,
    CoordinatorState,
    DestinationProgress,
    HandoffCoordinator,
    Mode,
    SourceProgress,
    TransferProgress,
)
from kvhandoff.events.errors import InputRejected
from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    SCHEDULED,
    SUBMITTED,
    ActionOutcome,
    Canceled,
    DestinationReserved,
    EngineType,
    Fact,
    Failed,
    HandoffOrder,
    HandoffTransferTiming,
    Input,
    KvTransferTimingMode,
    ReserveDestination,
    SourceHeld,
    StartHandoff,
    StartTransfer,
    SubmitPrefill,
    TimedOut,
    TransferCompleted,
)
from kvhandoff.events.replay import diff

H = UUID("3b8f9c1e-2d4a-4e6b-8c0d-5f7a9b1c3e5d")
OTHER = UUID("00000000-0000-0000-0000-00000000dead")
TIMING = HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, 4096, 131_072, 25.0)
SOURCE_FIRST = HandoffOrder.SOURCE_FIRST


def start(handoff_id: UUID) -> StartHandoff:
    return StartHandoff(handoff_id, EngineType.VLLM, "prefill-0", "decode-0", deadline_ms=30_000)


HAPPY: list[Input] = [
    start(H),
    ActionOutcome(H, 0, SUBMITTED),
    SourceHeld(H, TIMING),
    ActionOutcome(H, 1, ACCEPTED),
    DestinationReserved(H, 4096),
    ActionOutcome(H, 2, SCHEDULED),
    TransferCompleted(H),
    ActionOutcome(H, 3, APPLIED),
    ActionOutcome(H, 4, APPLIED),
]

# A coordinator in each mode, as the inputs that bring it there.
MODES: dict[str, list[Input]] = {
    "not started": [],
    "active": HAPPY[:3],
    "awaiting the transfer": HAPPY[:6],
    "cleaning up": [*HAPPY[:3], Canceled(H)],
    "complete": HAPPY,
    "reopened cleanup": [*HAPPY, Failed(H)],
}

# Every kind of input, for another handoff.
FOREIGN_FACTS: list[Fact] = [
    SourceHeld(OTHER, TIMING),
    DestinationReserved(OTHER, 4096),
    TransferCompleted(OTHER),
    Failed(OTHER),
    TimedOut(OTHER),
    Canceled(OTHER),
]
FOREIGN: list[Input] = [start(OTHER), ActionOutcome(OTHER, 0, SUBMITTED), *FOREIGN_FACTS]

Entry = Callable[[HandoffCoordinator, Input], object]


def _on_fact(coordinator: HandoffCoordinator, message: Input) -> object:
    assert not isinstance(message, StartHandoff | ActionOutcome)
    return coordinator.on_fact(message)


ENTRIES: list[tuple[str, Entry, list[Input]]] = [
    ("handle", HandoffCoordinator.handle, FOREIGN),
    ("on_fact", _on_fact, list(FOREIGN_FACTS)),
]


def drive(inputs: list[Input]) -> HandoffCoordinator:
    coordinator = HandoffCoordinator(H, SOURCE_FIRST)
    for message in inputs:
        coordinator.handle(message)
    return coordinator


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("entry_name", "entry", "inputs"), ENTRIES, ids=[e[0] for e in ENTRIES])
def test_every_entry_point_refuses_another_handoffs_input_in_every_mode(
    mode: str, entry_name: str, entry: Entry, inputs: list[Input]
) -> None:
    coordinator = drive(MODES[mode])
    before = coordinator.snapshot()
    state = coordinator.describe()
    for message in inputs:
        with pytest.raises(InputRejected) as excinfo:
            entry(coordinator, message)
        rejection = excinfo.value
        assert rejection.handoff_id == H
        assert rejection.state == state
        assert rejection.input_desc == repr(message)
        assert rejection.reason == "input belongs to a different handoff"
        assert str(rejection) == (
            f"handoff {H} [{state}] rejected {message!r}: input belongs to a different handoff"
        )
        assert not rejection.premature
        assert coordinator.snapshot() == before, f"{entry_name}({message!r}) changed {mode}"


def test_the_snapshot_groups_the_state_in_four_records() -> None:
    coordinator = drive(HAPPY[:5])
    assert coordinator.snapshot() == CoordinatorState(
        handoff_id=H,
        order=SOURCE_FIRST,
        fallback_delay_ms=0.0,
        mode=Mode.ACTIVE,
        completion=None,
        journal=ActionJournal(
            started=True,
            next_id=3,
            issued={
                0: SubmitPrefill(H, 0),
                1: ReserveDestination(H, 1),
                2: StartTransfer(H, 2, 21.47483648),
            },
            outcomes={0: SUBMITTED, 1: ACCEPTED},
        ),
        source=SourceProgress(
            submit_issued=True, submitted=True, held=True, transfer_timing=TIMING
        ),
        destination=DestinationProgress(
            reserve_issued=True, accepted=True, reserved=True, transferable_prompt_tokens=4096
        ),
        transfer=TransferProgress(issued=True, delay_ms=21.47483648),
    )


def test_a_snapshot_is_a_copy_that_later_inputs_do_not_change() -> None:
    coordinator = drive(HAPPY[:2])
    early = coordinator.snapshot()
    kept = msgspec.json.encode(early)
    for message in HAPPY[2:]:
        coordinator.handle(message)
    coordinator.handle(Canceled(H))  # reopens the cleanup: the journal is written again
    assert msgspec.json.encode(early) == kept
    assert early == drive(HAPPY[:2]).snapshot()


def test_outcomes_are_kept_in_action_id_order_whatever_order_they_came_in() -> None:
    inputs: list[Input] = [*HAPPY[:3], Canceled(H)]  # issues CancelSource 2, CancelDestination 3
    one = drive([*inputs, ActionOutcome(H, 3, APPLIED)])
    two = drive([*inputs, ActionOutcome(H, 1, ACCEPTED), ActionOutcome(H, 3, APPLIED)])
    assert list(one.snapshot().journal.outcomes) == [0, 3]
    assert list(two.snapshot().journal.outcomes) == [0, 1, 3]
    three = drive([*inputs, ActionOutcome(H, 3, APPLIED), ActionOutcome(H, 1, ACCEPTED)])
    assert msgspec.json.encode(three.snapshot()) == msgspec.json.encode(two.snapshot())


@pytest.mark.parametrize("steps", range(len(HAPPY) + 1))
def test_a_snapshot_survives_a_json_round_trip(steps: int) -> None:
    state = drive(HAPPY[:steps]).snapshot()
    assert msgspec.json.decode(msgspec.json.encode(state), type=CoordinatorState) == state


def test_diff_names_a_records_field_as_record_dot_field() -> None:
    before = drive(HAPPY[:3]).snapshot()
    after = drive(HAPPY[:5]).snapshot()
    assert [c.field for c in diff(before, after)] == [
        "journal.next_id",
        "journal.issued",
        "journal.outcomes",
        "destination.accepted",
        "destination.reserved",
        "destination.transferable_prompt_tokens",
        "transfer.issued",
        "transfer.delay_ms",
    ]
    held = drive(HAPPY[:2]).snapshot()
    (timing,) = [c for c in diff(held, before) if c.field == "source.transfer_timing"]
    assert (timing.before, timing.after) == (None, TIMING)
