"""Mock prefill (source) and decode (destination) engines that speak only the wire vocabulary.

They play the engines of Dynamo's mocker on the bus, and they double as the reference client
for anyone writing a real engine: this module imports nothing from the worker but its NATS
client, `worker.bus.Bus`; otherwise only `events` and msgspec.

The contract an engine keeps
----------------------------
- It subscribes to `<prefix>.engine.<engine_id>.actions` and decodes every message there as an
  `Action`. A message that does not decode is logged and ignored.
- It executes each action id once. The worker republishes an action whose outcome it has not
  seen, with the same id; a repeated id is answered with the stored outcome and has no second
  effect.
- Outcomes (`ActionOutcome`) and facts (`SourceHeld`, `DestinationReserved`, `TransferCompleted`,
  `Failed`) go to the handoff's input subject with a JetStream publish, retried with backoff
  until the input stream has stored them (`Bus.publish_durable`).
- The actions of one handoff run one at a time, in arrival order, and a fact is published under
  the same per-handoff lock: an outcome always precedes the facts that follow from it, and a
  cancel never overtakes the action it cancels.
- Once an engine cancelled, released or lost a handoff, it never takes ownership for it again.
  A forward action that arrives after the cleanup (the worker retrying a `SubmitPrefill` whose
  first copy was lost) fails instead of allocating blocks that nobody would ever free.
- An action meant for the other role (a misrouted action) fails if it would take ownership, and
  is a `Noop` if it is a cleanup: this engine truly holds nothing for the handoff in that role.

The model
---------
There are no real requests. A handoff's prompt length is `prompt_tokens(handoff_id, ...)`, a pure
function of the handoff id, so the source and the destination agree on it without extra wire
fields; engine processes that serve the same handoffs need the same prompt range.

    Source (prefill) engine
    SubmitPrefill  -> Submitted; wait for KV blocks and a slot; prefill for
                      tokens / prefill_tokens_per_s; then SourceHeld(timing)
    StartTransfer  -> Scheduled; after delay_ms, TransferCompleted (the blocks stay held)
    ReleaseSource  -> Applied, freeing the blocks; Noop if nothing was held
    CancelSource   -> Applied, freeing the blocks or withdrawing the waiting request; else Noop

    Destination (decode) engine
    ReserveDestination  -> Accepted; wait for KV blocks and a slot; then DestinationReserved with
                           the prompt rounded down to whole blocks (only full blocks transfer)
    ActivateDestination -> Applied; the decode runs for decode_ms and then frees the blocks
    CancelDestination   -> Applied, freeing the blocks (ending a running decode) or withdrawing
                           the waiting reservation; else Noop

Capacity: an engine has `kv_blocks` KV blocks and `max_slots` in-flight slots. A handoff holds
ceil(prompt / block_size) blocks and one slot from the grant of its request until a release, a
cancel, an injected failure or (destination) the end of its decode. Requests are granted
strictly first come, first served. Every modelled duration (prefill, transfer, decode) is
divided by `speedup`; injected fault delays are wall-clock, since they act against the worker's
wall-clock retry interval and deadlines.

Leaks
-----
Engines subscribe to `<prefix>.done.>`. A leak is a handoff whose `Complete` the engine saw while
it still holds blocks or a slot for it, or still waits for them, other than a destination whose
decode is legitimately running after activation. Each engine process answers requests on
`<prefix>.engines.report` with one `EnginesReport` (`request_reports` is the scatter-gather
client) and returns the same report when it stops.

Faults
------
Every fault decision is a pure function of the seed and of what it concerns (engine id, handoff
id, action id, receipt number, or the message's bytes), so a seed gives the same decisions
however the messages interleave:

- fail: a forward action (`SubmitPrefill`, `StartTransfer`, `ReserveDestination`,
  `ActivateDestination`) fails, in one of two forms drawn with equal odds: its outcome is
  `ActionFailed` (the engine keeps what it already held, the cleanup frees it), or it succeeds
  and the engine later loses the request, frees its blocks and publishes `Failed` (the
  cleanup then finds nothing: `Noop`). Cleanups never fail: the protocol reads a failed cleanup
  as ambiguous ownership.
- drop: an incoming action is ignored as if it never arrived. Drawn per receipt, so the worker's
  retry of the same action id gets a fresh draw and eventually gets through.
- duplicate: an outcome or fact is published twice.
- delay: every receipt waits a uniform random 0..delay_ms before it is executed or answered.
- silent: the first `silent` engines of each engine type and role (indexes 0..silent-1) stop
  answering for `silent_ms`, counted from the first action they receive: every action in that
  window is ignored. Handoffs routed to them run into their deadline and are cleaned up, and
  when the engine recovers the worker's retries of the cleanup actions are answered (`Noop`, as
  the engine never took anything), so every handoff still completes and a demo ends cleanly.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import hashlib
import logging
import os
import socket
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
from msgspec import Struct

from events.codec import decode_action, encode
from events.ids import HandoffId
from events.messages import (
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
    Complete,
    DestinationReserved,
    EngineType,
    Failed,
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
from events.subjects import Subjects
from worker.bus import Bus, Message, Subscription
from worker.errors import BusError

logger = logging.getLogger(__name__)

# --- Engine ids -----------------------------------------------------------------------------

DEFAULT_ENGINE_TYPES: tuple[EngineType, ...] = tuple(EngineType)
DEFAULT_SOURCES = 2
DEFAULT_DESTINATIONS = 2


@dataclass(frozen=True)
class Roster:
    """The engine ids of a deployment: for each engine type, `sources` prefill engines named
    `<type>-prefill-<i>` and `destinations` decode engines named `<type>-decode-<i>`.

    The engines command and the load generator build the same roster from the same options, which
    is how the load generator knows where to route each `StartHandoff`.
    """

    engine_types: tuple[EngineType, ...] = DEFAULT_ENGINE_TYPES
    sources: int = DEFAULT_SOURCES
    destinations: int = DEFAULT_DESTINATIONS

    def __post_init__(self) -> None:
        if not self.engine_types or len(set(self.engine_types)) != len(self.engine_types):
            raise ValueError(f"engine types must be distinct and non-empty: {self.engine_types}")
        if self.sources < 1 or self.destinations < 1:
            raise ValueError("each engine type needs at least one source and one destination")

    def source_ids(self, engine_type: EngineType) -> list[str]:
        return [f"{engine_type}-prefill-{i}" for i in range(self.sources)]

    def destination_ids(self, engine_type: EngineType) -> list[str]:
        return [f"{engine_type}-decode-{i}" for i in range(self.destinations)]


# --- The model ------------------------------------------------------------------------------


def prompt_tokens(handoff_id: HandoffId, shortest: int, longest: int) -> int:
    """The prompt length the mock gives a handoff: its id folded into [shortest, longest].

    The one function both roles derive it from, so the source's `SourceHeld` and the
    destination's reservation describe the same prompt. A UUID4's low bits are random, so the
    lengths spread evenly over the range.
    """
    return shortest + handoff_id.int % (longest - shortest + 1)


@dataclass(frozen=True)
class EngineModel:
    """The capacity and the timings of every mock engine in a process."""

    block_size: int = 16
    kv_blocks: int = 8192
    max_slots: int = 64
    shortest_prompt: int = 128
    longest_prompt: int = 2048
    prefill_tokens_per_s: float = 20_000.0
    decode_ms: float = 200.0
    # Llama-3-8B in fp16: 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes.
    kv_bytes_per_token: int = 131_072
    bandwidth_gb_s: float = 25.0
    timing_mode: KvTransferTimingMode = KvTransferTimingMode.FULL_PROMPT
    speedup: float = 1.0

    def __post_init__(self) -> None:
        positive = {
            "block_size": self.block_size,
            "kv_blocks": self.kv_blocks,
            "max_slots": self.max_slots,
            "shortest_prompt": self.shortest_prompt,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "speedup": self.speedup,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.longest_prompt < self.shortest_prompt:
            raise ValueError(f"prompt range {self.shortest_prompt}:{self.longest_prompt} is empty")
        if self.decode_ms < 0 or self.kv_bytes_per_token < 0 or self.bandwidth_gb_s < 0:
            raise ValueError("decode_ms, kv_bytes_per_token and bandwidth_gb_s must be >= 0")

    def prompt_of(self, handoff_id: HandoffId) -> int:
        return prompt_tokens(handoff_id, self.shortest_prompt, self.longest_prompt)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def transferable_tokens(self, tokens: int) -> int:
        """The prompt tokens in whole blocks: a partial last block is recomputed, not moved."""
        return tokens // self.block_size * self.block_size

    def timing(self, tokens: int) -> HandoffTransferTiming:
        return HandoffTransferTiming(
            mode=self.timing_mode,
            full_prompt_tokens=tokens,
            kv_bytes_per_token=self.kv_bytes_per_token,
            bandwidth_gb_s=self.bandwidth_gb_s,
        )

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s / self.speedup

    def transfer_s(self, delay_ms: float) -> float:
        return delay_ms / 1000.0 / self.speedup

    def decode_s(self) -> float:
        return self.decode_ms / 1000.0 / self.speedup


class FailureForm(enum.StrEnum):
    OUTCOME = "outcome"  # the action is answered `ActionFailed`
    FACT = "fact"  # the action succeeds, then the engine loses the request: `Failed`


@dataclass(frozen=True)
class Faults:
    """Seeded fault injection; see the module docstring for what each fault does."""

    seed: int = 0
    fail_rate: float = 0.0
    drop_rate: float = 0.0
    duplicate_rate: float = 0.0
    delay_ms: float = 0.0
    silent: int = 0
    silent_ms: float = 10_000.0

    def __post_init__(self) -> None:
        for name in ("fail_rate", "drop_rate", "duplicate_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {rate}")
        if self.drop_rate == 1.0:
            raise ValueError("drop_rate 1 would drop every retry too: nothing could ever finish")
        if self.delay_ms < 0 or self.silent < 0 or self.silent_ms < 0:
            raise ValueError("delay_ms, silent and silent_ms must be >= 0")

    def failure(self, engine_id: str, handoff_id: HandoffId, action_id: int) -> FailureForm | None:
        if self._draw("fail", engine_id, handoff_id, action_id) >= self.fail_rate:
            return None
        if self._draw("fail-form", engine_id, handoff_id, action_id) < 0.5:
            return FailureForm.OUTCOME
        return FailureForm.FACT

    def drops(self, engine_id: str, handoff_id: HandoffId, action_id: int, receipt: int) -> bool:
        return self._draw("drop", engine_id, handoff_id, action_id, receipt) < self.drop_rate

    def duplicates(self, engine_id: str, payload: bytes) -> bool:
        return self._draw("duplicate", engine_id, payload) < self.duplicate_rate

    def delay_s(self, engine_id: str, handoff_id: HandoffId, action_id: int, receipt: int) -> float:
        draw = self._draw("delay", engine_id, handoff_id, action_id, receipt)
        return draw * self.delay_ms / 1000.0

    def silences(self, index: int) -> bool:
        return index < self.silent

    def _draw(self, *key: object) -> float:
        """A uniform number in [0, 1) determined by the seed and the key."""
        digest = hashlib.blake2b(repr((self.seed, *key)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64


# --- Reports --------------------------------------------------------------------------------


class EngineCounters(Struct):
    """What one engine did since it started."""

    executed: int = 0  # action ids executed (first receipts)
    repeated: int = 0  # repeated action ids answered with the stored outcome
    malformed: int = 0  # messages that did not decode as an action
    dropped: int = 0  # receipts dropped by fault injection
    ignored: int = 0  # receipts ignored while silent
    delayed: int = 0  # receipts delayed by fault injection
    duplicated: int = 0  # outcomes and facts published twice
    injected_failures: int = 0


class EngineStatus(Struct, frozen=True):
    engine_id: str
    engine_type: EngineType
    role: Role
    silent: bool
    blocks_total: int
    blocks_held: int
    blocks_decoding: int
    slots_total: int
    slots_held: int
    waiting: int
    open_handoffs: int
    counters: EngineCounters


class Leak(Struct, frozen=True):
    """Blocks or a slot held (or still awaited) for a handoff that the worker completed."""

    engine_id: str
    handoff_id: HandoffId
    state: str
    blocks: int
    waiting: bool


class EnginesReport(Struct, frozen=True, tag="engines_report", tag_field="type"):
    """One engine process's answer on `<prefix>.engines.report`."""

    process: str
    engines: list[EngineStatus]
    leaks: list[Leak]


