"""The worker end to end: a real nats-server, the worker process, SQLite, scripted engines."""

from __future__ import annotations

import sqlite3
import uuid

import msgspec
import pytest

from kvhandoff.events import codec
from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    SUBMITTED,
    Action,
    ActionFailed,
    ActionOutcome,
    ActivateDestination,
    CancelDestination,
    Canceled,
    CancelSource,
    Complete,
    DestinationReserved,
    EngineType,
    HandoffCompletion,
    Input,
    Rejection,
    ReleaseSource,
    ReserveDestination,
    SourceHeld,
    StartHandoff,
    StartTransfer,
    SubmitPrefill,
    TimedOut,
    TransferCompleted,
)
from kvhandoff.worker.engines.healthy import TIMING, success_script
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.log.schema import HandoffState
from tests.eventually import until
from tests.worker.conftest import (
    WorkerProcess,
    completed_inputs,
    logged_actions,
    logged_inputs,
)
from tests.worker.scripted_engine import ScriptedEngines


def start(engine_type: EngineType, deadline_ms: int = 60_000) -> StartHandoff:
    return StartHandoff(uuid.uuid4(), engine_type, "prefill-0", "decode-0", deadline_ms)


def kinds(actions: list[Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


@pytest.mark.parametrize(
    ("engine_type", "expected"),
    [
        (EngineType.VLLM, ["SubmitPrefill", "ReserveDestination"]),
        (EngineType.TRTLLM, ["SubmitPrefill", "ReserveDestination"]),
        (EngineType.SGLANG, ["ReserveDestination", "SubmitPrefill"]),
    ],
)
async def test_both_orders_complete_with_success(
    worker: WorkerProcess, engines: ScriptedEngines, engine_type: EngineType, expected: list[str]
) -> None:
    command = start(engine_type)
    await engines.start_handoff(command)
    await engines.wait_complete({command.handoff_id})

    seen = engines.actions_of(command.handoff_id)
    tail = ["StartTransfer", "ActivateDestination", "ReleaseSource", "Complete"]
    assert kinds(seen) == [*expected, *tail]
    assert [a.action_id for a in seen] == list(range(6))
    assert engines.completions[command.handoff_id][0].completion is HandoffCompletion.SUCCESS
    # The log holds exactly what was published, and every input that led to it. (Stopped
    # first: the file may trail what was published, its log being the replicated one; a
    # drained stop commits it all.)
    assert worker.terminate() == 0
    assert logged_actions(worker.db, command.handoff_id) == seen
    assert isinstance(logged_inputs(worker.db, command.handoff_id)[0], StartHandoff)


async def test_frontend_cancel_cleans_up_both_sides(
    worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    command = start(EngineType.VLLM)

    def stall_transfer(action: Action) -> list[Input]:
        # The transfer never completes, so the frontend's cancel lands mid-handoff.
        if isinstance(action, StartTransfer):
            return []
        return success_script(action)

    engines.script = stall_transfer
    await engines.start_handoff(command)
    await engines.wait_for_action(command.handoff_id, StartTransfer)
    await engines.send(Canceled(command.handoff_id))
    await engines.wait_complete({command.handoff_id})

    seen = kinds(engines.actions_of(command.handoff_id))
    assert seen[-3:] == ["CancelSource", "CancelDestination", "Complete"]
    assert engines.completions[command.handoff_id][0].completion is HandoffCompletion.CANCELED


async def test_failed_outcome_cancels_the_source(
    worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    command = start(EngineType.SGLANG)

    def destination_fails(action: Action) -> list[Input]:
        if isinstance(action, ReserveDestination):
            return [ActionOutcome(action.handoff_id, action.action_id, ActionFailed("no room"))]
        return success_script(action)

    engines.script = destination_fails
    await engines.start_handoff(command)
    await engines.wait_complete({command.handoff_id})

    # The destination refused ownership and the source was never asked, so the coordinator
    # still cancels the destination it asked (ownership is ambiguous until acknowledged).
    assert kinds(engines.actions_of(command.handoff_id)) == [
        "ReserveDestination",
        "CancelDestination",
        "Complete",
    ]
    assert engines.completions[command.handoff_id][0].completion is HandoffCompletion.CANCELED


async def test_deadline_appends_timed_out_and_cleans_up(
    worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    command = start(EngineType.VLLM, deadline_ms=300)

    def prefill_never_held(action: Action) -> list[Input]:
        if isinstance(action, SubmitPrefill):
            return [ActionOutcome(action.handoff_id, action.action_id, SUBMITTED)]
        return success_script(action)

    engines.script = prefill_never_held
    await engines.start_handoff(command)
    await engines.wait_complete({command.handoff_id})

    assert kinds(engines.actions_of(command.handoff_id)) == [
        "SubmitPrefill",
        "CancelSource",
        "Complete",
    ]
    # The deadline is an input like any other, so replay sees it (once the file, which commits
    # behind the publishes, holds it).
    await until(
        lambda: any(isinstance(i, TimedOut) for i in logged_inputs(worker.db, command.handoff_id)),
        "the TimedOut reached the file",
    )


async def test_duplicates_are_logged_once(worker: WorkerProcess, engines: ScriptedEngines) -> None:
    command = start(EngineType.VLLM)

    def hold_back(action: Action) -> list[Input]:
        # Answer the prefill but hold the source fact back; the test sends it by hand.
        if isinstance(action, SubmitPrefill):
            return [ActionOutcome(action.handoff_id, action.action_id, SUBMITTED)]
        return success_script(action)

    engines.script = hold_back
    h = command.handoff_id
    await engines.start_handoff(command)
    await engines.start_handoff(command)  # a retried publish of the same command
    await engines.wait_for_action(h, SubmitPrefill)
    await engines.send(ActionOutcome(h, 0, SUBMITTED))  # an engine reporting twice
    await engines.send(SourceHeld(h, TIMING))
    await engines.send(SourceHeld(h, TIMING))
    await engines.wait_complete({h})

    inputs = await completed_inputs(worker.db, h)
    assert inputs.count(command) == 1
    assert inputs.count(ActionOutcome(h, 0, SUBMITTED)) == 1
    assert inputs.count(SourceHeld(h, TIMING)) == 1
    assert "kvhandoff_duplicate_inputs_total 3.0" in worker.metrics()
    assert engines.completions[h][0].completion is HandoffCompletion.SUCCESS


async def test_an_early_fact_is_deferred_until_its_precondition_holds(
    worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    command = start(EngineType.VLLM)
    h = command.handoff_id
    reserved = DestinationReserved(h, 64)

    def destination_only_accepts(action: Action) -> list[Input]:
        # The destination's fact overtakes its own outcome: the test sent it early.
        if isinstance(action, ReserveDestination):
            return [ActionOutcome(h, action.action_id, ACCEPTED)]
        return success_script(action)

    engines.script = destination_only_accepts
    await engines.start_handoff(command)
    await engines.wait_for_action(h, SubmitPrefill)
    await engines.send(reserved)  # before ReserveDestination was even issued
    await engines.wait_complete({h})

    inputs = await completed_inputs(worker.db, h)
    accepted = inputs.index(ActionOutcome(h, 1, ACCEPTED))
    assert inputs.index(reserved) > accepted  # applied once its precondition held
    transfer = next(a for a in engines.actions_of(h) if isinstance(a, StartTransfer))
    assert transfer.delay_ms == pytest.approx(128 * 1024 / 10e9 * 1000)
    assert not engines.rejections
    assert "kvhandoff_deferred_inputs_total" in worker.metrics()


@pytest.mark.slow
async def test_an_input_that_stays_premature_is_rejected_after_redeliveries(
    worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    command = start(EngineType.VLLM)
    h = command.handoff_id

    def transfer_never_scheduled(action: Action) -> list[Input]:
        return [] if isinstance(action, StartTransfer) else success_script(action)

    engines.script = transfer_never_scheduled
    await engines.start_handoff(command)
    await engines.wait_for_action(h, StartTransfer)
    ghost = uuid.uuid4()
    await engines.send(TransferCompleted(h))
    await engines.send(Canceled(ghost))  # a cancel for a handoff that never started

    early = await engines.wait_rejection(h)
    assert "transfer completed before it was scheduled" in early.reason
    assert "after redeliveries" in early.reason
    unknown = await engines.wait_rejection(ghost)
    assert "no such handoff" in unknown.reason
    assert TransferCompleted(h) not in logged_inputs(worker.db, h)


async def test_malformed_and_invalid_inputs_are_rejected_while_valid_handoffs_complete(
    worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    valid = [start(EngineType.VLLM), start(EngineType.SGLANG)]
    ghost = uuid.uuid4()  # what the bad payloads claim to be about
    victim = start(EngineType.TRTLLM)
    bad_payloads = [
        b"not json at all",
        b'{"type": "no_such_message", "handoff_id": "%s"}' % str(ghost).encode(),
        b'{"type": "destination_reserved", "handoff_id": "%s", '
        b'"transferable_prompt_tokens": -5}' % str(ghost).encode(),
        b'{"type": "canceled", "handoff_id": "not-a-uuid"}',
    ]
    for payload in bad_payloads:
        await engines.send_raw(engines.subjects.input(ghost), payload)
    for command in [*valid, victim]:
        await engines.start_handoff(command)
    await engines.wait_complete({c.handoff_id for c in [*valid, victim]})
    # Outcomes for a completed handoff are ignored, not rejected: the handoff is over.
    late = [
        ActionOutcome(victim.handoff_id, 0, ACCEPTED),
        ActionOutcome(victim.handoff_id, 99, APPLIED),
    ]
    for outcome in late:
        await engines.send(outcome)
    # A last bad input, rejected at once: once its rejection arrives, everything before it
    # was processed. (A second, different start for a handoff that exists.)
    sentinel = msgspec.structs.replace(valid[0], deadline_ms=1)
    await engines.send(sentinel)
    restart = await engines.wait_rejection(sentinel.handoff_id)
    assert "already started differently" in restart.reason

    rejections = engines.rejections
    assert len(rejections) == len(bad_payloads) + 1
    assert all(r.reason for r in rejections)
    assert sum("undecodable" in r.reason for r in rejections) == len(bad_payloads)
    assert not any(r.handoff_id == victim.handoff_id for r in rejections)
    for command in [*valid, victim]:
        assert engines.completions[command.handoff_id][0].completion is HandoffCompletion.SUCCESS
    assert worker.process is not None and worker.process.poll() is None
    assert 'kvhandoff_rejections_total{reason="undecodable"} 4.0' in worker.metrics()
    assert worker.terminate() == 0  # the file committed in full
    assert logged_inputs(worker.db, victim.handoff_id)[-2:] == late
    with sqlite3.connect(worker.db) as db:
        (count,) = db.execute("SELECT count(*) FROM rejections WHERE reason != ''").fetchone()
    assert count == len(rejections)


async def test_invalid_outcome_for_open_handoff_is_rejected_and_changes_nothing(
    worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    command = start(EngineType.VLLM)

    def quiet(action: Action) -> list[Input]:
        return []  # the test answers by hand

    engines.script = quiet
    h = command.handoff_id
    await engines.start_handoff(command)
    await engines.wait_for_action(h, SubmitPrefill)
    await engines.send(ActionOutcome(h, 0, APPLIED))  # SubmitPrefill expects Submitted
    rejection = await engines.wait_rejection(h)
    assert "invalid handoff action outcome" in rejection.reason
    assert "awaiting submit_prefill#0" in rejection.reason  # names the state it was in
    await engines.send(ActionOutcome(h, 0, SUBMITTED))
    await engines.send(SourceHeld(h, TIMING))
    await engines.wait_for_action(h, ReserveDestination)
    assert worker.terminate() == 0  # the file committed in full
    assert logged_inputs(worker.db, h) == [
        command,
        ActionOutcome(h, 0, SUBMITTED),
        SourceHeld(h, TIMING),
    ]


async def test_reopened_cleanup_after_success(
    worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    command = start(EngineType.VLLM)
    h = command.handoff_id
    await engines.start_handoff(command)
    await engines.wait_complete({h})
    # The frontend gives up after all: the destination must release the request again.
    await engines.send(Canceled(h))
    await engines.wait_completions(h, 2)
    assert [c.completion for c in engines.completions[h]] == [
        HandoffCompletion.SUCCESS,
        HandoffCompletion.CANCELED,
    ]
    seen = engines.actions_of(h)
    assert isinstance(seen[-2], CancelDestination) and isinstance(seen[-1], Complete)
    assert not any(isinstance(a, CancelSource) for a in seen)
    assert isinstance(seen[-4], ReleaseSource) and isinstance(seen[-5], ActivateDestination)


async def test_sigterm_drains_and_exits_zero(
    worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    commands = [start(EngineType.VLLM) for _ in range(50)]
    for command in commands:
        await engines.start_handoff(command)
    await engines.wait_complete({c.handoff_id for c in commands})
    assert worker.terminate() == 0
    with open_log(worker.db) as log:
        states = [row.state for row in log.handoffs()]
    assert states == [HandoffState.SUCCEEDED] * len(commands)


def test_rejection_message_is_part_of_the_wire_vocabulary() -> None:
    rejection = Rejection(uuid.uuid4(), "why", "payload")
    assert codec.decode_rejection(codec.encode(rejection)) == rejection
    with pytest.raises(msgspec.ValidationError):
        codec.decode_rejection(b'{"type": "rejection", "handoff_id": null}')
