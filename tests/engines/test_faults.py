"""Fault injection with a fixed seed does what it says, and only that.

Every fault decision is a pure function of the seed, so each test first asks `Faults` what it
will decide for the handoffs it is about to send, then checks that the engine did exactly that.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import replace
from uuid import UUID

import pytest

from kvhandoff.events.messages import (
    APPLIED,
    NOOP,
    SUBMITTED,
    ActionFailed,
    ActionOutcome,
    ActivateDestination,
    CancelDestination,
    CancelSource,
    Failed,
    ReleaseSource,
    SourceHeld,
    SubmitPrefill,
)
from kvhandoff.worker.engines import FailureForm, Faults
from kvhandoff.worker.errors import ConfigError
from tests.engines.conftest import StartEngines
from tests.engines.harness import (
    BLOCKS,
    DESTINATION,
    FAST,
    ONE_PAIR,
    SOURCE,
    WorkerSide,
    held,
)


def handoff_where(condition: Callable[[UUID], bool]) -> UUID:
    """A handoff id for which the seeded decisions come out as the test needs."""
    for _ in range(10_000):
        h = uuid.uuid4()
        if condition(h):
            return h
    raise AssertionError("no handoff id satisfies the condition")


def activation_failing_as(faults: Faults, form: FailureForm) -> UUID:
    """A handoff whose reservation (action 0) succeeds and whose activation (action 1) fails
    in `form`."""
    return handoff_where(
        lambda h: (
            faults.failure(DESTINATION, h, 0) is None and faults.failure(DESTINATION, h, 1) is form
        )
    )


def test_decisions_are_a_function_of_the_seed_and_honour_the_rates() -> None:
    faults = Faults(seed=3, fail_rate=0.2, drop_rate=0.3, duplicate_rate=0.4, delay_ms=100.0)
    ids = [uuid.UUID(int=i) for i in range(4000)]
    drops = [faults.drops(SOURCE, h, 0, 0) for h in ids]
    assert drops == [faults.drops(SOURCE, h, 0, 0) for h in ids]
    assert drops != [replace(faults, seed=4).drops(SOURCE, h, 0, 0) for h in ids]
    assert sum(drops) / len(ids) == pytest.approx(0.3, abs=0.03)
    failures = [faults.failure(SOURCE, h, 0) for h in ids]
    assert failures.count(None) / len(ids) == pytest.approx(0.8, abs=0.03)
    assert failures.count(FailureForm.FACT) == pytest.approx(
        failures.count(FailureForm.OUTCOME), rel=0.2
    )
    duplicates = [faults.duplicates(SOURCE, h.bytes) for h in ids]
    assert sum(duplicates) / len(ids) == pytest.approx(0.4, abs=0.03)
    delays = [faults.delay_s(SOURCE, h, 0, 0) for h in ids]
    assert min(delays) >= 0.0 and max(delays) < 0.1
    # A retry is a new receipt and gets a fresh draw.
    assert [faults.drops(SOURCE, h, 0, 1) for h in ids] != drops


def test_faults_refuse_settings_that_could_never_finish() -> None:
    with pytest.raises(ConfigError, match="drop_rate 1"):
        Faults(drop_rate=1.0)
    with pytest.raises(ConfigError, match="fail_rate"):
        Faults(fail_rate=1.5)


async def test_failures_are_an_outcome_or_a_lost_request_and_free_everything(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    faults = Faults(seed=11, fail_rate=1.0)
    engines = await start_engines(faults=faults)
    source = engines.engines[SOURCE]
    refused = handoff_where(lambda h: faults.failure(SOURCE, h, 0) is FailureForm.OUTCOME)
    lost = handoff_where(lambda h: faults.failure(SOURCE, h, 0) is FailureForm.FACT)

    await worker_side.send(SOURCE, SubmitPrefill(refused, 0))
    await worker_side.expect(
        refused, ActionOutcome(refused, 0, ActionFailed(f"{SOURCE}: injected failure"))
    )
    # The engine prefills, then drops the request: Failed instead of SourceHeld.
    await worker_side.send(SOURCE, SubmitPrefill(lost, 0))
    await worker_side.expect(lost, ActionOutcome(lost, 0, SUBMITTED), Failed(lost))
    assert held(source) == 0

    # Neither holds anything, so the cleanup finds nothing; cleanups never fail.
    for h in (refused, lost):
        await worker_side.send(SOURCE, CancelSource(h, 1))
        await worker_side.expect(h, ActionOutcome(h, 1, NOOP))
    assert source.counters.injected_failures == 2


async def test_a_failed_activation_keeps_the_reservation_for_the_cleanup(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    faults = Faults(seed=5, fail_rate=0.5)
    engines = await start_engines(faults=faults)
    h = activation_failing_as(faults, FailureForm.OUTCOME)
    await worker_side.hold_destination(h)
    await worker_side.send(DESTINATION, ActivateDestination(h, 1))
    await worker_side.expect(
        h, ActionOutcome(h, 1, ActionFailed(f"{DESTINATION}: injected failure"))
    )
    assert held(engines.engines[DESTINATION]) == BLOCKS
    await worker_side.send(DESTINATION, CancelDestination(h, 2))
    await worker_side.expect(h, ActionOutcome(h, 2, APPLIED))
    assert held(engines.engines[DESTINATION]) == 0


async def test_a_dropped_action_is_executed_when_the_worker_sends_it_again(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    faults = Faults(seed=7, drop_rate=0.5)
    engines = await start_engines(faults=faults)
    h = handoff_where(
        lambda h: (
            faults.drops(SOURCE, h, 0, 0)
            and not faults.drops(SOURCE, h, 0, 1)
            and not faults.drops(SOURCE, h, 1, 0)
        )
    )
    await worker_side.send(SOURCE, SubmitPrefill(h, 0))
    await worker_side.send(SOURCE, SubmitPrefill(h, 0))  # the worker's retry
    # Had the first copy been executed, its answer would come first and the retry's
    # repeated answer would stand between these and the release's outcome.
    await worker_side.expect(h, ActionOutcome(h, 0, SUBMITTED), SourceHeld(h, FAST.timing(100)))
    await worker_side.send(SOURCE, ReleaseSource(h, 1))
    await worker_side.expect(h, ActionOutcome(h, 1, APPLIED))
    counters = engines.engines[SOURCE].counters
    assert (counters.dropped, counters.executed, counters.repeated) == (1, 2, 0)


async def test_duplicated_outcomes_and_facts_arrive_twice(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    engines = await start_engines(faults=Faults(seed=1, duplicate_rate=1.0))
    h = uuid.uuid4()
    await worker_side.send(SOURCE, SubmitPrefill(h, 0))
    submitted, held_fact = ActionOutcome(h, 0, SUBMITTED), SourceHeld(h, FAST.timing(100))
    await worker_side.expect(h, submitted, submitted, held_fact, held_fact)
    assert engines.engines[SOURCE].counters.duplicated == 2
    assert held(engines.engines[SOURCE]) == BLOCKS  # duplicated messages, one effect


async def test_a_delayed_answer_waits_at_least_its_drawn_delay(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    faults = Faults(seed=2, delay_ms=400.0)
    engines = await start_engines(faults=faults)
    h = handoff_where(lambda h: faults.delay_s(SOURCE, h, 0, 0) > 0.2)
    loop = asyncio.get_running_loop()
    sent_at = loop.time()
    await worker_side.send(SOURCE, SubmitPrefill(h, 0))
    await worker_side.expect(h, ActionOutcome(h, 0, SUBMITTED))
    assert loop.time() - sent_at >= faults.delay_s(SOURCE, h, 0, 0)
    assert engines.engines[SOURCE].counters.delayed == 1


async def test_a_silent_engine_ignores_actions_for_a_while_then_answers_retries(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    roster = replace(ONE_PAIR, sources=2)
    engines = await start_engines(
        faults=Faults(silent=1, silent_ms=300.0), roster=roster, model=FAST
    )
    silent, healthy = engines.engines["vllm-prefill-0"], engines.engines["vllm-prefill-1"]
    assert silent.silent and not healthy.silent
    loop = asyncio.get_running_loop()

    answered = uuid.uuid4()
    await worker_side.send(healthy.engine_id, SubmitPrefill(answered, 0))
    await worker_side.expect(answered, ActionOutcome(answered, 0, SUBMITTED))

    h = uuid.uuid4()
    first_sent_at = loop.time()
    while True:  # play the worker: republish until answered
        await worker_side.send(silent.engine_id, SubmitPrefill(h, 0))
        try:
            outcome = await worker_side.next(h, wait_s=0.05)
            break
        except TimeoutError:
            continue
    assert outcome == ActionOutcome(h, 0, SUBMITTED)
    assert loop.time() - first_sent_at >= 0.3
    await worker_side.expect(h, SourceHeld(h, FAST.timing(100)))
    assert silent.counters.ignored >= 1
    assert (silent.counters.executed, held(silent)) == (1, BLOCKS)


async def test_a_decode_can_fail_after_activation_and_frees_its_blocks(
    worker_side: WorkerSide, start_engines: StartEngines
) -> None:
    """The Failed fact that, after a success, reopens the worker's cleanup."""
    faults = Faults(seed=9, fail_rate=0.5)
    engines = await start_engines(faults=faults)
    h = activation_failing_as(faults, FailureForm.FACT)
    await worker_side.hold_destination(h)
    await worker_side.send(DESTINATION, ActivateDestination(h, 1))
    await worker_side.expect(h, ActionOutcome(h, 1, APPLIED), Failed(h))
    assert held(engines.engines[DESTINATION]) == 0
    await worker_side.send(DESTINATION, CancelDestination(h, 2))
    await worker_side.expect(h, ActionOutcome(h, 2, NOOP))