_report_decoder = msgspec.json.Decoder(EnginesReport)


def settled(reports: list[EnginesReport]) -> bool:
    """True when the engines hold blocks only for decodes that are still running."""
    statuses = [status for report in reports for status in report.engines]
    return all(s.blocks_held == s.blocks_decoding and s.waiting == 0 for s in statuses)


async def request_reports(
    bus: Bus, subjects: Subjects, *, first_reply_s: float = 1.0, quiet_s: float = 0.2
) -> list[EnginesReport]:
    """Ask every engine process for its report (scatter-gather, `Bus.gather`).

    Waits up to `first_reply_s` for the first reply, then gathers replies until `quiet_s`
    passes without one. An undecodable reply is logged and skipped.
    """
    reports: list[EnginesReport] = []
    replies = await bus.gather(
        subjects.engines_report, b"", first_reply_s=first_reply_s, quiet_s=quiet_s
    )
    for reply in replies:
        try:
            reports.append(_report_decoder.decode(reply))
        except msgspec.DecodeError as exc:
            logger.warning("skipped an undecodable engines report: %s", exc)
    return reports


# --- Engines --------------------------------------------------------------------------------


class HandoffState(enum.StrEnum):
    """Where one handoff stands on one engine."""

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
    {HandoffState.RELEASED, HandoffState.FINISHED, HandoffState.CANCELED, HandoffState.FAILED}
)
_CLEANUPS = (ReleaseSource, CancelSource, CancelDestination)


