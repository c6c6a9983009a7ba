"""Each action's outcome and follow-up facts, idempotency per action id, and bad input."""

from __future__ import annotations

import uuid
from dataclasses import replace

from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    Action,
    ActionFailed,
    ActionOutcome,
    ActivateDestination,
    CancelDestination,
    CancelSource,
    DestinationReserved,
    HandoffTransferTiming,
    Input,
    KvTransferTimingMode,
    Outcome,
    ReleaseSource,
    ReserveDestination,
    SourceHeld,
    StartTransfer,
    SubmitPrefill,
    TransferCompleted,
)
from tests.engines.conftest import StartEngines
from tests.engines.harness import (
    BLOCKS,
    DESTINATION,
    FAST,
    PROMPT,
    SOURCE,
    WorkerSide,
    held,
    unordered,
)

# What the default model reports: 128 KiB per token over 25 GB/s, computed on the full prompt.
TIMING = HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, PROMPT, 131_072, 25.0)
LONG_DECODE = replace(FAST, decode_ms=600_000.0)


async def test_source_prefills_holds_transfers_and_releases(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines()
    source = engines.engines[SOURCE]
    h = uuid.uuid4()

    await worker_side.send(SOURCE, SubmitPrefill(h, 0))
    await worker_side.expect(h, ActionOutcome(h, 0, SUBMITTED), SourceHeld(h, TIMING))
    assert held(source) == BLOCKS

    await worker_side.send(SOURCE, StartTransfer(h, 1, delay_ms=3.0))
    await worker_side.expect(h, ActionOutcome(h, 1, SCHEDULED), TransferCompleted(h))
    assert held(source) == BLOCKS  # the source keeps its blocks until it is told to release

    await worker_side.send(SOURCE, ReleaseSource(h, 2))
    await worker_side.expect(h, ActionOutcome(h, 2, APPLIED))
    assert held(source) == 0
    assert source.capacity.used_slots == 0

    # A cleanup of a handoff the engine already let go of has nothing to do.
    await worker_side.send(SOURCE, CancelSource(h, 3))
    await worker_side.expect(h, ActionOutcome(h, 3, NOOP))


async def test_destination_reserves_whole_blocks_activates_and_decodes(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines(model=LONG_DECODE)
    destination = engines.engines[DESTINATION]
    h = uuid.uuid4()

    await worker_side.hold_destination(h)
    assert held(destination) == BLOCKS

    await worker_side.send(DESTINATION, ActivateDestination(h, 1))
    await worker_side.expect(h, ActionOutcome(h, 1, APPLIED))
    status = destination.status()
    assert (status.blocks_held, status.blocks_decoding) == (BLOCKS, BLOCKS)

    # Cancelling ends the running decode and frees its blocks.
    await worker_side.send(DESTINATION, CancelDestination(h, 2))
    await worker_side.expect(h, ActionOutcome(h, 2, APPLIED))
    assert held(destination) == 0


async def test_a_cancel_before_anything_is_a_noop_and_closes_the_handoff(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    """The cleanup overtook a lost SubmitPrefill; the late retry must not allocate blocks that
    nobody would ever free."""
    engines = await start_engines()
    h = uuid.uuid4()

    await worker_side.send(SOURCE, CancelSource(h, 1))
    await worker_side.expect(h, ActionOutcome(h, 1, NOOP))
    await worker_side.send(SOURCE, SubmitPrefill(h, 0))
    outcome = await worker_side.next(h)
    assert isinstance(outcome, ActionOutcome)
    assert isinstance(outcome.outcome, ActionFailed)
    assert "canceled" in outcome.outcome.reason
    assert held(engines.engines[SOURCE]) == 0


async def test_cancels_withdraw_a_held_source_and_a_reserved_destination(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines()
    h = uuid.uuid4()
    await worker_side.send(SOURCE, SubmitPrefill(h, 0))
    await worker_side.send(DESTINATION, ReserveDestination(h, 1))
    first = [await worker_side.next(h) for _ in range(4)]
    assert SourceHeld(h, TIMING) in first
    assert DestinationReserved(h, 96) in first

    await worker_side.send(SOURCE, CancelSource(h, 2))
    await worker_side.send(DESTINATION, CancelDestination(h, 3))
    cleanups = [await worker_side.next(h) for _ in range(2)]
    assert unordered(cleanups) == unordered(
        [ActionOutcome(h, 2, APPLIED), ActionOutcome(h, 3, APPLIED)]
    )
    assert held(engines.engines[SOURCE]) == held(engines.engines[DESTINATION]) == 0


async def test_repeated_source_actions_get_the_same_outcome_and_no_second_effect(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines()
    source = engines.engines[SOURCE]
    h = uuid.uuid4()
    steps: list[tuple[Action, Outcome, list[Input]]] = [
        (SubmitPrefill(h, 0), SUBMITTED, [SourceHeld(h, TIMING)]),
        (StartTransfer(h, 1, delay_ms=1.0), SCHEDULED, [TransferCompleted(h)]),
        # Executed twice, the second release would find nothing and answer Noop.
        (ReleaseSource(h, 2), APPLIED, []),
    ]
    for action, outcome, facts in steps:
        await worker_side.send(SOURCE, action)
        await worker_side.send(SOURCE, action)
        answer = ActionOutcome(h, action.action_id, outcome)
        received = [await worker_side.next(h) for _ in range(2 + len(facts))]
        assert unordered(received) == unordered([answer, answer, *facts])
        # Blocks are granted synchronously on execution, so a second prefill would show here.
        assert held(source) == (0 if isinstance(action, ReleaseSource) else BLOCKS)
    assert worker_side.queued(h) == []
    assert (source.counters.executed, source.counters.repeated) == (3, 3)


async def test_repeated_destination_actions_get_the_same_outcome_and_no_second_effect(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines(model=LONG_DECODE)
    destination = engines.engines[DESTINATION]
    h = uuid.uuid4()
    steps: list[tuple[Action, Outcome, list[Input], int]] = [
        (ReserveDestination(h, 0), ACCEPTED, [DestinationReserved(h, 96)], BLOCKS),
        (ActivateDestination(h, 1), APPLIED, [], BLOCKS),
        (CancelDestination(h, 2), APPLIED, [], 0),
    ]
    for action, outcome, facts, blocks in steps:
        await worker_side.send(DESTINATION, action)
        await worker_side.send(DESTINATION, action)
        answer = ActionOutcome(h, action.action_id, outcome)
        received = [await worker_side.next(h) for _ in range(2 + len(facts))]
        assert unordered(received) == unordered([answer, answer, *facts])
        assert held(destination) == blocks
    assert worker_side.queued(h) == []
    assert destination.counters.repeated == 3


async def test_misrouted_actions_fail_forward_and_noop_cleanup(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines()
    h = uuid.uuid4()
    await worker_side.send(SOURCE, ReserveDestination(h, 0))
    failed = await worker_side.next(h)
    assert isinstance(failed, ActionOutcome)
    assert failed.outcome == ActionFailed(f"{SOURCE} is a source engine")
    await worker_side.send(SOURCE, CancelDestination(h, 1))
    await worker_side.expect(h, ActionOutcome(h, 1, NOOP))
    assert held(engines.engines[SOURCE]) == 0


async def test_malformed_actions_are_ignored_and_the_engine_carries_on(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines()
    subject = worker_side.subjects.engine(SOURCE)
    await worker_side.bus.publish(subject, b"not json")
    await worker_side.bus.publish(subject, b'{"type": "submit_prefill", "handoff_id": "nope"}')
    await worker_side.bus.publish(subject, b'{"type": "explode", "action_id": 0}')
    h = uuid.uuid4()
    await worker_side.send(SOURCE, SubmitPrefill(h, 0))
    await worker_side.expect(h, ActionOutcome(h, 0, SUBMITTED))
    # One subscription delivers in order, so the bad messages were handled before.
    assert engines.engines[SOURCE].counters.malformed == 3
