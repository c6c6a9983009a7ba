"""The engine client: what a prefill or decode engine needs to take part in handoffs.

Theory of operation
-------------------
An `Engine` subscribes to `<prefix>.engine.<engine_id>.actions`. Each action is decoded (one
that does not decode is logged, counted and dropped) and dispatched by kind to the typed
handler in `Handlers`, which returns the action's `Outcome`. The engine stores the outcome
under the action id and publishes it as an `ActionOutcome` to the handoff's input subject with
JetStream (retried with backoff until the input stream stored it).

Invariants
----------
- Once per action id. The worker republishes an action whose outcome it has not seen, with the
  same id. A repeated id is answered with the stored outcome and its handler does not run
  again. The outcomes are remembered for the `remember` handoffs used last (an LRU), so memory
  is bounded; an action id repeated after its handoff was forgotten would run again, which is
  why `remember` should far exceed the handoffs in flight. With `outcomes_path`, each outcome
  is also recorded in a small SQLite file before it is published (`client.outcomes`), and
  loaded at `start`: a restarted engine answers a repeat without running it again.
- One at a time per handoff. A handoff's receipts are handled one after another, in arrival
  order, under the handoff's lock, and its outcome is published under that lock: a cancel never
  overtakes the action it cancels. Different handoffs run concurrently (a task per receipt).
- Facts after outcomes. `source_held`, `destination_reserved`, `transfer_completed` and
  `failed` publish under the same lock, so a fact that follows from an action is never stored
  before that action's outcome. Code that must change its own state and publish a fact
  atomically does both inside `async with engine.handoff(handoff_id) as facts:`. A handler runs
  under the lock already: it returns its outcome and leaves any fact to work it starts (a fact
  published from inside a handler would precede the outcome, and `engine.handoff` there would
  wait for itself).
- Missing handlers. An action kind without a handler (an engine of the other role, say) is
  answered `Noop` if it is a cleanup (this engine holds nothing for the handoff) and
  `ActionFailed` otherwise: taking ownership it cannot honour would leak.
- A handler that raises answers nothing: the error is logged, no outcome is stored, and the
  worker's retry of the action runs the handler again.
- A `Complete` sent to an engine's subject is logged and ignored: it is for frontends.
- Leases (`client.lease`, `events.leases`). Unless `lease_ttl_s` is None, `start` takes a lease
  on the engine id and a task renews it. If the lease lapses (NATS cut off, the process paused),
  the tier may already have answered for the engine, so the engine *fences* every handoff it
  remembers: `Handlers.fenced` is told to drop them (their KV), nothing of theirs is published
  but a refusal, a `Noop` or a `Failed`, and any later action of theirs is answered without
  running a handler: a cleanup with `Noop`, anything else with `ActionFailed`. A handoff first
  seen while the engine holds no lease is fenced alike. The engine goes on under a new
  incarnation once a renewal succeeds again.

`Interference` is a seam for the mock engines' fault injection (ignore, delay or duplicate a
receipt); a real engine leaves it out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kvhandoff.client.connection import Connection, Watch
from kvhandoff.client.errors import BusUnavailable, OutcomeLogFailed
from kvhandoff.client.lease import DEFAULT_LEASE_TTL_S, Lease
from kvhandoff.client.outcomes import OutcomeLog
from kvhandoff.events.codec import encode
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.leases import LEASE_EXPIRED
from kvhandoff.events.messages import (
    NOOP,
    Action,
    ActionFailed,
    ActionOutcome,
    ActivateDestination,
    CancelDestination,
    CancelSource,
    Complete,
    DestinationReserved,
    Failed,
    HandoffTransferTiming,
    Input,
    Noop,
    Outcome,
    ReleaseSource,
    ReserveDestination,
    SourceHeld,
    StartTransfer,
    SubmitPrefill,
    TransferCompleted,
)

logger = logging.getLogger(__name__)

_CANCEL_AGAIN_S = 0.05  # how long `stop` waits before it cancels a task again

A = TypeVar(
    "A",
    SubmitPrefill,
    StartTransfer,
    ReleaseSource,
    CancelSource,
    ReserveDestination,
    ActivateDestination,
    CancelDestination,
)

DEFAULT_REMEMBER = 100_000
# How long an outcome is retried while NATS or the input stream does not answer. A lost outcome
# is not lost for good: the worker republishes the action and gets the stored outcome again.
OUTCOME_GIVE_UP_S = 30.0


@dataclass(frozen=True)
class Handlers:
    """One handler per action kind; each returns the action's outcome. Leave out the kinds an
    engine does not execute (see "Missing handlers")."""

    submit_prefill: Callable[[SubmitPrefill], Awaitable[Outcome]] | None = None
    start_transfer: Callable[[StartTransfer], Awaitable[Outcome]] | None = None
    release_source: Callable[[ReleaseSource], Awaitable[Outcome]] | None = None
    cancel_source: Callable[[CancelSource], Awaitable[Outcome]] | None = None
    reserve_destination: Callable[[ReserveDestination], Awaitable[Outcome]] | None = None
    activate_destination: Callable[[ActivateDestination], Awaitable[Outcome]] | None = None
    cancel_destination: Callable[[CancelDestination], Awaitable[Outcome]] | None = None
    # The lease lapsed: drop what these handoffs hold, at once (see "Leases"). Synchronous, as
    # it runs where the lapse is noticed, before anything else is handled or published.
    fenced: Callable[[list[HandoffId]], None] | None = None


class Interference(Protocol):
    """What fault injection does to an engine's traffic (the mock engines'; tests')."""

    def on_receipt(self, action: Action) -> float | None:
        """None to ignore this receipt, as if it never arrived; otherwise the seconds to wait,
        under the handoff's lock, before handling it."""

    def copies(self, payload: bytes) -> int:
        """How many times to publish this outcome or fact (1 normally)."""