class KvCapacity:
    """One engine's KV blocks and in-flight slots, granted strictly first come, first served."""

    def __init__(self, blocks: int, slots: int) -> None:
        self.total_blocks = blocks
        self.total_slots = slots
        self.used_blocks = 0
        self._held: dict[HandoffId, int] = {}
        self._waiting: OrderedDict[HandoffId, tuple[int, asyncio.Future[None]]] = OrderedDict()

    @property
    def used_slots(self) -> int:
        return len(self._held)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def fits(self, blocks: int) -> bool:
        """Whether a request of `blocks` could ever be granted."""
        return blocks <= self.total_blocks

    def held(self, handoff_id: HandoffId) -> int:
        return self._held.get(handoff_id, 0)

    def is_waiting(self, handoff_id: HandoffId) -> bool:
        return handoff_id in self._waiting

    def request(self, handoff_id: HandoffId, blocks: int) -> asyncio.Future[None]:
        """Queue a request for `blocks` blocks and a slot; the future resolves on the grant."""
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[handoff_id] = (blocks, granted)
        self._grant()
        return granted

    def release(self, handoff_id: HandoffId) -> bool:
        """Free what the handoff holds, or withdraw its request. True if there was either."""
        waiting = self._waiting.pop(handoff_id, None)
        if waiting is not None:
            waiting[1].cancel()
        blocks = self._held.pop(handoff_id, None)
        if blocks is not None:
            self.used_blocks -= blocks
            self._grant()
        return waiting is not None or blocks is not None

    def _grant(self) -> None:
        while self._waiting:
            handoff_id, (blocks, granted) = next(iter(self._waiting.items()))
            if granted.cancelled():  # its waiter was cancelled when the engine stopped
                del self._waiting[handoff_id]
                continue
            if self.used_slots >= self.total_slots or self.used_blocks + blocks > self.total_blocks:
                return
            del self._waiting[handoff_id]
            self._held[handoff_id] = blocks
            self.used_blocks += blocks
            granted.set_result(None)


