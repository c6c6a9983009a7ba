"""The mock prefill (source) and decode (destination) engines, built on the engine client.

`client.Engine` keeps the contract every engine keeps (see `client/engine.py`): it decodes each
action, runs each action id once and answers a repeat with the stored outcome, handles a
handoff's receipts one at a time under the handoff's lock, and stores outcomes and facts
durably, facts after the outcomes they follow from. What this module adds is what the mock
models on top:

- Ownership. Once an engine cancelled, released or lost a handoff, it never takes ownership for
  it again. A forward action that arrives after the cleanup (the worker retrying a
  `SubmitPrefill` whose first copy was lost) fails instead of allocating blocks that nobody
  would ever free.
- Roles. An action meant for the other role (a misrouted action) fails if it would take
  ownership, and is a `Noop` if it is a cleanup: this engine truly holds nothing for the handoff
  in that role.
- Capacity, timings and faults, from `model`, `capacity` and `faults`. The receipt faults (drop,
  delay, silence) and duplicated publishes act through the client's `Interference` seam; the
  fail fault and every state change act in the handlers, which change state synchronously and
  start any follow-up work (a prefill, a transfer, a decode) as a task of the client. Follow-up
  work changes state and publishes its fact together, inside `Engine.handoff`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import logging
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from kvhandoff.client import BusUnavailable, Connection, Engine, Handlers, HandoffFacts
from kvhandoff.client.lease import DEFAULT_LEASE_TTL_S
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    Action,
    ActionFailed,
    ActivateDestination,
    CancelDestination,
    CancelSource,
    EngineType,
    Outcome,
    ReleaseSource,
    ReserveDestination,
    Role,
    StartTransfer,
    SubmitPrefill,
)
from kvhandoff.worker.engines.capacity import KvCapacity
from kvhandoff.worker.engines.faults import FailureForm, Faults
from kvhandoff.worker.engines.model import EngineModel
from kvhandoff.worker.engines.report import EngineCounters, EngineStatus, Leak

logger = logging.getLogger(__name__)


class EnginePhase(enum.StrEnum):
    """Where one handoff stands on one mock engine: its KV blocks and its slot, as the engine
    models them. Not the handoff's state (`worker.log.schema.HandoffState`, what its log says):
    a handoff the log calls succeeded ends as FINISHED on its destination and RELEASED on its
    source."""

    NEW = "new"
    QUEUED = "queued"  # waiting for KV blocks and a slot
    PREFILLING = "prefilling"
    HELD = "held"
    TRANSFERRING = "transferring"
    TRANSFERRED = "transferred"
    RESERVED = "reserved"
    DECODING = "decoding"
    RELEASED = "released"
    FINISHED = "finished"  # the decode ended
    CANCELED = "canceled"
    FAILED = "failed"


_ENDED = frozenset(
    {EnginePhase.RELEASED, EnginePhase.FINISHED, EnginePhase.CANCELED, EnginePhase.FAILED}
)
_CLEANUPS = (ReleaseSource, CancelSource, CancelDestination)


@dataclass(eq=False)
class _Handoff:
    """One engine's memory of one handoff (its outcomes are the client's)."""

    handoff_id: HandoffId
    prompt_tokens: int
    state: EnginePhase = EnginePhase.NEW
    completed: bool = False  # the engine saw the worker's `Complete`
    receipts: dict[int, int] = field(default_factory=dict)
    work: asyncio.Task[None] | None = None  # the prefill, reservation, transfer or decode


class MockEngine(abc.ABC):
    """What both roles share: ownership, roles, faults, capacity, accounting."""

    role: ClassVar[Role]

    def __init__(
        self,
        connection: Connection,
        engine_id: str,
        *,
        engine_type: EngineType,
        index: int,
        model: EngineModel,
        faults: Faults,
        remember: int,
        lease_ttl_s: float | None = DEFAULT_LEASE_TTL_S,
    ) -> None:
        self.engine_id = engine_id
        self.engine_type = engine_type
        self.model = model
        self.faults = faults
        self.silent = faults.silences(index)
        self.capacity = KvCapacity(model.kv_blocks, model.max_slots)
        self._faults = EngineCounters()  # the fault counters; the client counts the rest
        self._handoffs: dict[HandoffId, _Handoff] = {}
        self._silent_until: float | None = None
        execute = self._execute
        self.client = Engine(
            connection,
            engine_id,
            Handlers(
                submit_prefill=execute,
                start_transfer=execute,
                release_source=execute,
                cancel_source=execute,
                reserve_destination=execute,
                activate_destination=execute,
                cancel_destination=execute,
                fenced=self._fenced,
            ),
            remember=remember,
            interference=self,
            lease_ttl_s=lease_ttl_s,
        )

    @property
    def counters(self) -> EngineCounters:
        stats = self.client.stats
        return msgspec.structs.replace(
            self._faults,
            executed=stats.executed,
            repeated=stats.repeated,
            malformed=stats.malformed,
        )

    # --- Interference: the receipt faults and duplicates ----------------------------------

    def on_receipt(self, action: Action) -> float | None:
        if self._is_silent():
            self._faults.ignored += 1
            return None
        record = self._record(action.handoff_id)
        receipt = record.receipts.get(action.action_id, 0)
        record.receipts[action.action_id] = receipt + 1
        if self.faults.drops(self.engine_id, action.handoff_id, action.action_id, receipt):
            self._faults.dropped += 1
            logger.info(
                "handoff %s: %s dropped action %s (fault)",
                action.handoff_id,
                self.engine_id,
                action.action_id,
            )
            return None
        delay_s = self.faults.delay_s(self.engine_id, action.handoff_id, action.action_id, receipt)
        if delay_s > 0:
            self._faults.delayed += 1
        return delay_s

    def copies(self, payload: bytes) -> int:
        if self.faults.duplicates(self.engine_id, payload):
            self._faults.duplicated += 1
            return 2
        return 1

    # --- Execution ------------------------------------------------------------------------

    async def _execute(self, action: Action) -> Outcome:
        """Carry out a first receipt: change state synchronously, start any follow-up work."""
        record = self._record(action.handoff_id)
        if type(action).executor is not self.role:
            logger.warning(
                "handoff %s: %s (%s) got %s, an action for the %s",
                record.handoff_id,
                self.engine_id,
                self.role,
                type(action).__struct_config__.tag,
                type(action).executor,
            )
            if isinstance(action, _CLEANUPS):
                return NOOP
            return ActionFailed(f"{self.engine_id} is a {self.role} engine")
        return self._execute_own(record, action)

    def _fenced(self, handoff_ids: list[HandoffId]) -> None:
        """The lease lapsed: the tier may have answered for these handoffs, so give back what
        they hold. A decode of a handoff that completed goes on: the tier answers for open
        handoffs only."""
        for handoff_id in handoff_ids:
            record = self._handoffs.get(handoff_id)
            if record is None or (record.completed and record.state is EnginePhase.DECODING):
                continue
            logger.warning("handoff %s: %s fenced: dropped", handoff_id, self.engine_id)
            self._free(record, EnginePhase.CANCELED)

    @abc.abstractmethod
    def _execute_own(self, record: _Handoff, action: Action) -> Outcome:
        """Execute an action of this engine's role."""

    # --- Shared steps -------------------------------------------------------------------

    def _admit(self, record: _Handoff, action: Action) -> FailureForm | ActionFailed | None:
        """Checks before taking ownership: a fresh handoff, room for it, and the fail fault.

        Returns the outcome to answer instead (the engine then owns nothing, and a refused
        fresh handoff is closed), or the failure form to enact later, or None.
        """
        if record.state is not EnginePhase.NEW:
            return ActionFailed(f"{self.engine_id}: the handoff is already {record.state}")
        blocks = self.model.blocks_for(record.prompt_tokens)
        refusal: FailureForm | ActionFailed | None
        if self.capacity.fits(blocks):
            refusal = self._fault(record, action)
        else:
            refusal = ActionFailed(
                f"{self.engine_id}: {record.prompt_tokens} tokens need {blocks} KV blocks, "
                f"the engine has {self.capacity.total_blocks}"
            )
        if isinstance(refusal, ActionFailed):
            record.state = EnginePhase.FAILED
        return refusal

    def _fault(self, record: _Handoff, action: Action) -> FailureForm | ActionFailed | None:
        """The fail fault for a forward action: an outcome to answer instead, a form, or None."""
        failure = self.faults.failure(self.engine_id, record.handoff_id, action.action_id)
        if failure is not None:
            self._faults.injected_failures += 1
        if failure is FailureForm.OUTCOME:
            return ActionFailed(f"{self.engine_id}: injected failure")
        return failure

    def _request_blocks(self, record: _Handoff) -> asyncio.Future[None]:
        record.state = EnginePhase.QUEUED
        blocks = self.model.blocks_for(record.prompt_tokens)
        return self.capacity.request(record.handoff_id, blocks)

    def _free(self, record: _Handoff, ended: EnginePhase) -> Outcome:
        """Release or cancel: stop the follow-up work and give back what is held or awaited."""
        if record.work is not None:
            record.work.cancel()
            record.work = None
        had_something = self.capacity.release(record.handoff_id)
        if record.state not in _ENDED:
            record.state = ended
        return APPLIED if had_something else NOOP

    async def _lose(self, record: _Handoff, facts: HandoffFacts) -> None:
        """The injected `Failed` fact: the engine drops the request and frees its blocks."""
        self.capacity.release(record.handoff_id)
        record.state = EnginePhase.FAILED
        record.work = None
        with self._unless_unstored(record):
            await facts.failed()

    @contextlib.contextmanager
    def _unless_unstored(self, record: _Handoff) -> Iterator[None]:
        """A fact the input stream would not store is logged and given up: the handoff's
        deadline recovers it."""
        try:
            yield
        except BusUnavailable as exc:
            logger.error("handoff %s: %s: %s", record.handoff_id, self.engine_id, exc)

    def _start(self, record: _Handoff, work: Coroutine[Any, Any, None]) -> None:
        record.work = self.client.spawn(work)

    # --- Bookkeeping --------------------------------------------------------------------

    def _is_silent(self) -> bool:
        if not self.silent:
            return False
        now = asyncio.get_running_loop().time()
        if self._silent_until is None:
            self._silent_until = now + self.faults.silent_ms / 1000.0
            logger.warning(
                "%s is silent for %.0f ms (fault)", self.engine_id, self.faults.silent_ms
            )
        return now < self._silent_until

    def _record(self, handoff_id: HandoffId) -> _Handoff:
        record = self._handoffs.get(handoff_id)
        if record is None:
            record = _Handoff(handoff_id, self.model.prompt_of(handoff_id))
            self._handoffs[handoff_id] = record
        return record

    def _holds(self, record: _Handoff) -> bool:
        handoff_id = record.handoff_id
        return self.capacity.held(handoff_id) > 0 or self.capacity.is_waiting(handoff_id)

    def saw_complete(self, handoff_id: HandoffId) -> None:
        record = self._handoffs.get(handoff_id)
        if record is not None:
            record.completed = True

    def forget(self, handoff_id: HandoffId) -> None:
        """Drop a completed handoff's memory, unless it still holds something (a leak stays)."""
        record = self._handoffs.get(handoff_id)
        if record is not None and not self._holds(record):
            del self._handoffs[handoff_id]

    def leaks(self) -> list[Leak]:
        return [
            Leak(
                engine_id=self.engine_id,
                handoff_id=record.handoff_id,
                state=record.state,
                blocks=self.capacity.held(record.handoff_id),
                waiting=self.capacity.is_waiting(record.handoff_id),
            )
            for record in self._handoffs.values()
            if record.completed and record.state is not EnginePhase.DECODING and self._holds(record)
        ]

    def status(self) -> EngineStatus:
        decoding = sum(
            self.capacity.held(r.handoff_id)
            for r in self._handoffs.values()
            if r.state is EnginePhase.DECODING
        )
        return EngineStatus(
            engine_id=self.engine_id,
            engine_type=self.engine_type,
            role=self.role,
            silent=self.silent,
            blocks_total=self.capacity.total_blocks,
            blocks_held=self.capacity.used_blocks,
            blocks_decoding=decoding,
            slots_total=self.capacity.total_slots,
            slots_held=self.capacity.used_slots,
            waiting=self.capacity.waiting,
            open_handoffs=sum(r.state not in _ENDED for r in self._handoffs.values()),
            counters=self.counters,
        )

    async def start(self) -> None:
        """Subscribe to the engine's actions."""
        await self.client.start()

    def heal(self) -> None:
        """Drop its faults: from now on it answers every action, at once (the simulation's
        quiet phase, worker.sim.world)."""
        self.faults = Faults()
        self.silent = False

    async def stop(self) -> None:
        """Stop listening and cancel all in-flight work (receipts, prefills, transfers,
        decodes)."""
        await self.client.stop()