@dataclass
class EngineStats:
    """What the engine client did since it started."""

    executed: int = 0  # action ids whose handler ran (first receipts)
    repeated: int = 0  # repeated action ids answered with the stored outcome
    malformed: int = 0  # messages on the action subject that did not decode as an action
    ignored: int = 0  # receipts that `Interference.on_receipt` ignored
    fenced: int = 0  # handoffs fenced when the lease lapsed
    withheld: int = 0  # outcomes and facts of fenced handoffs not published


@dataclass(eq=False)
class _Memory:
    """What the engine client keeps of one handoff."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    fenced: bool = False  # held when the lease lapsed (see "Leases")


class HandoffFacts:
    """Facts for one handoff, published while its lock is held (`Engine.handoff`)."""

    def __init__(self, engine: Engine, handoff_id: HandoffId) -> None:
        self._engine = engine
        self.handoff_id = handoff_id

    async def source_held(self, timing: HandoffTransferTiming) -> None:
        """The source holds the prompt's KV blocks; `timing` sizes the transfer."""
        await self._engine.publish(SourceHeld(self.handoff_id, timing))

    async def destination_reserved(self, transferable_prompt_tokens: int) -> None:
        """The destination reserved room for that many prompt tokens."""
        await self._engine.publish(DestinationReserved(self.handoff_id, transferable_prompt_tokens))

    async def transfer_completed(self) -> None:
        """The source finished sending the KV blocks."""
        await self._engine.publish(TransferCompleted(self.handoff_id))

    async def failed(self) -> None:
        """The engine lost the request: the coordinator cleans the handoff up."""
        await self._engine.publish(Failed(self.handoff_id))


