"""Capacity: requests wait for KV blocks and slots, and proceed when they are released."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SUBMITTED,
    ActionFailed,
    ActionOutcome,
    ActivateDestination,
    CancelDestination,
    CancelSource,
    DestinationReserved,
    ReleaseSource,
    ReserveDestination,
    SourceHeld,
    SubmitPrefill,
)
from kvhandoff.worker.engines import KvCapacity
from tests.engines.conftest import StartEngines
from tests.engines.harness import BLOCKS, DESTINATION, FAST, SOURCE, WorkerSide, held


async def test_a_reservation_waits_for_blocks_and_proceeds_when_they_are_released(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines(model=replace(FAST, kv_blocks=BLOCKS))
    destination = engines.engines[DESTINATION]
    first, second = uuid.uuid4(), uuid.uuid4()
    await worker_side.hold_destination(first)

    await worker_side.send(DESTINATION, ReserveDestination(second, 0))
    await worker_side.expect(second, ActionOutcome(second, 0, ACCEPTED))
    # Accepted, but every block is taken: the request waits.
    assert (destination.capacity.waiting, held(destination)) == (1, BLOCKS)

    await worker_side.send(DESTINATION, CancelDestination(first, 1))
    await worker_side.expect(first, ActionOutcome(first, 1, APPLIED))
    await worker_side.expect(second, DestinationReserved(second, 96))
    assert (destination.capacity.waiting, held(destination)) == (0, BLOCKS)


async def test_a_prefill_waits_for_a_slot_and_runs_when_one_is_released(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines(model=replace(FAST, max_slots=1))
    source = engines.engines[SOURCE]
    first, second = uuid.uuid4(), uuid.uuid4()
    await worker_side.hold_source(first)

    await worker_side.send(SOURCE, SubmitPrefill(second, 0))
    await worker_side.expect(second, ActionOutcome(second, 0, SUBMITTED))
    assert (source.capacity.waiting, source.capacity.used_slots) == (1, 1)

    await worker_side.send(SOURCE, ReleaseSource(first, 1))
    await worker_side.expect(first, ActionOutcome(first, 1, APPLIED))
    await worker_side.expect(second, SourceHeld(second, FAST.timing(100)))


async def test_the_end_of_a_decode_frees_its_blocks_for_the_next_reservation(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    # Long enough for the second reservation to be seen waiting, short enough for a test.
    model = replace(FAST, kv_blocks=BLOCKS, decode_ms=500.0, speedup=1.0)
    engines = await start_engines(model=model)
    destination = engines.engines[DESTINATION]
    first, second = uuid.uuid4(), uuid.uuid4()
    await worker_side.hold_destination(first)
    await worker_side.send(DESTINATION, ActivateDestination(first, 1))
    await worker_side.expect(first, ActionOutcome(first, 1, APPLIED))

    await worker_side.send(DESTINATION, ReserveDestination(second, 0))
    await worker_side.expect(second, ActionOutcome(second, 0, ACCEPTED))
    assert destination.capacity.waiting == 1
    await worker_side.expect(second, DestinationReserved(second, 96))
    # The decode ended on its own; a cancel now has nothing to free.
    await worker_side.send(DESTINATION, CancelDestination(first, 2))
    await worker_side.expect(first, ActionOutcome(first, 2, NOOP))


async def test_cancelling_a_waiting_prefill_withdraws_it(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines(model=replace(FAST, max_slots=1))
    source = engines.engines[SOURCE]
    first, second = uuid.uuid4(), uuid.uuid4()
    await worker_side.send(SOURCE, SubmitPrefill(first, 0))
    await worker_side.expect(first, ActionOutcome(first, 0, SUBMITTED))
    await worker_side.send(SOURCE, SubmitPrefill(second, 0))
    await worker_side.expect(second, ActionOutcome(second, 0, SUBMITTED))

    await worker_side.send(SOURCE, CancelSource(second, 1))
    await worker_side.expect(second, ActionOutcome(second, 1, APPLIED))
    assert source.capacity.waiting == 0
    await worker_side.send(SOURCE, ReleaseSource(first, 2))
    # The first handoff's messages arrive in order: held, then the release.
    await worker_side.expect(first, SourceHeld(first, FAST.timing(100)))
    await worker_side.expect(first, ActionOutcome(first, 2, APPLIED))
    assert worker_side.queued(second) == []
    assert held(source) == 0


async def test_a_prompt_larger_than_the_engine_fails_at_once(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines(model=replace(FAST, kv_blocks=BLOCKS - 1))
    h = uuid.uuid4()
    await worker_side.send(SOURCE, SubmitPrefill(h, 0))
    refused = await worker_side.next(h)
    assert refused == ActionOutcome(
        h, 0, ActionFailed(f"{SOURCE}: 100 tokens need 7 KV blocks, the engine has 6")
    )
    await worker_side.send(SOURCE, CancelSource(h, 1))
    await worker_side.expect(h, ActionOutcome(h, 1, NOOP))
    assert engines.engines[SOURCE].capacity.waiting == 0


async def test_grants_are_first_come_first_served() -> None:
    capacity = KvCapacity(blocks=10, slots=5)
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    first = capacity.request(a, 6)
    second = capacity.request(b, 6)  # does not fit beside the first
    third = capacity.request(c, 1)  # would fit, but must not overtake the second
    assert first.done() and not second.done() and not third.done()

    assert capacity.release(a)
    assert second.done() and third.done()
    assert (capacity.used_blocks, capacity.used_slots) == (7, 2)
    assert not capacity.release(a)  # nothing left to release
    await asyncio.gather(first, second, third)