class SourceEngine(MockEngine):
    """A prefill engine: computes the KV blocks, holds them, sends them, releases them."""

    role = Role.SOURCE

    def _execute_own(self, record: _Handoff, action: Action) -> Outcome:
        match action:
            case SubmitPrefill():
                refusal = self._admit(record, action)
                if isinstance(refusal, ActionFailed):
                    return refusal
                granted = self._request_blocks(record)
                self._start(record, self._prefill(record, granted, refusal is FailureForm.FACT))
                return SUBMITTED
            case StartTransfer(delay_ms=delay_ms):
                if record.state is not EnginePhase.HELD:
                    return ActionFailed(
                        f"{self.engine_id}: no KV to send, handoff is {record.state}"
                    )
                if not 0.0 <= delay_ms < float("inf"):
                    return ActionFailed(f"{self.engine_id}: invalid transfer delay {delay_ms}")
                refusal = self._fault(record, action)
                if isinstance(refusal, ActionFailed):
                    return refusal  # still held: the cleanup's CancelSource frees the blocks
                record.state = EnginePhase.TRANSFERRING
                self._start(record, self._transfer(record, delay_ms, refusal is FailureForm.FACT))
                return SCHEDULED
            case ReleaseSource():
                return self._free(record, EnginePhase.RELEASED)
            case CancelSource():
                return self._free(record, EnginePhase.CANCELED)
            case _:
                raise AssertionError(f"not a source action: {action!r}")

    async def _prefill(self, record: _Handoff, granted: asyncio.Future[None], lose: bool) -> None:
        await granted
        record.state = EnginePhase.PREFILLING
        await asyncio.sleep(self.model.prefill_s(record.prompt_tokens))
        async with self.client.handoff(record.handoff_id) as facts:
            if lose:
                await self._lose(record, facts)
                return
            record.state = EnginePhase.HELD
            record.work = None
            with self._unless_unstored(record):
                await facts.source_held(self.model.timing(record.prompt_tokens))

    async def _transfer(self, record: _Handoff, delay_ms: float, lose: bool) -> None:
        await asyncio.sleep(self.model.transfer_s(delay_ms))
        async with self.client.handoff(record.handoff_id) as facts:
            if lose:
                await self._lose(record, facts)
                return
            record.state = EnginePhase.TRANSFERRED
            record.work = None
            with self._unless_unstored(record):
                await facts.transfer_completed()


