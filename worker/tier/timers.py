"""Timers: each open handoff's deadline and each unanswered action's retry.

`TimerQueue` is the data structure: keyed deadlines in a plain heap with lazy deletion.
Scheduling a key again replaces its deadline, cancelling forgets it, and stale heap entries
are skipped when they surface. It reads no clock and knows no asyncio.

`HandoffTimers` runs two of them for one set of handoffs in memory (one owned partition's
`worker.tier.planner.Planner`) in a task of its own, until cancelled. Its owner tells it what
changed, and it does the rest:

    rearm(adopted)   memory was rebuilt from the log: forget every timer; each adopted
                     handoff's deadline is its row's, and each of its outstanding actions is
                     due for a retry one interval from now (as if published once);
    arm(plan)        a plan counts (once appended): deadlines of new handoffs, retries
                     an outcome answered, deadlines of handoffs that left memory;
    sent(action)     an action was published (first, republished or recovered): count the
                     attempt and schedule the next one;
    clear()          these handoffs are no longer this worker's to time out or retry: a
                     deadline's `TimedOut` still on its way (NATS away) is abandoned with
                     the rest, as the next claim's rearm fires that deadline again.

A deadline that passes while its handoff is still active publishes `TimedOut` durably to the
handoff's own input subject, so it is logged and replayed like any other input (whoever
applies it: a second `TimedOut` of a handoff is an exact duplicate, dropped by its digest). An
action with no outcome after the retry interval is published again, through the owner's own
publish (`republish`), with the same action id, then again after twice as long, and so on up to
`RETRY_BACKOFF_CAP` intervals, so a slow engine is not buried under its own backlog. Both look
the handoff up in the planner when they fire, so a handoff that completed, or an action that
was answered, meanwhile is left alone. A deadline whose `TimedOut` cannot be published (NATS
away) fires again a second later. A retry never fails here: the owner's publish takes a failed
publication as a failed barrier, and publishes it again itself, with its own growing pause, until
one confirms it (worker.tier.service's `_publish_again`), so there is one such backoff, not two.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Generic, TypeVar
from uuid import UUID

from kvhandoff.events.codec import encode
from kvhandoff.events.coordinator import Mode
from kvhandoff.events.messages import Action, Complete, TimedOut
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.ambient import wall_s
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.errors import BusError
from kvhandoff.worker.log.rows import HandoffRow
from kvhandoff.worker.stoppable import unless_stopped
from kvhandoff.worker.tier.metrics import Metrics
from kvhandoff.worker.tier.planner import OpenHandoff, Plan, Planner

logger = logging.getLogger(__name__)

RETRY_BACKOFF_CAP = 8  # the longest wait between two publications, in retry intervals
_PUBLISH_FAILED_PAUSE_S = 1.0  # a deadline's TimedOut found NATS reconnecting; it was rearmed

K = TypeVar("K", bound=Hashable)
# Publish an action again as its owner publishes any action (and so calls `sent`); it does
# not raise for a publication NATS lost, which the owner publishes again itself.
Republish = Callable[[HandoffRow, Action], Awaitable[None]]


class TimerQueue(Generic[K]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._due: dict[K, float] = {}
        self._tiebreak = itertools.count()  # keys need not be orderable

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, key: K) -> bool:
        return key in self._due

    def schedule(self, key: K, due: float) -> None:
        self._due[key] = due
        heapq.heappush(self._heap, (due, next(self._tiebreak), key))

    def cancel(self, key: K) -> None:
        self._due.pop(key, None)
        # Cancelled entries stay in the heap until they surface; rebuild it when they
        # outnumber the live ones, so memory follows what is scheduled, not what was.
        if len(self._heap) > 2 * len(self._due) + 1024:
            self._heap = [(due, next(self._tiebreak), k) for k, due in self._due.items()]
            heapq.heapify(self._heap)

    def next_due(self) -> float | None:
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[K]:
        """Every key due at or before `now`, earliest first; they are no longer scheduled."""
        fired: list[K] = []
        while True:
            self._drop_stale()
            if not self._heap or self._heap[0][0] > now:
                return fired
            _, _, key = heapq.heappop(self._heap)
            del self._due[key]
            fired.append(key)

    def _drop_stale(self) -> None:
        heap, due = self._heap, self._due
        while heap and due.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)


class HandoffTimers:
    """The deadlines and retries of one planner's handoffs (module docstring); `run` it."""

    def __init__(
        self,
        planner: Planner,
        bus: Bus,
        subjects: Subjects,
        metrics: Metrics,
        *,
        retry_interval_s: float,
        republish: Republish,
    ) -> None:
        self._planner = planner
        self._bus = bus
        self._subjects = subjects
        self._metrics = metrics
        self._retry_interval_s = retry_interval_s
        self._republish = republish
        self._deadlines: TimerQueue[UUID] = TimerQueue()
        self._retries: TimerQueue[tuple[UUID, int]] = TimerQueue()
        self._attempts: dict[tuple[UUID, int], int] = {}  # publications per outstanding action
        self._changed = asyncio.Event()
        # What the task waits for: the earliest timer it knew of (None: none, so for ever). A
        # timer due later need not wake it (most retries: one is armed per action published).
        self._waiting_until: float | None = None
        # Set by `clear` while deadlines fire: the claim they were due under ended.
        self._cleared = asyncio.Event()

    def clear(self) -> None:
        """Forget every timer, and abandon the deadlines firing (see `run`)."""
        self._deadlines = TimerQueue()
        self._retries = TimerQueue()
        self._attempts.clear()
        self._cleared.set()
        self._changed.set()

    def rearm(self, adopted: Iterable[OpenHandoff]) -> None:
        """Replace every timer with those of handoffs just rebuilt from the log."""
        self.clear()
        retry_at = wall_s() + self._retry_interval_s
        for handoff in adopted:
            handoff_id = handoff.start.handoff_id
            self._deadlines.schedule(handoff_id, handoff.row.deadline_at_ms / 1000)
            for action in handoff.coordinator.outstanding():
                if not isinstance(action, Complete):
                    self._attempts[(handoff_id, action.action_id)] = 1
                    self._retries.schedule((handoff_id, action.action_id), retry_at)

    def arm(self, plan: Plan) -> None:
        """Apply the timer changes of a plan (`Plan.new_deadlines`, `answered`, `left_memory`).
        A cancelled timer that the task waits for is found gone when it wakes."""
        for handoff_id, due in plan.new_deadlines:
            self._deadlines.schedule(handoff_id, due)
            self._wake_for(due)
        for answered in plan.answered:
            self._retries.cancel(answered)
            self._attempts.pop(answered, None)
        for handoff_id in plan.left_memory:
            self._deadlines.cancel(handoff_id)

    def sent(self, action: Action) -> None:
        """An action was published: its next publication is due after a growing backoff.
        A `Complete` is not answered, so it is never retried."""
        if isinstance(action, Complete):
            return
        key = (action.handoff_id, action.action_id)
        attempts = self._attempts[key] = self._attempts.get(key, 0) + 1
        backoff = min(2 ** (attempts - 1), RETRY_BACKOFF_CAP)
        due = wall_s() + self._retry_interval_s * backoff
        self._retries.schedule(key, due)
        self._wake_for(due)

    def _wake_for(self, due: float) -> None:
        if self._waiting_until is None or due < self._waiting_until:
            self._changed.set()

    async def run(self) -> None:
        """Fire what is due, as it falls due, until the task is cancelled."""
        while True:
            self._changed.clear()
            candidates = (self._deadlines.next_due(), self._retries.next_due())
            dues = [d for d in candidates if d is not None]
            wait = min(dues) - wall_s() if dues else None
            if wait is None or wait > 0:
                self._waiting_until = min(dues) if dues else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), wait)
                continue
            now = wall_s()
            expired = self._deadlines.pop_due(now)
            self._cleared = cleared = asyncio.Event()
            try:
                # A publish may outlast the claim (retried for seconds while NATS is away):
                # one that ended abandons it and the deadlines behind it, or its `TimedOut`
                # would come after the claim's release, and again once a new claim rearms.
                await unless_stopped(cleared, self._expire_each(expired))
                if cleared.is_set():
                    continue
                for handoff_id, action_id in self._retries.pop_due(now):
                    await self._retry(handoff_id, action_id)
            except BusError as exc:
                # Those due behind the one that failed were taken off the queue: put them back.
                for handoff_id in expired:
                    self._deadlines.schedule(handoff_id, wall_s() + _PUBLISH_FAILED_PAUSE_S)
                logger.warning("a deadline's TimedOut was not published, will retry: %s", exc)
                await asyncio.sleep(_PUBLISH_FAILED_PAUSE_S)

    async def _expire_each(self, expired: list[UUID]) -> None:
        """Expire these, in order; each leaves `expired` once its `TimedOut` is published."""
        while expired:
            await self._expire(expired[0])
            expired.pop(0)

    async def _expire(self, handoff_id: UUID) -> None:
        handoff = self._planner.open.get(handoff_id)
        if handoff is None or handoff.coordinator.mode is not Mode.ACTIVE:
            return
        await self._bus.publish_durable(
            self._subjects.input(handoff_id), encode(TimedOut(handoff_id))
        )
        logger.info("handoff %s: deadline passed, timed out", handoff_id)

    async def _retry(self, handoff_id: UUID, action_id: int) -> None:
        attempts = self._attempts.pop((handoff_id, action_id), 0)
        handoff = self._planner.open.get(handoff_id)
        if handoff is None:
            return
        for action in handoff.coordinator.outstanding():
            if action.action_id == action_id:
                logger.debug("handoff %s: republishing action %d", handoff_id, action_id)
                self._metrics.republished.inc()
                self._attempts[(handoff_id, action_id)] = attempts
                await self._republish(handoff.row, action)
                return
