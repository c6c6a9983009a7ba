"""The engine client on a real nats-server, with the worker's input stream (the real worker
creates it): each action id runs once, a repeat gets the stored outcome, memory is bounded,
missing handlers answer safely, a raising handler answers nothing, facts follow outcomes."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvhandoff.client import Engine, Handlers, OutcomeLogFailed
from kvhandoff.events.codec import decode_input, encode
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import (
    NOOP,
    SUBMITTED,
    Action,
    ActionFailed,
    ActionOutcome,
    CancelSource,
    Input,
    Outcome,
    SourceHeld,
    SubmitPrefill,
)
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus, Message
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.engines.healthy import TIMING
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.client.conftest import Connect
from tests.eventually import until
from tests.worker.conftest import WorkerProcess

ENGINE = "test-prefill-0"
WAIT_S = 60.0  # generous: the machine is shared


class WorkerSide:
    """Sends actions to the engine and queues, per handoff, every input it publishes."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.subjects = Subjects()
        self._inputs: defaultdict[HandoffId, asyncio.Queue[Input]] = defaultdict(asyncio.Queue)

    async def _on_input(self, msg: Message) -> None:
        message = decode_input(msg.data)
        self._inputs[message.handoff_id].put_nowait(message)

    async def send(self, action: Action) -> None:
        await self.bus.publish(self.subjects.engine(ENGINE), encode(action))

    async def next(self, handoff_id: HandoffId) -> Input:
        return await asyncio.wait_for(self._inputs[handoff_id].get(), 30.0)


@pytest.fixture
async def side(worker: WorkerProcess, nats_server: EmbeddedNats) -> AsyncIterator[WorkerSide]:
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "worker-side")
    side = WorkerSide(bus)
    await bus.subscribe(side.subjects.inputs, side._on_input)
    await bus.flush()
    yield side
    await bus.close()


async def test_a_repeated_action_id_gets_the_stored_outcome_and_runs_once(
    side: WorkerSide, connect: Connect
) -> None:
    runs: list[SubmitPrefill] = []

    async def submit(action: SubmitPrefill) -> Outcome:
        runs.append(action)
        return SUBMITTED

    engine = Engine(await connect(), ENGINE, Handlers(submit_prefill=submit))
    await engine.start()
    action = SubmitPrefill(uuid.uuid4(), 0)
    for _ in range(3):
        await side.send(action)
    for _ in range(3):
        assert await side.next(action.handoff_id) == ActionOutcome(action.handoff_id, 0, SUBMITTED)
    assert runs == [action]
    assert (engine.stats.executed, engine.stats.repeated) == (1, 2)
    await engine.stop()


@pytest.mark.parametrize(("remember", "runs_of_the_first"), [(1, 2), (2, 1)])
async def test_outcomes_are_remembered_for_the_handoffs_used_last(
    side: WorkerSide, connect: Connect, remember: int, runs_of_the_first: int
) -> None:
    runs: list[HandoffId] = []

    async def submit(action: SubmitPrefill) -> Outcome:
        runs.append(action.handoff_id)
        return SUBMITTED

    engine = Engine(await connect(), ENGINE, Handlers(submit_prefill=submit), remember=remember)
    await engine.start()
    first, second = SubmitPrefill(uuid.uuid4(), 0), SubmitPrefill(uuid.uuid4(), 0)
    for action in (first, second):
        await side.send(action)
        await side.next(action.handoff_id)
    # An outcome arrives before its receipt let go of the handoff's lock, and a handoff whose
    # lock is held is not forgotten yet: the memory is trimmed once the receipts are done.
    await until(
        lambda: engine.remembered <= remember, "the memory trimmed", within=WAIT_S, every=0.01
    )
    await side.send(first)
    await side.next(first.handoff_id)
    assert runs.count(first.handoff_id) == runs_of_the_first
    await engine.stop()


async def test_an_action_without_a_handler_fails_forward_and_is_a_noop_as_cleanup(
    side: WorkerSide, connect: Connect
) -> None:
    engine = Engine(await connect(), ENGINE, Handlers())
    await engine.start()
    handoff_id = uuid.uuid4()
    await side.send(SubmitPrefill(handoff_id, 0))
    await side.send(CancelSource(handoff_id, 1))
    assert await side.next(handoff_id) == ActionOutcome(
        handoff_id, 0, ActionFailed(f"{ENGINE} does not execute submit_prefill")
    )
    assert await side.next(handoff_id) == ActionOutcome(handoff_id, 1, NOOP)
    await engine.stop()


