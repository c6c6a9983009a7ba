"""The frontend client against a real worker and engines written with the engine client: a
handoff starts, completes and its state is read; a cancel ends in the canceled completion; a
`Complete` that went by before the wait, or while the frontend was reconnecting, is not
missed."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable

import pytest

from kvhandoff.client import CompletionStatus, CompletionTimeout, Frontend
from kvhandoff.events.messages import Complete, EngineType, HandoffCompletion, StartHandoff
from tests.client.conftest import Connect
from tests.client.pair import DESTINATION, SOURCE, Pair
from tests.client.proxy import CuttableProxy
from tests.eventually import until
from tests.worker.conftest import WorkerProcess

WAIT_S = 60.0  # generous: the machine is shared


def start_message() -> StartHandoff:
    return StartHandoff(
        handoff_id=uuid.uuid4(),
        engine_type=EngineType.VLLM,
        source=SOURCE,
        destination=DESTINATION,
        deadline_ms=120_000,
    )


async def test_a_handoff_between_client_engines_succeeds_each_action_running_once(
    worker: WorkerProcess, connect: Connect
) -> None:
    connection = await connect()
    pair = Pair(connection)
    await pair.start()
    frontend = await Frontend.open(connection)
    start = start_message()
    assert await frontend.state(start.handoff_id) is CompletionStatus.OPEN

    handoff_id = await frontend.start(start)
    complete = await frontend.wait(handoff_id, timeout_s=WAIT_S)

    assert complete.completion is HandoffCompletion.SUCCESS
    assert await frontend.state(handoff_id) is CompletionStatus.SUCCEEDED
    assert pair.calls == {
        "submit_prefill": 1,
        "reserve_destination": 1,
        "start_transfer": 1,
        "activate_destination": 1,
        "release_source": 1,
    }
    await pair.stop()


async def test_a_canceled_handoff_waits_for_its_canceled_completion(
    worker: WorkerProcess, connect: Connect
) -> None:
    connection = await connect()
    pair = Pair(connection, hold_source_held=True)  # the prefill never ends on its own
    await pair.start()
    frontend = await Frontend.open(connection)
    handoff_id = await frontend.start(start_message())
    await until(
        lambda: pair.calls["submit_prefill"] == 1, "the prefill was submitted", within=WAIT_S
    )
    assert await frontend.state(handoff_id) is CompletionStatus.OPEN

    await frontend.cancel(handoff_id)
    complete = await frontend.wait(handoff_id, timeout_s=WAIT_S)

    assert complete.completion is HandoffCompletion.CANCELED
    assert await frontend.state(handoff_id) is CompletionStatus.CANCELED
    assert pair.calls["cancel_source"] == 1
    await pair.stop()


async def test_a_wait_that_begins_after_the_completion_reads_it_from_the_stream(
    worker: WorkerProcess, connect: Connect
) -> None:
    connection = await connect()
    pair = Pair(connection)
    await pair.start()
    first = await Frontend.open(connection)
    handoff_id = await first.start(start_message())
    seen = await first.wait(handoff_id, timeout_s=WAIT_S)

    # A frontend that did not exist when the Complete went by.
    later = await Frontend.open(await connect())
    assert await later.wait(handoff_id, timeout_s=WAIT_S) == seen
    await pair.stop()


async def test_a_complete_that_went_by_during_a_reconnect_is_not_missed(
    proxy: CuttableProxy, worker: WorkerProcess, connect: Connect
) -> None:
    engines = await connect()
    pair = Pair(engines)
    pair.activations.clear()  # the handoff cannot complete until the test says so
    await pair.start()
    observer = await Frontend.open(engines)
    frontend = await Frontend.open(await connect(proxy.url))
    handoff_id = await frontend.start(start_message())
    waiting = asyncio.create_task(frontend.wait(handoff_id, timeout_s=WAIT_S))
    await until(
        lambda: pair.calls["activate_destination"] == 1, "the activation began", within=WAIT_S
    )

    await proxy.cut()  # the frontend is away while the handoff completes
    pair.activations.set()
    await until(
        lambda: _equals(observer.state(handoff_id), CompletionStatus.SUCCEEDED),
        "the handoff completed",
        within=WAIT_S,
    )
    assert not waiting.done()
    await proxy.open()

    complete = await waiting
    assert isinstance(complete, Complete)
    assert complete.completion is HandoffCompletion.SUCCESS
    await pair.stop()


async def test_a_wait_with_no_completion_times_out_and_the_handoff_stays_open(
    worker: WorkerProcess, connect: Connect
) -> None:
    connection = await connect()
    pair = Pair(connection, hold_source_held=True)
    await pair.start()
    frontend = await Frontend.open(connection)
    handoff_id = await frontend.start(start_message())
    with pytest.raises(CompletionTimeout, match=str(handoff_id)):
        await frontend.wait(handoff_id, timeout_s=0.5)
    assert await frontend.state(handoff_id) is CompletionStatus.OPEN
    await frontend.cancel(handoff_id)  # leaves nothing open behind the test
    await frontend.wait(handoff_id, timeout_s=WAIT_S)
    await pair.stop()


async def _equals(state: Awaitable[CompletionStatus], expected: CompletionStatus) -> bool:
    return await state is expected
