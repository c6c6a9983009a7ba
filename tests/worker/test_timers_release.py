"""HandoffTimers: a deadline's `TimedOut` still on its way when the claim ends is abandoned, so a
new claim's rearm publishes it once, not a second time behind the late first one (seed 110 of
the simulation: a publish retried through two resets landed after the claim anew)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import cast

from kvhandoff.events.codec import decode_input
from kvhandoff.events.coordinator import HandoffCoordinator
from kvhandoff.events.messages import EngineType, StartHandoff, TimedOut
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.log.rows import HandoffRow
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.tier.metrics import Metrics
from kvhandoff.worker.tier.planner import OpenHandoff, Planner
from kvhandoff.worker.tier.timers import HandoffTimers


class StalledBus:
    """Stands in for the bus: its first durable publish waits until `let_through`, as one
    retried while NATS is away; the others are stored at once."""

    def __init__(self) -> None:
        self.began = asyncio.Event()
        self.let_through = asyncio.Event()
        self.abandoned = asyncio.Event()
        self.stored: list[TimedOut] = []
        self.stored_one = asyncio.Event()

    async def publish_durable(self, subject: str, payload: bytes) -> None:
        message = decode_input(payload)
        assert isinstance(message, TimedOut)
        if not self.began.is_set():
            self.began.set()
            try:
                await self.let_through.wait()
            except asyncio.CancelledError:
                self.abandoned.set()
                raise
        self.stored.append(message)
        self.stored_one.set()


def overdue_handoff() -> OpenHandoff:
    """An active handoff whose deadline (60 s after the epoch) passed long ago."""
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    row = HandoffRow(
        start.handoff_id, "vllm", "prefill-0", "decode-0", 0, 60_000, HandoffState.OPEN, None, -1, 0
    )
    handoff = OpenHandoff(start, HandoffCoordinator.for_start(start), row, set())
    handoff.coordinator.handle(start)
    return handoff


async def test_a_timed_out_on_its_way_when_the_claim_ends_is_abandoned() -> None:
    handoff = overdue_handoff()
    planner = Planner(Subjects(), 8, 1.0)
    planner.open[handoff.start.handoff_id] = handoff
    bus = StalledBus()

    async def republish(row: HandoffRow, action: object) -> None:
        raise AssertionError("no retry falls due in this test")

    timers = HandoffTimers(
        planner, cast(Bus, bus), Subjects(), Metrics(), retry_interval_s=3600.0, republish=republish
    )
    timers.rearm([handoff])
    task = asyncio.create_task(timers.run())
    try:
        await bus.began.wait()
        # The claim ends and a new one rebuilds the same handoff from the log, while the first
        # TimedOut is still on its way: it is abandoned (a bound, should it not be).
        timers.clear()
        timers.rearm([handoff])
        await asyncio.wait_for(bus.abandoned.wait(), timeout=5.0)
        bus.let_through.set()
        await bus.stored_one.wait()
        assert bus.stored == [TimedOut(handoff.start.handoff_id)]  # the rearm's, once
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