async def test_a_handler_that_raises_answers_nothing_and_the_retry_runs_it_again(
    side: WorkerSide, connect: Connect
) -> None:
    calls = 0

    async def submit(action: SubmitPrefill) -> Outcome:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("the engine was not ready")
        return SUBMITTED

    engine = Engine(await connect(), ENGINE, Handlers(submit_prefill=submit))
    await engine.start()
    action = SubmitPrefill(uuid.uuid4(), 0)
    await side.send(action)  # answered with nothing
    await side.send(action)  # the worker's retry
    assert await side.next(action.handoff_id) == ActionOutcome(action.handoff_id, 0, SUBMITTED)
    assert calls == 2
    assert engine.stats.executed == 1
    await engine.stop()


async def test_a_fact_started_by_a_handler_is_stored_after_the_outcome(
    side: WorkerSide, connect: Connect
) -> None:
    engine: Engine

    async def submit(action: SubmitPrefill) -> Outcome:
        engine.spawn(engine.source_held(action.handoff_id, TIMING))
        for _ in range(10):  # give the fact every chance to overtake, were it not held back
            await asyncio.sleep(0)
        return SUBMITTED

    engine = Engine(await connect(), ENGINE, Handlers(submit_prefill=submit))
    await engine.start()
    handoff_id = uuid.uuid4()
    await side.send(SubmitPrefill(handoff_id, 0))
    assert await side.next(handoff_id) == ActionOutcome(handoff_id, 0, SUBMITTED)
    assert await side.next(handoff_id) == SourceHeld(handoff_id, TIMING)
    await engine.stop()


async def test_malformed_actions_are_counted_and_the_engine_carries_on(
    side: WorkerSide, connect: Connect
) -> None:
    async def submit(action: SubmitPrefill) -> Outcome:
        return SUBMITTED

    engine = Engine(await connect(), ENGINE, Handlers(submit_prefill=submit))
    await engine.start()
    await side.bus.publish(side.subjects.engine(ENGINE), b"{not json")
    action = SubmitPrefill(uuid.uuid4(), 0)
    await side.send(action)
    assert await side.next(action.handoff_id) == ActionOutcome(action.handoff_id, 0, SUBMITTED)
    assert engine.stats.malformed == 1
    await engine.stop()


async def test_a_presence_probe_tells_whether_an_engine_listens(
    side: WorkerSide, connect: Connect
) -> None:
    connection = await connect()
    engine = Engine(connection, ENGINE, Handlers())
    assert not await connection.engine_listening(ENGINE)
    await engine.start()
    assert await connection.engine_listening(ENGINE, wait_s=30.0)
    assert engine.stats.malformed == 0  # a probe is not an action
    await engine.stop()
    assert not await connection.engine_listening(ENGINE)


async def test_with_an_outcome_log_a_restarted_engine_answers_a_repeat_without_running_it(
    side: WorkerSide, connect: Connect, tmp_path: Path
) -> None:
    runs: list[SubmitPrefill] = []

    async def submit(action: SubmitPrefill) -> Outcome:
        runs.append(action)
        return SUBMITTED

    log = tmp_path / "outcomes.sqlite3"
    first, second = SubmitPrefill(uuid.uuid4(), 0), SubmitPrefill(uuid.uuid4(), 0)
    handlers = Handlers(submit_prefill=submit)
    before = Engine(await connect(), ENGINE, handlers, remember=1, outcomes_path=log)
    await before.start()
    for action in (first, second):  # remember=1: the first is forgotten, in the file too
        await side.send(action)
        await side.next(action.handoff_id)
    await before.stop()

    after = Engine(await connect(), ENGINE, handlers, remember=1, outcomes_path=log)
    await after.start()
    await side.send(second)
    assert await side.next(second.handoff_id) == ActionOutcome(second.handoff_id, 0, SUBMITTED)
    assert runs == [first, second]  # the repeat of the second did not run again
    await side.send(first)
    await side.next(first.handoff_id)
    assert runs == [first, second, first]  # forgotten, so it ran again
    await after.stop()

    with pytest.raises(OutcomeLogFailed, match="not other-engine"):
        await Engine(await connect(), "other-engine", handlers, outcomes_path=log).start()
