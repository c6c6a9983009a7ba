"""An engine written on the raw bus, as a foreign engine would be, with a switch that breaks one
rule of the contract (`Break`, named after `kvhandoff engine-check`'s rules); with no switch it
keeps them all. `tests/engines/test_engine_check.py` holds the checker to it: each break fails
exactly its rule.

Its slow part (a prefill, a reservation, a transfer) lasts `SLOW_S`, or ends as soon as a cancel
of the handoff has been answered: so the `cancel-during` break publishes its fact right after
the cancel's outcome, whatever the machine's load.
"""

from __future__ import annotations

import asyncio
import enum
from collections import defaultdict

from kvhandoff.events.codec import decode_action, encode
from kvhandoff.events.ids import HandoffId
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
    EngineType,
    HandoffTransferTiming,
    Input,
    KvTransferTimingMode,
    Outcome,
    ReleaseSource,
    ReserveDestination,
    Role,
    SourceHeld,
    StartTransfer,
    SubmitPrefill,
    TransferCompleted,
)
from kvhandoff.events.reports import EnginesReport, EngineStatus
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus, Message

SLOW_S = 0.05
TIMING = HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, 100, 131_072, 25.0)


class Break(enum.StrEnum):
    PROBE = "probe"  # answers a probe with a body
    REPORT = "report"  # answers no report request
    FORWARD_PATH = "forward-path"  # fails the second forward action (transfer, activation)
    FACT_AFTER_OUTCOME = "fact-after-outcome"  # publishes the fact before the outcome
    REPEAT = "repeat"  # remembers only a handoff's last action id
    DUPLICATE = "duplicate"  # handles copies side by side, recording outcomes late
    CANCEL_BEFORE = "cancel-before"  # a cancel of nothing fails
    CANCEL_DURING = "cancel-during"  # the work goes on after a cancel and publishes its fact
    CANCEL_AFTER = "cancel-after"  # a cancel of what is held answers noop and keeps it
    LATE_FORWARD = "late-forward"  # takes ownership after cleanup


class BrokenEngine:
    def __init__(
        self, bus: Bus, subjects: Subjects, engine_id: str, role: Role, broken: Break | None
    ) -> None:
        self.bus, self.subjects, self.engine_id, self.role = bus, subjects, engine_id, role
        self.broken = broken
        self.outcomes: defaultdict[HandoffId, dict[int, Outcome]] = defaultdict(dict)
        self.locks: defaultdict[HandoffId, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.held: set[HandoffId] = set()
        self.ended: set[HandoffId] = set()
        self.canceled: defaultdict[HandoffId, asyncio.Event] = defaultdict(asyncio.Event)
        self.work: dict[HandoffId, asyncio.Task[None]] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.engine(self.engine_id), self._on_message)
        if self.broken is not Break.REPORT:
            await self.bus.subscribe(self.subjects.engines_report, self._on_report)
        await self.bus.flush()

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _on_report(self, msg: Message) -> None:
        status = EngineStatus(self.engine_id, EngineType.VLLM, self.role)
        await self.bus.publish(msg.reply, encode(EnginesReport("broken", [status], [])))

    async def _on_message(self, msg: Message) -> None:
        if not msg.data:
            await self.bus.publish(msg.reply, b"here" if self.broken is Break.PROBE else b"")
            return
        task = asyncio.create_task(self._receipt(decode_action(msg.data)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _publish(self, message: Input) -> None:
        await self.bus.publish_durable(self.subjects.input(message.handoff_id), encode(message))

    async def _receipt(self, action: Action) -> None:
        h = action.handoff_id
        if self.broken is Break.DUPLICATE:
            outcome = self.outcomes[h].get(action.action_id)
            await asyncio.sleep(0)  # the engine's scheduler: a copy slips in before the record
            if outcome is None:
                outcome = self._execute(action)
                self.outcomes[h][action.action_id] = outcome
            async with self.locks[h]:
                await self._publish(ActionOutcome(h, action.action_id, outcome))
            return
        async with self.locks[h]:
            outcome = self.outcomes[h].get(action.action_id)
            if outcome is None:
                outcome = self._execute(action)
                if self.broken is Break.REPEAT:
                    self.outcomes[h].clear()
                self.outcomes[h][action.action_id] = outcome
                if self.broken is Break.FACT_AFTER_OUTCOME and h in self.work:
                    self.work.pop(h).cancel()
                    await self._publish(self._fact(action))
            await self._publish(ActionOutcome(h, action.action_id, outcome))
        if isinstance(action, CancelSource | CancelDestination):
            self.canceled[h].set()

    def _execute(self, action: Action) -> Outcome:
        h = action.handoff_id
        match action:
            case SubmitPrefill() | ReserveDestination():
                if h in self.ended and self.broken is not Break.LATE_FORWARD:
                    return ActionFailed("cleaned up here")
                self.held.add(h)
                self._start(action)
                return SUBMITTED if isinstance(action, SubmitPrefill) else ACCEPTED
            case StartTransfer():
                if self.broken is Break.FORWARD_PATH:
                    return ActionFailed("broken")
                self._start(action)
                return SCHEDULED
            case ActivateDestination():
                if self.broken is Break.FORWARD_PATH:
                    return ActionFailed("broken")
                return APPLIED  # the decode holds the blocks until it ends or is canceled
            case ReleaseSource() | CancelSource() | CancelDestination():
                self.ended.add(h)
                if h not in self.held:
                    broken = self.broken is Break.CANCEL_BEFORE
                    return ActionFailed("nothing held") if broken else NOOP
                if self.broken is Break.CANCEL_AFTER and h not in self.work:
                    return NOOP
                if self.broken is not Break.CANCEL_DURING and h in self.work:
                    self.work.pop(h).cancel()
                self.held.discard(h)
                return APPLIED
            case _:
                raise AssertionError(action)

    def _fact(self, action: Action) -> Input:
        h = action.handoff_id
        match action:
            case SubmitPrefill():
                return SourceHeld(h, TIMING)
            case ReserveDestination():
                return DestinationReserved(h, 96)
            case _:
                return TransferCompleted(h)

    def _start(self, action: Action) -> None:
        task = asyncio.create_task(self._slow(action))
        self.work[action.handoff_id] = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _slow(self, action: Action) -> None:
        h = action.handoff_id
        try:
            async with asyncio.timeout(SLOW_S):
                await self.canceled[h].wait()
        except TimeoutError:
            pass
        async with self.locks[h]:
            if self.work.get(h) is asyncio.current_task():
                del self.work[h]
            await self._publish(self._fact(action))
