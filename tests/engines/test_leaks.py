"""Leak accounting: what an engine still holds for handoffs the worker completed."""

from __future__ import annotations

import uuid
from dataclasses import replace
from uuid import UUID

from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    ActionOutcome,
    ActivateDestination,
    EngineType,
    HandoffCompletion,
    ReleaseSource,
    ReserveDestination,
    Role,
)
from kvhandoff.worker.engines import EngineCounters, EnginesReport, EngineStatus, Leak, settled
from tests.engines.conftest import StartEngines
from tests.engines.harness import BLOCKS, DESTINATION, FAST, SOURCE, WorkerSide


def leaked(report: EnginesReport) -> set[UUID]:
    return {leak.handoff_id for leak in report.leaks}


async def test_blocks_held_for_a_completed_handoff_are_a_leak_and_released_ones_are_not(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines()
    released, forgotten = uuid.uuid4(), uuid.uuid4()
    await worker_side.hold_source(released)
    await worker_side.send(SOURCE, ReleaseSource(released, 1))
    await worker_side.expect(released, ActionOutcome(released, 1, APPLIED))
    await worker_side.hold_source(forgotten)

    await worker_side.complete(released)
    await worker_side.complete(forgotten, HandoffCompletion.CANCELED)
    # Completes arrive in order, so once the second shows, the first was seen too.
    report = await worker_side.report_until(lambda r: bool(r.leaks))
    assert report.leaks == [
        Leak(engine_id=SOURCE, handoff_id=forgotten, state="held", blocks=BLOCKS, waiting=False)
    ]
    assert not settled([report])

    # The engine keeps reporting it, including in its final report.
    final = await engines.stop()
    assert leaked(final) == {forgotten}


async def test_a_running_decode_is_not_a_leak(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    await start_engines(model=replace(FAST, decode_ms=600_000.0))
    decoding, forgotten = uuid.uuid4(), uuid.uuid4()
    await worker_side.hold_destination(decoding)
    await worker_side.send(DESTINATION, ActivateDestination(decoding, 1))
    await worker_side.expect(decoding, ActionOutcome(decoding, 1, APPLIED))
    await worker_side.hold_source(forgotten)

    await worker_side.complete(decoding)
    await worker_side.complete(forgotten)
    report = await worker_side.report_until(lambda r: bool(r.leaks))
    assert leaked(report) == {forgotten}
    destination = next(s for s in report.engines if s.engine_id == DESTINATION)
    assert (destination.blocks_held, destination.blocks_decoding) == (BLOCKS, BLOCKS)


async def test_a_reservation_still_waiting_for_a_completed_handoff_is_a_leak(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    await start_engines(model=replace(FAST, kv_blocks=BLOCKS))
    holding, waiting = uuid.uuid4(), uuid.uuid4()
    for h in (holding, waiting):
        await worker_side.send(DESTINATION, ReserveDestination(h, 0))
        await worker_side.expect(h, ActionOutcome(h, 0, ACCEPTED))

    await worker_side.complete(waiting)
    report = await worker_side.report_until(lambda r: bool(r.leaks))
    assert report.leaks == [
        Leak(engine_id=DESTINATION, handoff_id=waiting, state="queued", blocks=0, waiting=True)
    ]


def engine_status(held: int, decoding: int, waiting: int) -> EngineStatus:
    return EngineStatus(
        engine_id=DESTINATION,
        engine_type=EngineType.VLLM,
        role=Role.DESTINATION,
        silent=False,
        blocks_total=64,
        blocks_held=held,
        blocks_decoding=decoding,
        slots_total=8,
        slots_held=1 if held else 0,
        waiting=waiting,
        open_handoffs=0,
        counters=EngineCounters(),
    )


def test_engines_are_settled_when_only_running_decodes_hold_blocks() -> None:
    def report(*statuses: EngineStatus) -> EnginesReport:
        return EnginesReport(process="p", engines=list(statuses), leaks=[])

    assert settled([])
    assert settled([report(engine_status(7, 7, 0)), report(engine_status(0, 0, 0))])
    assert not settled([report(engine_status(7, 7, 0)), report(engine_status(7, 0, 0))])
    assert not settled([report(engine_status(0, 0, 1))])
