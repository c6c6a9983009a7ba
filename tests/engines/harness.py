"""The engine tests' view of the bus: `WorkerSide` plays the worker's half, so the engines can
be driven without a worker. It sends actions to an engine's subject, publishes `Complete`s, and
queues every input the engines publish, per handoff, so tests wait for specific messages instead
of sleeping."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from uuid import UUID

from kvhandoff.client import Connection
from kvhandoff.events.codec import decode_input, encode
from kvhandoff.events.messages import (
    ACCEPTED,
    SUBMITTED,
    Action,
    ActionOutcome,
    Complete,
    DestinationReserved,
    EngineType,
    HandoffCompletion,
    Input,
    ReserveDestination,
    SourceHeld,
    SubmitPrefill,
)
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus, Message
from kvhandoff.worker.engines import EngineModel, EnginesReport, MockEngine, Roster, request_reports

SOURCE = "vllm-prefill-0"
DESTINATION = "vllm-decode-0"
ONE_PAIR = Roster(engine_types=(EngineType.VLLM,), sources=1, destinations=1)

# Every prompt is 100 tokens: 7 blocks of 16, of which 96 tokens fill whole blocks.
PROMPT = 100
BLOCKS = 7
RESERVED_TOKENS = 96
FAST = EngineModel(shortest_prompt=PROMPT, longest_prompt=PROMPT, speedup=1000.0)


class WorkerSide:
    """The worker's half of the bus, scripted by a test."""

    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus = bus
        self.subjects = subjects
        self._inputs: defaultdict[UUID, asyncio.Queue[Input]] = defaultdict(asyncio.Queue)

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.inputs, self._on_input)
        await self.bus.flush()

    async def _on_input(self, msg: Message) -> None:
        message = decode_input(msg.data)
        self._inputs[message.handoff_id].put_nowait(message)

    async def send(self, engine_id: str, action: Action) -> None:
        await self.bus.publish(self.subjects.engine(engine_id), encode(action))

    async def complete(
        self, handoff_id: UUID, completion: HandoffCompletion = HandoffCompletion.SUCCESS
    ) -> None:
        action = Complete(handoff_id, 99, completion)
        await self.bus.publish(self.subjects.done(handoff_id), encode(action))

    async def next(self, handoff_id: UUID, wait_s: float = 5.0) -> Input:
        """The next input an engine published for the handoff."""
        return await asyncio.wait_for(self._inputs[handoff_id].get(), wait_s)

    async def expect(self, handoff_id: UUID, *expected: Input) -> None:
        for message in expected:
            assert await self.next(handoff_id) == message

    async def hold_source(self, handoff_id: UUID) -> None:
        """Submit the handoff's prefill (action 0) and wait until the source holds its blocks."""
        await self.send(SOURCE, SubmitPrefill(handoff_id, 0))
        await self.expect(
            handoff_id,
            ActionOutcome(handoff_id, 0, SUBMITTED),
            SourceHeld(handoff_id, FAST.timing(PROMPT)),
        )

    async def hold_destination(self, handoff_id: UUID) -> None:
        """Reserve the destination for the handoff (action 0) and wait until it holds the
        blocks."""
        await self.send(DESTINATION, ReserveDestination(handoff_id, 0))
        await self.expect(
            handoff_id,
            ActionOutcome(handoff_id, 0, ACCEPTED),
            DestinationReserved(handoff_id, RESERVED_TOKENS),
        )

    def queued(self, handoff_id: UUID) -> list[Input]:
        """What arrived for the handoff and was not taken yet."""
        queue = self._inputs[handoff_id]
        return [queue.get_nowait() for _ in range(queue.qsize())]

    async def report_until(
        self, condition: Callable[[EnginesReport], bool], wait_s: float = 5.0
    ) -> EnginesReport:
        """Ask the (one) engine process for reports until one satisfies the condition."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + wait_s
        while True:
            reports = await request_reports(Connection(self.bus, self.subjects), quiet_s=0.05)
            assert len(reports) == 1
            if condition(reports[0]):
                return reports[0]
            assert loop.time() < give_up_at, f"no report satisfied the condition: {reports[0]}"


def held(engine: MockEngine) -> int:
    return engine.capacity.used_blocks


def unordered(messages: list[Input]) -> list[str]:
    """Messages as a multiset, for those whose relative order the engine does not fix."""
    return sorted(map(repr, messages))
