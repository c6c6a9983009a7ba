"""The tier's half of the engines' leases (`events.leases`): watch the lease bucket, and answer
for an engine whose lease is gone.

Theory of operation
-------------------
`EngineLeases` is one per worker process. It watches the lease bucket (`Bus.watch_leases`) from
its last message per key on, before the tier claims anything, so it knows at every claim which
engines are live, which lost their lease (the bucket's delete marker), and which never held one.
An engine's lease is *gone* when its key expired, or when a new incarnation replaced the one
before it (a restarted engine, or one that fenced itself and came back): either way the engine
that held the handoffs is no more, and it promised to drop them (`client.lease`). A gone
incarnation never comes back: a renewal of it stored late (sent before the engine was cut off)
is ignored.

For a gone engine, the owner of each open handoff involving it records, as ordinary inputs on
the handoff's own input subject (so the log, replay and `verify` see them like any other):

- `Failed(reason=LEASE_EXPIRED)` for a handoff still active;
- `ActionOutcome(Noop, by_tier=True)` for each cleanup (`CancelSource`, `CancelDestination`,
  `ReleaseSource`) outstanding at that engine, while no new incarnation holds its lease.

An engine whose new incarnation replaced the one before is live: it answers every cleanup
itself (`Noop` for a handoff it never held), so the tier answers none for it. Which
incarnation took a handoff, the tier cannot tell: its watch may learn of the new one late (an
election, a reconnect), after that one took handoffs, and a cleanup answered for one of them
would be one the live engine never runs, its blocks leaked (seed 197 of `kvhandoff sim --duration
20s --rate 2`). A `Failed` for a handoff of the new incarnation costs that handoff only: it ends
canceled, and the live engine runs its cleanups.

It does so at three moments: when the watch sees the lease go (every handoff in memory), when
a partition is claimed (`sweep`: the new owner acts the same way), and whenever an action is
published to an engine whose lease is gone (`sent`: the cleanups that the `Failed` issued, and
every retry, so an answer whose publish failed is given again with the action's next retry).
Each answer carries the message id `answer_id` derives, and identical answers have identical
digests, so an answer given twice (two owners, a failover, a retry) is applied once.

Admission (`admit`): a `StartHandoff` naming an engine whose lease expired is rejected, as one
naming an engine that never held a lease is with `require` (`kvhandoff run --require-leases`).
An engine that never held a lease is otherwise served as before leases: its handoffs end at
their deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from uuid import UUID

import msgspec
from prometheus_client import Counter

from kvhandoff.events.codec import encode
from kvhandoff.events.coordinator import Mode
from kvhandoff.events.leases import ENGINE_UNAVAILABLE, LEASE_EXPIRED, EngineLease, answer_id
from kvhandoff.events.messages import (
    NOOP,
    Action,
    ActionOutcome,
    CancelDestination,
    CancelSource,
    Failed,
    Input,
    ReleaseSource,
    Role,
    StartHandoff,
)
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.ambient import now_ms
from kvhandoff.worker.bus.connection import Bus, Subscription
from kvhandoff.worker.bus.kv import open_expiring_bucket, watch_bucket
from kvhandoff.worker.errors import BusError
from kvhandoff.worker.stoppable import cancel_until_done, unless_stopped
from kvhandoff.worker.tier.lease_view import LeaseView, write_view
from kvhandoff.worker.tier.metrics import Metrics
from kvhandoff.worker.tier.planner import OpenHandoff

logger = logging.getLogger(__name__)

# How long the bucket keeps a delete marker: a worker started within it still learns that an
# engine is gone (as `client.connection` creates the bucket).
MARKER_TTL_S = 24 * 3600.0
_START_RETRY_S = 1.0
_ANSWER_GIVE_UP_S = 5.0  # the next retry of the action gives the answer again
_CLEANUPS = (CancelSource, CancelDestination, ReleaseSource)
_DECODER = msgspec.json.Decoder(EngineLease)


class LeaseState(enum.StrEnum):
    LIVE = "live"
    EXPIRED = "expired"
    NONE = "none"  # never held one that the bucket remembers


class EngineLeases:
    """What the lease bucket says of each engine, and the tier's answers for gone ones."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        metrics: Metrics,
        *,
        require: bool = False,
        view: Path | None = None,
    ) -> None:
        self._bus = bus
        self._view = view  # worker.tier.lease_view: what `kvhandoff stuck` shows
        self._bucket = subjects.lease_bucket
        self._subjects = subjects
        self._require = require
        self._live: dict[str, str] = {}  # engine id -> incarnation
        self._gone: dict[str, str] = {}  # engine id -> last incarnation ("" if not known)
        self._listeners: list[Callable[[str, str], None]] = []
        self._subscription: Subscription | None = None
        self._tasks: dict[asyncio.Task[None], None] = {}  # a set in the order made: see `_answer`
        self.answers = Counter(
            "kvhandoff_lease_answers",
            "Inputs the tier gave for engines whose lease was gone: failed (a handoff ended by a "
            "lease, apart from timeouts and engine failures) or noop (a cleanup answered)",
            ["kind"],
            registry=metrics.registry,
        )

    def on_gone(self, listener: Callable[[str, str], None]) -> None:
        """Call `listener(engine_id, incarnation)` whenever an engine's lease goes (the
        incarnation is "" if the watch never saw it: a marker read at start)."""
        self._listeners.append(listener)

    async def start(self, stop: asyncio.Event) -> None:
        """Open the bucket and read what it holds; returns once every key was read, or `stop`
        is set. Retried while NATS cannot answer (a cluster forming, electing a leader), as
        the tier's own set-up is."""
        while not stop.is_set():
            try:
                # A JetStream that does not answer holds each request for its timeout: a stop
                # abandons it, so that a worker told to stop exits promptly.
                watching = await unless_stopped(stop, self._watch())
                if watching is not None:
                    self._subscription = watching
                return
            except BusError as exc:
                logger.warning("leases: cannot watch the bucket yet (%s); retrying", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_START_RETRY_S):
                    await stop.wait()

    async def _watch(self) -> Subscription:
        await open_expiring_bucket(self._bus, self._bucket, MARKER_TTL_S)
        return await watch_bucket(self._bus, self._bucket, self._on_entry)

    async def stop(self) -> None:
        """Stop watching, and give up the answers still being published (the next owner's
        claim, or the next retry of the action, gives them again)."""
        if self._subscription is not None:
            subscription, self._subscription = self._subscription, None
            try:
                await subscription.unsubscribe()
            except BusError as exc:
                logger.warning("lease watch: %s", exc)
        tasks = list(self._tasks)
        for task in tasks:
            await cancel_until_done(task)
        await asyncio.gather(*tasks, return_exceptions=True)  # done: this reads what they raised

    def state(self, engine_id: str) -> LeaseState:
        if engine_id in self._live:
            return LeaseState.LIVE
        return LeaseState.EXPIRED if engine_id in self._gone else LeaseState.NONE

    def admit(self, start: StartHandoff) -> str | None:
        """Why a start must be rejected, or None to admit it."""
        for engine_id in (start.source, start.destination):
            state = self.state(engine_id)
            if state is LeaseState.EXPIRED:
                return f"{ENGINE_UNAVAILABLE}: {engine_id}'s lease expired"
            if state is LeaseState.NONE and self._require:
                return f"{ENGINE_UNAVAILABLE}: {engine_id} holds no lease (--require-leases)"
        return None

    # --- The watch ------------------------------------------------------------------------

    def _on_entry(self, engine_id: str, value: bytes | None) -> None:
        if value is None:
            incarnation = self._live.pop(engine_id, None)
            if incarnation is None and engine_id in self._gone:
                return
            self._gone[engine_id] = incarnation or ""
            logger.warning("engine %s: lease expired (incarnation %s)", engine_id, incarnation)
            self._notify(engine_id, incarnation or "")
            return
        try:
            lease = _DECODER.decode(value)
        except msgspec.DecodeError as exc:
            logger.warning("lease bucket: ignored the value of %s: %s", engine_id, exc)
            return
        if lease.incarnation == self._gone.get(engine_id):
            # A renewal stored after its lease expired (sent before, delivered late): the engine
            # fenced itself when it could not renew, and comes back under a new incarnation.
            logger.info(
                "engine %s: ignored a late renewal of gone %s", engine_id, lease.incarnation
            )
            return
        before = self._live.get(engine_id)
        self._live[engine_id] = lease.incarnation
        if self._gone.pop(engine_id, None) is not None or before is None:
            self._save()  # live again, or for the first time
        if before is not None and before != lease.incarnation:
            # The handoffs of the incarnation before are the gone engine's.
            logger.warning(
                "engine %s: new incarnation %s replaced %s", engine_id, lease.incarnation, before
            )
            self._notify(engine_id, before)

    def _notify(self, engine_id: str, incarnation: str) -> None:
        self._save()
        for listener in self._listeners:
            listener(engine_id, incarnation)

    def _save(self) -> None:
        if self._view is None:
            return
        engines = {e: LeaseState.EXPIRED.value for e in self._gone}
        engines |= {e: LeaseState.LIVE.value for e in self._live}
        write_view(self._view, LeaseView(now_ms(), engines))

    # --- Answers --------------------------------------------------------------------------

    def sweep(self, handoffs: Iterable[OpenHandoff], gone: dict[str, str] | None = None) -> None:
        """Answer for the gone engines (`gone`: engine id -> incarnation, by default every
        engine whose lease expired) in these handoffs. (A new owner cannot tell which of its
        handoffs a replaced incarnation held: the owner at the replacement answers for them.)"""
        gone = self._gone if gone is None else gone
        if not gone:
            return
        for handoff in list(handoffs):
            # In the order the start names them, not a set's: which engine is answered for
            # first decides the Failed that is sent, and that must not follow the hash seed.
            for engine in dict.fromkeys((handoff.start.source, handoff.start.destination)):
                incarnation = gone.get(engine)
                if incarnation is not None:
                    self._answer(handoff, engine, incarnation, None)

    def sent(self, handoff: OpenHandoff | None, action: Action) -> None:
        """An action was published: if its engine's lease is gone, answer for it."""
        if handoff is None:
            return
        engine = _executor(handoff.start, action)
        incarnation = self._gone.get(engine) if engine is not None else None
        if engine is not None and incarnation is not None:
            self._answer(handoff, engine, incarnation, action)

    def _answer(
        self, handoff: OpenHandoff, engine: str, incarnation: str, action: Action | None
    ) -> None:
        handoff_id = handoff.start.handoff_id
        answers: list[tuple[Input, str, str]] = []
        coordinator = handoff.coordinator
        if coordinator.mode is Mode.ACTIVE:
            answers.append((Failed(handoff_id, LEASE_EXPIRED), "failed", "failed"))
        if action is not None:
            pending = [action]
        elif engine in self._live:  # a new incarnation replaced it: it answers its cleanups
            pending = []
        else:
            pending = coordinator.outstanding()
        for outstanding in pending:
            if isinstance(outstanding, _CLEANUPS) and _executor(handoff.start, outstanding) == (
                engine
            ):
                noop = ActionOutcome(handoff_id, outstanding.action_id, NOOP, by_tier=True)
                answers.append((noop, str(outstanding.action_id), "noop"))
        if not answers:
            return
        task = asyncio.create_task(self._publish(handoff_id, engine, incarnation, answers))
        # A dict, not a set: `close` cancels them in this order, not their addresses'.
        self._tasks[task] = None
        task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    async def _publish(
        self,
        handoff_id: UUID,
        engine: str,
        incarnation: str,
        answers: list[tuple[Input, str, str]],
    ) -> None:
        subject = self._subjects.input(handoff_id)
        for message, what, kind in answers:
            msg_id = answer_id(handoff_id, engine, incarnation, what)
            try:
                await self._bus.publish_durable(
                    subject, encode(message), give_up_after_s=_ANSWER_GIVE_UP_S, msg_id=msg_id
                )
            except BusError as exc:
                logger.warning("handoff %s: answering for %s: %s", handoff_id, engine, exc)
                return
            self.answers.labels(kind).inc()
            logger.info("handoff %s: %s for %s, whose lease is gone", handoff_id, kind, engine)


def _executor(start: StartHandoff, action: Action) -> str | None:
    match action.executor:
        case Role.SOURCE:
            return start.source
        case Role.DESTINATION:
            return start.destination
        case Role.FRONTEND:
            return None