class Engine:
    """One engine id on a `Connection` (which the caller opens and closes; several engines may
    share one). `start` subscribes, `stop` unsubscribes and cancels the receipts in flight."""

    def __init__(
        self,
        connection: Connection,
        engine_id: str,
        handlers: Handlers,
        *,
        remember: int = DEFAULT_REMEMBER,
        outcomes_path: Path | None = None,
        interference: Interference | None = None,
        lease_ttl_s: float | None = DEFAULT_LEASE_TTL_S,
    ) -> None:
        if remember < 1:
            raise ValueError(f"remember must be at least 1 handoff, got {remember}")
        self.engine_id = engine_id
        self.stats = EngineStats()
        self._connection = connection
        self._handlers = handlers
        self._remember = remember
        self._interference = interference
        self._memory: OrderedDict[HandoffId, _Memory] = OrderedDict()
        # In the order spawned (a set's is its tasks' addresses'): `stop` cancels them so, and
        # the order of their cancellations is the order of what they do next.
        self._tasks: dict[asyncio.Task[None], None] = {}
        self._watch: Watch | None = None
        self._outcomes_path = outcomes_path
        self._log: OutcomeLog | None = None
        self.lease = (
            None if lease_ttl_s is None else Lease(connection, engine_id, lease_ttl_s, self._fence)
        )

    async def start(self) -> None:
        """Load the outcome log, if there is one, take the lease and subscribe to the engine's
        actions; returns once the server registered the subscription. `OutcomeLogFailed` if
        the log cannot be opened or read, `BusUnavailable` if the lease cannot be taken."""
        if self._outcomes_path is not None:
            self._log = OutcomeLog(self._outcomes_path, self.engine_id)
            for handoff_id, action_id, outcome in self._log.load():
                self._remembered(handoff_id).outcomes[action_id] = outcome
            logger.info(
                "%s: %d handoffs' outcomes loaded from %s",
                self.engine_id,
                len(self._memory),
                self._outcomes_path,
            )
        if self.lease is not None:
            await self.lease.acquire()
            self.spawn(self.lease.run())
        self._watch = await self._connection.watch_actions(
            self.engine_id, self._on_action, self._on_malformed
        )
        await self._connection.flush()

    async def stop(self) -> None:
        """Stop listening and cancel the receipts in flight."""
        if self._watch is not None:
            watch, self._watch = self._watch, None
            with contextlib.suppress(BusUnavailable):  # closing: nothing more to receive
                await watch.close()
        tasks = list(self._tasks)
        pending = [task for task in tasks if not task.done()]
        while pending:
            # Python 3.11's wait_for (nats-py waits on every request with it) drops a
            # cancellation that coincides with what it waits for, and the lease's renewal loop
            # would then renew for ever: cancel until every task took it.
            for task in pending:
                task.cancel()
            _, still = await asyncio.wait(pending, timeout=_CANCEL_AGAIN_S)
            pending = [task for task in pending if task in still]
        await asyncio.gather(*tasks, return_exceptions=True)  # all done: their outcomes read
        if self._log is not None:
            self._log.close()
            self._log = None

    # --- Facts ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def handoff(self, handoff_id: HandoffId) -> AsyncIterator[HandoffFacts]:
        """Hold the handoff's lock (no receipt of it is handled meanwhile) and publish facts."""
        memory = self._remembered(handoff_id)
        async with memory.lock:
            yield HandoffFacts(self, handoff_id)

    async def source_held(self, handoff_id: HandoffId, timing: HandoffTransferTiming) -> None:
        """Publish `SourceHeld` (after any outcome of the handoff being published)."""
        async with self.handoff(handoff_id) as facts:
            await facts.source_held(timing)

    async def destination_reserved(self, handoff_id: HandoffId, tokens: int) -> None:
        """Publish `DestinationReserved` with the transferable prompt tokens."""
        async with self.handoff(handoff_id) as facts:
            await facts.destination_reserved(tokens)

    async def transfer_completed(self, handoff_id: HandoffId) -> None:
        """Publish `TransferCompleted`."""
        async with self.handoff(handoff_id) as facts:
            await facts.transfer_completed()

    async def failed(self, handoff_id: HandoffId) -> None:
        """Publish `Failed`: the engine lost the request."""
        async with self.handoff(handoff_id) as facts:
            await facts.failed()

    async def publish(self, message: Input) -> None:
        """Store an outcome or fact in the input stream, as many times as `Interference` says.
        Callers hold the handoff's lock; `BusUnavailable` if it could not be stored. Of a fenced
        handoff, only a refusal, a `Noop` or a `Failed` is published (see "Leases")."""
        if self._is_fenced(message.handoff_id) and not _fenced_may_say(message):
            self.stats.withheld += 1
            logger.warning(
                "handoff %s: %s is fenced: %s withheld",
                message.handoff_id,
                self.engine_id,
                _tag(message),
            )
            return
        payload = encode(message)
        copies = 1 if self._interference is None else self._interference.copies(payload)
        for _ in range(copies):
            await self._connection.send_encoded(message, payload, give_up_after_s=OUTCOME_GIVE_UP_S)

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `work` (a prefill, a transfer) as a task that `stop` cancels; a crash is logged."""
        task = asyncio.create_task(work)
        self._tasks[task] = None
        task.add_done_callback(self._finished)
        return task

    # --- Receipt --------------------------------------------------------------------------

    async def _on_action(self, action: Action) -> None:
        if isinstance(action, Complete):
            logger.warning(
                "handoff %s: %s ignored a Complete sent to an engine",
                action.handoff_id,
                self.engine_id,
            )
            return
        delay_s = 0.0
        if self._interference is not None:
            wait = self._interference.on_receipt(action)
            if wait is None:
                self.stats.ignored += 1
                return
            delay_s = wait
        # A task per receipt, so that a slow handoff never holds up the others.
        self.spawn(self._handle(action, delay_s))

    def _on_malformed(self) -> None:
        self.stats.malformed += 1

    async def _handle(self, action: Action, delay_s: float) -> None:
        handoff_id = action.handoff_id
        memory = self._remembered(handoff_id)
        async with memory.lock:
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            outcome = memory.outcomes.get(action.action_id)
            if self._is_fenced(handoff_id):
                outcome = _fenced_answer(action, self.engine_id)
            elif outcome is None:
                try:
                    outcome = await self._dispatch(action)
                except Exception:
                    logger.exception(
                        "handoff %s: %s: the handler of %s#%s raised; no outcome, the worker's "
                        "retry runs it again",
                        handoff_id,
                        self.engine_id,
                        _tag(action),
                        action.action_id,
                    )
                    return
                memory.outcomes[action.action_id] = outcome
                self.stats.executed += 1
                if self._log is not None:
                    self._record(handoff_id, action.action_id, outcome)
                logger.debug(
                    "handoff %s: %s executed %s#%s -> %s",
                    handoff_id,
                    self.engine_id,
                    _tag(action),
                    action.action_id,
                    _tag(outcome),
                )
            else:
                self.stats.repeated += 1
            try:
                await self.publish(ActionOutcome(handoff_id, action.action_id, outcome))
            except BusUnavailable as exc:
                # The worker republishes the action and gets the stored outcome again.
                logger.error("handoff %s: %s: %s", handoff_id, self.engine_id, exc)
        self._trim()  # what a receipt in hand kept from being forgotten

    async def _dispatch(self, action: Action) -> Outcome:
        handlers = self._handlers
        match action:
            case SubmitPrefill():
                return await _run(handlers.submit_prefill, action, self.engine_id)
            case StartTransfer():
                return await _run(handlers.start_transfer, action, self.engine_id)
            case ReleaseSource():
                return await _run_cleanup(handlers.release_source, action)
            case CancelSource():
                return await _run_cleanup(handlers.cancel_source, action)
            case ReserveDestination():
                return await _run(handlers.reserve_destination, action, self.engine_id)
            case ActivateDestination():
                return await _run(handlers.activate_destination, action, self.engine_id)
            case CancelDestination():
                return await _run_cleanup(handlers.cancel_destination, action)
            case Complete():
                raise AssertionError("a Complete is never dispatched")

    # --- Leases ---------------------------------------------------------------------------

    def _is_fenced(self, handoff_id: HandoffId) -> bool:
        """Whether the handoff was fenced; a first sight of it while no lease is held fences it
        (the engine may not take ownership that the tier would not know to clean)."""
        memory = self._remembered(handoff_id)
        if self.lease is not None and not self.lease.check() and not memory.fenced:
            memory.fenced = True
            self.stats.fenced += 1
            if self._handlers.fenced is not None:
                self._handlers.fenced([handoff_id])
        return memory.fenced

    def _fence(self) -> None:
        """The lease lapsed: fence every handoff remembered (`Lease` calls it once a lapse)."""
        fenced = [hid for hid, memory in self._memory.items() if not memory.fenced]
        for handoff_id in fenced:
            self._memory[handoff_id].fenced = True
        self.stats.fenced += len(fenced)
        if self._handlers.fenced is not None and fenced:
            self._handlers.fenced(fenced)

    # --- Memory ---------------------------------------------------------------------------

    def _remembered(self, handoff_id: HandoffId) -> _Memory:
        memory = self._memory.get(handoff_id)
        if memory is not None:
            self._memory.move_to_end(handoff_id)
            return memory
        memory = self._memory[handoff_id] = _Memory()
        self._trim()
        return memory

    def _trim(self) -> None:
        """Forget the handoffs used longest ago beyond `remember`, skipping any whose lock is in
        use (forgetting a lock that a receipt holds would let the next receipt of that handoff
        run beside it); each receipt trims again once it let go of its lock."""
        for _ in range(len(self._memory) - self._remember):
            oldest, kept = next(iter(self._memory.items()))
            if kept.lock.locked():
                self._memory.move_to_end(oldest)
                continue
            del self._memory[oldest]
            if self._log is not None:
                try:
                    self._log.forget(oldest)
                except OutcomeLogFailed as exc:  # the row stays: a bigger file, no harm
                    logger.warning("%s: %s", self.engine_id, exc)

    @property
    def remembered(self) -> int:
        """How many handoffs' outcomes it remembers now (`remember` once no receipt is in
        hand)."""
        return len(self._memory)

    def _record(self, handoff_id: HandoffId, action_id: int, outcome: Outcome) -> None:
        assert self._log is not None
        try:
            self._log.record(handoff_id, action_id, outcome)
        except OutcomeLogFailed as exc:
            # Remembered in memory still: only a restart of this engine would run it again.
            logger.error("handoff %s: %s: %s", handoff_id, self.engine_id, exc)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s: a task crashed", self.engine_id, exc_info=task.exception())


async def _run(
    handler: Callable[[A], Awaitable[Outcome]] | None, action: A, engine_id: str
) -> Outcome:
    if handler is None:
        return ActionFailed(f"{engine_id} does not execute {_tag(action)}")
    return await handler(action)


async def _run_cleanup(handler: Callable[[A], Awaitable[Outcome]] | None, action: A) -> Outcome:
    # Without a handler, this engine never took ownership for the handoff: nothing to clean.
    return NOOP if handler is None else await handler(action)


def _fenced_answer(action: Action, engine_id: str) -> Outcome:
    """A fenced handoff's answer: `Noop` for a cleanup (it holds nothing now, whatever it said
    before: an earlier answer that was stored stands, the coordinator drops the repeat), a
    refusal for anything that would take ownership."""
    if isinstance(action, (ReleaseSource, CancelSource, CancelDestination)):
        return NOOP
    return ActionFailed(f"{engine_id}: {LEASE_EXPIRED}, the handoff was dropped")


def _fenced_may_say(message: Input) -> bool:
    if isinstance(message, Failed):
        return True
    return isinstance(message, ActionOutcome) and isinstance(message.outcome, (Noop, ActionFailed))


def _tag(message: object) -> str:
    return str(type(message).__struct_config__.tag)  # type: ignore[attr-defined]