@dataclass(eq=False)
class _Handoff:
    """One engine's memory of one handoff."""

    handoff_id: HandoffId
    prompt_tokens: int
    state: HandoffState = HandoffState.NEW
    completed: bool = False  # the engine saw the worker's `Complete`
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    receipts: dict[int, int] = field(default_factory=dict)
    work: asyncio.Task[None] | None = None  # the prefill, reservation, transfer or decode


# How long an engine keeps trying to store an outcome or a fact while NATS or the input stream
# does not answer, before it gives the message up.
_PUBLISH_GIVE_UP_S = 30.0


class _Inputs:
    """Where the engines of a process send their outcomes and facts: the handoff's input subject,
    over the one connection they share."""

    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus = bus
        self.subjects = subjects

    async def send(self, message: Input, payload: bytes) -> None:
        subject = self.subjects.input(message.handoff_id)
        try:
            await self.bus.publish_durable(subject, payload, give_up_after_s=_PUBLISH_GIVE_UP_S)
        except BusError as exc:
            # The worker republishes the action and gets the stored outcome again; a lost fact
            # is recovered by the handoff's deadline.
            logger.error(
                "handoff %s: could not store %s: %s",
                message.handoff_id,
                type(message).__struct_config__.tag,
                exc,
            )


class MockEngine(abc.ABC):
    """What both roles share: receipt, idempotency, ordering, faults, capacity, accounting."""

    role: ClassVar[Role]

    def __init__(
        self,
        engine_id: str,
        *,
        engine_type: EngineType,
        index: int,
        model: EngineModel,
        faults: Faults,
        inputs: _Inputs,
    ) -> None:
        self.engine_id = engine_id
        self.engine_type = engine_type
        self.model = model
        self.faults = faults
        self.silent = faults.silences(index)
        self.capacity = KvCapacity(model.kv_blocks, model.max_slots)
        self.counters = EngineCounters()
        self._inputs = inputs
        self._handoffs: dict[HandoffId, _Handoff] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._silent_until: float | None = None

    # --- Receipt ------------------------------------------------------------------------

    async def on_message(self, msg: Message) -> None:
        """The subscription handler: decode, apply receipt faults, run the action in a task."""
        try:
            action = decode_action(msg.data)
        except msgspec.DecodeError as exc:
            self.counters.malformed += 1
            logger.warning("%s ignored an undecodable action: %s", self.engine_id, exc)
            return
        if isinstance(action, Complete):
            logger.warning(
                "handoff %s: %s ignored a Complete sent to an engine",
                action.handoff_id,
                self.engine_id,
            )
            return
        if self._is_silent():
            self.counters.ignored += 1
            return
        record = self._record(action.handoff_id)
        receipt = record.receipts.get(action.action_id, 0)
        record.receipts[action.action_id] = receipt + 1
        if self.faults.drops(self.engine_id, action.handoff_id, action.action_id, receipt):
            self.counters.dropped += 1
            logger.info(
                "handoff %s: %s dropped action %s (fault)",
                action.handoff_id,
                self.engine_id,
                action.action_id,
            )
            return
        # A task per receipt, so that a slow (delayed) handoff never holds up the others.
        self._spawn(self._handle(record, action, receipt))

    async def _handle(self, record: _Handoff, action: Action, receipt: int) -> None:
        async with record.lock:
            delay_s = self.faults.delay_s(
                self.engine_id, record.handoff_id, action.action_id, receipt
            )
            if delay_s > 0:
                self.counters.delayed += 1
                await asyncio.sleep(delay_s)
            outcome = record.outcomes.get(action.action_id)
            if outcome is None:
                outcome = self._execute(record, action)
                record.outcomes[action.action_id] = outcome
                self.counters.executed += 1
                logger.debug(
                    "handoff %s: %s executed %s#%s -> %s (%s)",
                    record.handoff_id,
                    self.engine_id,
                    type(action).__struct_config__.tag,
                    action.action_id,
                    type(outcome).__struct_config__.tag,
                    record.state,
                )
            else:
                self.counters.repeated += 1
            await self._emit(ActionOutcome(record.handoff_id, action.action_id, outcome))

    def _execute(self, record: _Handoff, action: Action) -> Outcome:
        """Carry out a first receipt: change state synchronously, start any follow-up work."""
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

    @abc.abstractmethod
    def _execute_own(self, record: _Handoff, action: Action) -> Outcome:
        """Execute an action of this engine's role."""

    # --- Shared steps -------------------------------------------------------------------

    def _admit(self, record: _Handoff, action: Action) -> FailureForm | ActionFailed | None:
        """Checks before taking ownership: a fresh handoff, room for it, and the fail fault.

        Returns the outcome to answer instead (the engine then owns nothing, and a refused
        fresh handoff is closed), or the failure form to enact later, or None.
        """
        if record.state is not HandoffState.NEW:
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
            record.state = HandoffState.FAILED
        return refusal

    def _fault(self, record: _Handoff, action: Action) -> FailureForm | ActionFailed | None:
        """The fail fault for a forward action: an outcome to answer instead, a form, or None."""
        failure = self.faults.failure(self.engine_id, record.handoff_id, action.action_id)
        if failure is not None:
            self.counters.injected_failures += 1
        if failure is FailureForm.OUTCOME:
            return ActionFailed(f"{self.engine_id}: injected failure")
        return failure

    def _request_blocks(self, record: _Handoff) -> asyncio.Future[None]:
        record.state = HandoffState.QUEUED
        blocks = self.model.blocks_for(record.prompt_tokens)
        return self.capacity.request(record.handoff_id, blocks)

    def _free(self, record: _Handoff, ended: HandoffState) -> Outcome:
        """Release or cancel: stop the follow-up work and give back what is held or awaited."""
        if record.work is not None:
            record.work.cancel()
            record.work = None
        had_something = self.capacity.release(record.handoff_id)
        if record.state not in _ENDED:
            record.state = ended
        return APPLIED if had_something else NOOP

    async def _lose(self, record: _Handoff) -> None:
        """The injected `Failed` fact: the engine drops the request and frees its blocks."""
        self.capacity.release(record.handoff_id)
        record.state = HandoffState.FAILED
        record.work = None
        await self._emit(Failed(record.handoff_id))

    async def _emit(self, message: Input) -> None:
        payload = encode(message)
        await self._inputs.send(message, payload)
        if self.faults.duplicates(self.engine_id, payload):
            self.counters.duplicated += 1
            await self._inputs.send(message, payload)

    def _start(self, record: _Handoff, work: Coroutine[Any, Any, None]) -> None:
        record.work = self._spawn(work)

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

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s: a task crashed", self.engine_id, exc_info=task.exception())

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
            if record.completed
            and record.state is not HandoffState.DECODING
            and self._holds(record)
        ]

    def status(self) -> EngineStatus:
        decoding = sum(
            self.capacity.held(r.handoff_id)
            for r in self._handoffs.values()
            if r.state is HandoffState.DECODING
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
            counters=msgspec.structs.replace(self.counters),
        )

    async def stop(self) -> None:
        """Cancel all in-flight work (receipts, prefills, transfers, decodes)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
                if record.state is not HandoffState.HELD:
                    return ActionFailed(
                        f"{self.engine_id}: no KV to send, handoff is {record.state}"
                    )
                if not 0.0 <= delay_ms < float("inf"):
                    return ActionFailed(f"{self.engine_id}: invalid transfer delay {delay_ms}")
                refusal = self._fault(record, action)
                if isinstance(refusal, ActionFailed):
                    return refusal  # still held: the cleanup's CancelSource frees the blocks
                record.state = HandoffState.TRANSFERRING
                self._start(record, self._transfer(record, delay_ms, refusal is FailureForm.FACT))
                return SCHEDULED
            case ReleaseSource():
                return self._free(record, HandoffState.RELEASED)
            case CancelSource():
                return self._free(record, HandoffState.CANCELED)
            case _:
                raise AssertionError(f"not a source action: {action!r}")

    async def _prefill(self, record: _Handoff, granted: asyncio.Future[None], lose: bool) -> None:
        await granted
        record.state = HandoffState.PREFILLING
        await asyncio.sleep(self.model.prefill_s(record.prompt_tokens))
        async with record.lock:
            if lose:
                await self._lose(record)
                return
            record.state = HandoffState.HELD
            record.work = None
            await self._emit(SourceHeld(record.handoff_id, self.model.timing(record.prompt_tokens)))

    async def _transfer(self, record: _Handoff, delay_ms: float, lose: bool) -> None:
        await asyncio.sleep(self.model.transfer_s(delay_ms))
        async with record.lock:
            if lose:
                await self._lose(record)
                return
            record.state = HandoffState.TRANSFERRED
            record.work = None
            await self._emit(TransferCompleted(record.handoff_id))


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
                if record.state is not HandoffState.RESERVED:
                    return ActionFailed(
                        f"{self.engine_id}: nothing reserved, handoff is {record.state}"
                    )
                refusal = self._fault(record, action)
                if isinstance(refusal, ActionFailed):
                    return refusal  # still reserved: the cleanup's CancelDestination frees it
                record.state = HandoffState.DECODING
                self._start(record, self._decode(record, refusal is FailureForm.FACT))
                return APPLIED
            case CancelDestination():
                return self._free(record, HandoffState.CANCELED)
            case _:
                raise AssertionError(f"not a destination action: {action!r}")

    async def _reserve(self, record: _Handoff, granted: asyncio.Future[None], lose: bool) -> None:
        await granted
        async with record.lock:
            if lose:
                await self._lose(record)
                return
            record.state = HandoffState.RESERVED
            record.work = None
            tokens = self.model.transferable_tokens(record.prompt_tokens)
            await self._emit(DestinationReserved(record.handoff_id, tokens))

    async def _decode(self, record: _Handoff, lose: bool) -> None:
        if lose:
            # The request dies mid-decode, after the handoff may already have completed: the
            # `Failed` fact then reopens the cleanup, whose CancelDestination finds nothing.
            await asyncio.sleep(self.model.decode_s() / 2)
            async with record.lock:
                await self._lose(record)
            return
        await asyncio.sleep(self.model.decode_s())
        self.capacity.release(record.handoff_id)
        record.state = HandoffState.FINISHED
        record.work = None


# --- A process's engines --------------------------------------------------------------------


@dataclass(frozen=True)
class EnginesConfig:
    roster: Roster = field(default_factory=Roster)
    model: EngineModel = field(default_factory=EngineModel)
    faults: Faults = field(default_factory=Faults)
    subjects: Subjects = field(default_factory=Subjects)
    # How many completed handoffs each engine remembers (to answer repeats and to spot leaks);
    # older ones that hold nothing are forgotten, so a long run has bounded memory.
    retain_completed: int = 100_000


class MockEngines:
    """Every engine of one process, on one `Bus` (which the caller connects and closes) and one
    event loop."""

    def __init__(self, bus: Bus, config: EnginesConfig) -> None:
        self.config = config
        self.process = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._bus = bus
        inputs = _Inputs(bus, config.subjects)
        self.engines: dict[str, MockEngine] = {}
        roster = config.roster
        for engine_type in roster.engine_types:
            for kind, ids in (
                (SourceEngine, roster.source_ids(engine_type)),
                (DestinationEngine, roster.destination_ids(engine_type)),
            ):
                for index, engine_id in enumerate(ids):
                    self.engines[engine_id] = kind(
                        engine_id,
                        engine_type=engine_type,
                        index=index,
                        model=config.model,
                        faults=config.faults,
                        inputs=inputs,
                    )
        self._completed: OrderedDict[HandoffId, None] = OrderedDict()
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        """Subscribe every engine; returns once the server has registered the subscriptions."""
        subjects = self.config.subjects
        for engine in self.engines.values():
            self._subscriptions.append(
                await self._bus.subscribe(subjects.engine(engine.engine_id), engine.on_message)
            )
        self._subscriptions.append(await self._bus.subscribe(subjects.all_done, self._on_done))
        self._subscriptions.append(
            await self._bus.subscribe(subjects.engines_report, self._on_report_request)
        )
        await self._bus.flush()
        logger.info("%d mock engines listening: %s", len(self.engines), ", ".join(self.engines))

    async def stop(self) -> EnginesReport:
        """Stop listening, report, and cancel in-flight work. The report is taken first, so a
        decode cut short by the stop is not mistaken for a leak."""
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()
        report = self.report()
        for engine in self.engines.values():
            await engine.stop()
        return report

    def report(self) -> EnginesReport:
        return EnginesReport(
            process=self.process,
            engines=[engine.status() for engine in self.engines.values()],
            leaks=[leak for engine in self.engines.values() for leak in engine.leaks()],
        )

    async def _on_done(self, msg: Message) -> None:
        try:
            action = decode_action(msg.data)
        except msgspec.DecodeError as exc:
            logger.warning("ignored an undecodable message on %s: %s", msg.subject, exc)
            return
        if not isinstance(action, Complete):
            return
        handoff_id = action.handoff_id
        for engine in self.engines.values():
            engine.saw_complete(handoff_id)
        self._completed[handoff_id] = None
        self._completed.move_to_end(handoff_id)
        if len(self._completed) > self.config.retain_completed:
            oldest, _ = self._completed.popitem(last=False)
            for engine in self.engines.values():
                engine.forget(oldest)

    async def _on_report_request(self, msg: Message) -> None:
        if msg.reply:
            await self._bus.publish(msg.reply, encode(self.report()))