class DestinationEngine(MockEngine):
    """A decode engine: reserves room for the KV blocks, activates the request, decodes it."""

    role = Role.DESTINATION

    def _execute_own(self, record: _Handoff, action: Action) -> Outcome:
        match action:
            case ReserveDestination():
                refusal = self._admit(record, action)
                if isinstance(refusal, ActionFailed):
                    return refusal
                granted = self._request_blocks(record)
                self._start(record, self._reserve(record, granted, refusal is FailureForm.FACT))
                return ACCEPTED
            case ActivateDestination():
                if record.state is not EnginePhase.RESERVED:
                    return ActionFailed(
                        f"{self.engine_id}: nothing reserved, handoff is {record.state}"
                    )
                refusal = self._fault(record, action)
                if isinstance(refusal, ActionFailed):
                    return refusal  # still reserved: the cleanup's CancelDestination frees it
                record.state = EnginePhase.DECODING
                self._start(record, self._decode(record, refusal is FailureForm.FACT))
                return APPLIED
            case CancelDestination():
                return self._free(record, EnginePhase.CANCELED)
            case _:
                raise AssertionError(f"not a destination action: {action!r}")

    async def _reserve(self, record: _Handoff, granted: asyncio.Future[None], lose: bool) -> None:
        await granted
        async with self.client.handoff(record.handoff_id) as facts:
            if lose:
                await self._lose(record, facts)
                return
            record.state = EnginePhase.RESERVED
            record.work = None
            tokens = self.model.transferable_tokens(record.prompt_tokens)
            with self._unless_unstored(record):
                await facts.destination_reserved(tokens)

    async def _decode(self, record: _Handoff, lose: bool) -> None:
        if lose:
            # The request dies mid-decode, after the handoff may already have completed: the
            # `Failed` fact then reopens the cleanup, whose CancelDestination finds nothing.
            await asyncio.sleep(self.model.decode_s() / 2)
            async with self.client.handoff(record.handoff_id) as facts:
                await self._lose(record, facts)
            return
        await asyncio.sleep(self.model.decode_s())
        self.capacity.release(record.handoff_id)
        record.state = EnginePhase.FINISHED
        record.work = None
