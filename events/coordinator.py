"""The handoff coordinator: a pure state machine for one prefill-to-decode KV ownership handoff.

Theory of operation
-------------------
A handoff moves a request's KV cache from a *source* (prefill) engine to a *destination*
(decode) engine. The coordinator owns only the ordering: it issues actions, engines carry them
out and answer with an outcome quoting the action's id, and asynchronous facts report what
happened on the engines. It does no IO, reads no clock and makes no ids: time, deadlines
(`TimedOut`) and engine failures (`Failed`, `ActionFailed`) all arrive as inputs.

The two orders (fixed by the engine type):

    source first (vLLM, TRT-LLM)           destination first (SGLang)
    SubmitPrefill      -> Submitted        ReserveDestination  -> Accepted
    SourceHeld                             DestinationReserved
    ReserveDestination -> Accepted         SubmitPrefill       -> Submitted
    DestinationReserved                    SourceHeld
                 StartTransfer -> Scheduled, TransferCompleted
                 ActivateDestination -> Applied
                 ReleaseSource -> Applied | Noop
                 Complete(success)

Progress rule: while *active*, after every accepted input the coordinator issues the first
step of that list whose preconditions hold and which it has not issued yet. A fact that comes
before its precondition (held before the prefill was acknowledged, reserved before the
destination accepted, transferred before the transfer was scheduled) is rejected. Repeated facts
and repeated identical outcomes are no-ops, so every accepted input is idempotent.

Cleanup rule: a terminal fact (`Failed`, `TimedOut`, `Canceled`) or a failed outcome moves an
active handoff to *cleaning up*: every side that was asked to take ownership (its first action
was issued) and has not been cleaned gets a cancel (`CancelSource`, `CancelDestination`), and
once every such side acknowledged its cleanup the handoff completes as `canceled`. A cleanup
action may not fail: ownership would be ambiguous (neither the coordinator nor the engine can
tell who holds the blocks), so that outcome is rejected rather than recorded.

A terminal fact after a *successful* completion reopens cleanup: the destination still owns the
request, so `CancelDestination` is issued and the handoff completes again as `canceled`.

Invariants
----------
- Atomicity: every check happens before the first mutation, so a rejected input raises
  `InputRejected` and leaves the coordinator exactly as it was. This is what makes the event
  log safe: only accepted inputs are logged, and replaying them rebuilds the same state.
- Action ids are 0, 1, 2, ... in issue order; each action is issued at most once, and at most
  one `StartTransfer` per handoff.
- Determinism: the same inputs give the same actions and the same `snapshot()`.
- The transfer delay is computed, and validated, by the fact that completes the source/destination
  pair, before that fact is recorded: it is the only check that depends on both sides.
"""

from __future__ import annotations

import enum
import math
from typing import assert_never

from msgspec import Struct

from kvhandoff.events.errors import InputRejected
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import (
    Accepted,
    Action,
    ActionFailed,
    ActionOutcome,
    ActivateDestination,
    Applied,
    CancelDestination,
    Canceled,
    CancelSource,
    Complete,
    DestinationReserved,
    Fact,
    Failed,
    HandoffCompletion,
    HandoffOrder,
    HandoffTransferTiming,
    Input,
    KvTransferTimingMode,
    Noop,
    Outcome,
    ReleaseSource,
    ReserveDestination,
    Role,
    Scheduled,
    SourceHeld,
    StartHandoff,
    StartTransfer,
    SubmitPrefill,
    Submitted,
    TimedOut,
    TransferCompleted,
)


class Mode(enum.StrEnum):
    ACTIVE = "active"
    CLEANING_UP = "cleaning_up"
    COMPLETE = "complete"


# Enum members as module constants for the hot path: on CPython 3.11 reading a member off its
# class (`Mode.ACTIVE`) costs ~0.1 us, several times a global lookup, and every input does a few.
_ACTIVE = Mode.ACTIVE
_CLEANING_UP = Mode.CLEANING_UP
_COMPLETE = Mode.COMPLETE
_SOURCE_FIRST = HandoffOrder.SOURCE_FIRST
_SUCCESS = HandoffCompletion.SUCCESS
_CANCELED = HandoffCompletion.CANCELED


# The actions that carry only their handoff and action ids.
_PlainAction = (
    SubmitPrefill
    | ReserveDestination
    | ActivateDestination
    | ReleaseSource
    | CancelSource
    | CancelDestination
)

# What an engine may answer to each action, other than `ActionFailed`.
_ALLOWED_OUTCOMES: dict[type[Action], tuple[type[Outcome], ...]] = {
    SubmitPrefill: (Submitted,),
    ReserveDestination: (Accepted,),
    StartTransfer: (Scheduled,),
    ActivateDestination: (Applied,),
    ReleaseSource: (Applied, Noop),
    CancelSource: (Applied, Noop),
    CancelDestination: (Applied, Noop),
    Complete: (),
}


class Waiting(Struct, frozen=True):
    """One thing an open handoff waits for: a fact, or the outcome of an issued action."""

    role: Role
    fact: str | None = None
    action: Action | None = None


class CoordinatorState(Struct, frozen=True):
    """A complete, deterministic snapshot of a coordinator: equal snapshots, equal futures."""

    handoff_id: HandoffId
    order: HandoffOrder
    fallback_delay_ms: float
    mode: Mode
    completion: HandoffCompletion | None
    started: bool
    next_action_id: int
    issued: tuple[Action, ...]
    outcomes: tuple[tuple[int, Outcome], ...]
    source_submit_issued: bool
    source_submitted: bool
    source_held: bool
    source_timing: HandoffTransferTiming | None
    source_release_issued: bool
    source_cancel_issued: bool
    source_cleanup_done: bool
    destination_reserve_issued: bool
    destination_accepted: bool
    destination_reserved: bool
    destination_tokens: int | None
    destination_activation_issued: bool
    destination_activation_applied: bool
    destination_cancel_issued: bool
    destination_cleanup_done: bool
    transfer_delay_ms: float | None
    transfer_issued: bool
    transfer_scheduled: bool
    transfer_completed: bool


def transfer_delay_ms(
    timing: HandoffTransferTiming, destination_tokens: int, fallback_ms: float
) -> float:
    """The modelled KV transfer time, or `fallback_ms` when there is no bandwidth model.

    Evaluated in exactly the reference's order of IEEE double operations, so that replays and
    other implementations agree to the last bit.
    """
    if timing.mode is KvTransferTimingMode.FULL_PROMPT:
        tokens = timing.full_prompt_tokens
    else:
        tokens = destination_tokens
    bytes_per_token = timing.kv_bytes_per_token
    bandwidth = timing.bandwidth_gb_s
    if bytes_per_token is None or bandwidth is None or bandwidth == 0.0:
        return fallback_ms
    return float(tokens) * float(bytes_per_token) / (bandwidth * 1e9) * 1000.0


class HandoffCoordinator:
    """Coordinates one handoff. Feed it inputs; it returns the actions to carry out, in order.

    Every public method either returns the newly issued actions or raises `InputRejected`
    and changes nothing.
    """

    __slots__ = (
        "_completion",
        "_destination_accepted",
        "_destination_activation_applied",
        "_destination_activation_issued",
        "_destination_cancel_issued",
        "_destination_cleanup_done",
        "_destination_reserve_issued",
        "_destination_reserved",
        "_destination_tokens",
        "_fallback_delay_ms",
        "_issued",
        "_mode",
        "_next_action_id",
        "_order",
        "_outcomes",
        "_source_cancel_issued",
        "_source_cleanup_done",
        "_source_held",
        "_source_release_issued",
        "_source_submit_issued",
        "_source_submitted",
        "_source_timing",
        "_started",
        "_transfer_completed",
        "_transfer_delay_ms",
        "_transfer_issued",
        "_transfer_scheduled",
        "handoff_id",
        "order",
    )

    def __init__(
        self, handoff_id: HandoffId, order: HandoffOrder, fallback_delay_ms: float = 0.0
    ) -> None:
        if not (math.isfinite(fallback_delay_ms) and fallback_delay_ms >= 0.0):
            raise ValueError(f"fallback delay must be finite and >= 0, got {fallback_delay_ms}")
        self.handoff_id = handoff_id
        self.order = order
        self._fallback_delay_ms = fallback_delay_ms
        self._mode = _ACTIVE
        self._completion: HandoffCompletion | None = None
        self._started = False
        self._next_action_id = 0
        # Actions awaiting or holding an outcome. Cleared on completion, as in the reference:
        # once complete, outcomes are ignored, and a reopened cleanup issues fresh ids.
        self._issued: dict[int, Action] = {}
        self._outcomes: dict[int, Outcome] = {}
        self._source_submit_issued = False
        self._source_submitted = False
        self._source_held = False
        self._source_timing: HandoffTransferTiming | None = None
        self._source_release_issued = False
        self._source_cancel_issued = False
        self._source_cleanup_done = False
        self._destination_reserve_issued = False
        self._destination_accepted = False
        self._destination_reserved = False
        self._destination_tokens: int | None = None
        self._destination_activation_issued = False
        self._destination_activation_applied = False
        self._destination_cancel_issued = False
        self._destination_cleanup_done = False
        self._transfer_delay_ms: float | None = None
        self._transfer_issued = False
        self._transfer_scheduled = False
        self._transfer_completed = False

    @classmethod
    def for_start(cls, command: StartHandoff) -> HandoffCoordinator:
        """The coordinator that a `StartHandoff` command opens (not yet started)."""
        return cls(command.handoff_id, command.engine_type.order, command.fallback_delay_ms)

    # --- Queries ------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def is_complete(self) -> bool:
        return self._mode is _COMPLETE

    @property
    def completion(self) -> HandoffCompletion | None:
        return self._completion

    @property
    def next_action_id(self) -> int:
        return self._next_action_id

    def outstanding(self) -> list[Action]:
        """Issued actions whose outcome the handoff still needs, in issue order.

        While cleaning up only the cancels count: an unanswered action from before the cleanup
        is superseded by its cancel, and carrying it out late (a driver retrying it) would take
        ownership that nothing would release.
        """
        outcomes = self._outcomes
        pending = [a for i, a in self._issued.items() if i not in outcomes]
        if self._mode is _CLEANING_UP:
            return [a for a in pending if type(a) is CancelSource or type(a) is CancelDestination]
        return pending

    def waiting_for(self) -> list[Waiting]:
        """What an open handoff is waiting for: outstanding outcomes, then expected facts."""
        waits = [Waiting(role=a.executor, action=a) for a in self.outstanding()]
        if self._mode is not _ACTIVE:
            return waits
        if self._source_submitted and not self._source_held:
            waits.append(Waiting(role=Role.SOURCE, fact="source_held"))
        if self._destination_accepted and not self._destination_reserved:
            waits.append(Waiting(role=Role.DESTINATION, fact="destination_reserved"))
        if self._transfer_scheduled and not self._transfer_completed:
            waits.append(Waiting(role=Role.SOURCE, fact="transfer_completed"))
        return waits

    def describe(self) -> str:
        """A short human-readable state, as used in rejections: mode plus what it waits for."""
        if self._mode is _COMPLETE:
            return f"complete ({self._completion})"
        if not self._started and not self._issued:
            return f"{self._mode} (not started)"
        waits = [
            f"{w.action.__struct_config__.tag}#{w.action.action_id}" if w.action else str(w.fact)
            for w in self.waiting_for()
        ]
        return f"{self._mode}, awaiting {', '.join(waits) or 'nothing'}"

    def snapshot(self) -> CoordinatorState:
        return CoordinatorState(
            handoff_id=self.handoff_id,
            order=self.order,
            fallback_delay_ms=self._fallback_delay_ms,
            mode=self._mode,
            completion=self._completion,
            started=self._started,
            next_action_id=self._next_action_id,
            issued=tuple(self._issued[i] for i in sorted(self._issued)),
            outcomes=tuple((i, self._outcomes[i]) for i in sorted(self._outcomes)),
            source_submit_issued=self._source_submit_issued,
            source_submitted=self._source_submitted,
            source_held=self._source_held,
            source_timing=self._source_timing,
            source_release_issued=self._source_release_issued,
            source_cancel_issued=self._source_cancel_issued,
            source_cleanup_done=self._source_cleanup_done,
            destination_reserve_issued=self._destination_reserve_issued,
            destination_accepted=self._destination_accepted,
            destination_reserved=self._destination_reserved,
            destination_tokens=self._destination_tokens,
            destination_activation_issued=self._destination_activation_issued,
            destination_activation_applied=self._destination_activation_applied,
            destination_cancel_issued=self._destination_cancel_issued,
            destination_cleanup_done=self._destination_cleanup_done,
            transfer_delay_ms=self._transfer_delay_ms,
            transfer_issued=self._transfer_issued,
            transfer_scheduled=self._transfer_scheduled,
            transfer_completed=self._transfer_completed,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HandoffCoordinator):
            return NotImplemented
        return self.snapshot() == other.snapshot()

    __hash__ = None  # type: ignore[assignment]  # mutable: equal now, maybe not later

    def __repr__(self) -> str:
        return f"HandoffCoordinator({self.handoff_id}, {self.order}, {self.describe()})"

    # --- Inputs -------------------------------------------------------------------------

    def handle(self, message: Input) -> list[Action]:
        """Apply any input: the one entry point the worker and replay use."""
        # Comparing the 128-bit ints skips `UUID.__eq__`, a Python-level call, on every input.
        if message.handoff_id.int != self.handoff_id.int:
            raise self._reject(message, "input belongs to a different handoff")
        # isinstance() rather than `match`: outcomes are most inputs, and a class pattern with
        # keyword sub-patterns costs several times an exact-type isinstance() hit.
        if isinstance(message, ActionOutcome):
            return self.on_action_outcome(message.action_id, message.outcome)
        if isinstance(message, StartHandoff):
            return self.start()
        return self._on_fact(message)

    def start(self) -> list[Action]:
        """Issue the first action of the handoff's order (once)."""
        # A handoff that a terminal fact already closed must not begin: nothing would ever
        # clean up the prefill or the reservation.
        if self._started or self._mode is not _ACTIVE:
            return []
        self._started = True
        if self.order is _SOURCE_FIRST:
            return [self._issue_submit_prefill()]
        return [self._issue_reserve_destination()]

    def on_fact(self, fact: Fact) -> list[Action]:
        if fact.handoff_id.int != self.handoff_id.int:
            raise self._reject(fact, "fact belongs to a different handoff")
        return self._on_fact(fact)

    def _on_fact(self, fact: Fact) -> list[Action]:
        # The handoff id is already checked.
        if self._mode is not _ACTIVE:
            if (
                self._completion is _SUCCESS
                and self._mode is _COMPLETE
                and isinstance(fact, Failed | TimedOut | Canceled)
            ):
                # The destination owns the request after a success; a late terminal fact
                # means it must give it up again.
                return self._begin_cleanup()
            return []
        match fact:
            case SourceHeld(timing=timing):
                if self._source_held:
                    return []
                if not self._source_submitted:
                    raise self._premature(
                        fact, "source held before prefill submission was acknowledged"
                    )
                bandwidth = timing.bandwidth_gb_s
                if bandwidth is not None and not (math.isfinite(bandwidth) and bandwidth >= 0.0):
                    raise self._reject(fact, f"invalid handoff transfer bandwidth {bandwidth}")
                if self._destination_reserved:
                    assert self._destination_tokens is not None
                    self._transfer_delay_ms = self._checked_delay(
                        fact, timing, self._destination_tokens
                    )
                self._source_held = True
                self._source_timing = timing
                return self._advance_active()
            case DestinationReserved(transferable_prompt_tokens=tokens):
                if self._destination_reserved:
                    return []
                if not self._destination_accepted:
                    raise self._premature(
                        fact, "destination reserved before ownership was accepted"
                    )
                if self._source_held:
                    assert self._source_timing is not None
                    self._transfer_delay_ms = self._checked_delay(fact, self._source_timing, tokens)
                self._destination_reserved = True
                self._destination_tokens = tokens
                return self._advance_active()
            case TransferCompleted():
                if self._transfer_completed:
                    return []
                if not self._transfer_scheduled:
                    raise self._premature(fact, "transfer completed before it was scheduled")
                self._transfer_completed = True
                return self._advance_active()
            case Failed() | TimedOut() | Canceled():
                return self._begin_cleanup()
            case _:
                assert_never(fact)

    def on_action_outcome(self, action_id: int, outcome: Outcome) -> list[Action]:
        if self._mode is _COMPLETE:
            return []
        action = self._issued.get(action_id)
        if action is None:
            raise self._reject_outcome(action_id, outcome, f"unknown handoff action {action_id}")
        previous = self._outcomes.get(action_id)
        if previous is not None:
            if previous != outcome:
                raise self._reject_outcome(
                    action_id, outcome, f"conflicting outcome for handoff action {action_id}"
                )
            return []
        kind = type(action)
        if type(outcome) is ActionFailed:
            if kind is CancelSource or kind is CancelDestination:
                raise self._reject_outcome(
                    action_id, outcome, f"handoff cleanup action {action_id} failed"
                )
            self._outcomes[action_id] = outcome
            return self._begin_cleanup()
        if type(outcome) not in _ALLOWED_OUTCOMES[kind]:
            raise self._reject_outcome(
                action_id, outcome, f"invalid handoff action outcome {type(outcome).__name__}"
            )
        self._outcomes[action_id] = outcome
        # What the acknowledgement achieved. Exact-type tests rather than `match`: a class
        # pattern is an isinstance() per miss, several times dearer on Struct types, and this
        # runs on every outcome.
        if kind is SubmitPrefill:
            self._source_submitted = True
        elif kind is ReserveDestination:
            self._destination_accepted = True
        elif kind is StartTransfer:
            self._transfer_scheduled = True
        elif kind is ActivateDestination:
            self._destination_activation_applied = True
        elif kind is ReleaseSource or kind is CancelSource:
            self._source_cleanup_done = True
        elif kind is CancelDestination:
            self._destination_cleanup_done = True
        else:  # pragma: no cover - `_ALLOWED_OUTCOMES` admits no outcome for Complete
            raise AssertionError(f"no outcome is allowed for {kind.__name__}")
        if self._mode is _ACTIVE:
            return self._advance_active()
        return self._advance_cleanup()

    # --- Transitions --------------------------------------------------------------------

    def _advance_active(self) -> list[Action]:
        # The progress rule: the first step whose preconditions hold and that was not issued.
        source_held = self._source_held
        destination_reserved = self._destination_reserved
        if self.order is _SOURCE_FIRST:
            if source_held and not self._destination_reserve_issued:
                return [self._issue_reserve_destination()]
        elif destination_reserved and not self._source_submit_issued:
            return [self._issue_submit_prefill()]
        if source_held and destination_reserved and not self._transfer_issued:
            self._transfer_issued = True
            delay_ms = self._transfer_delay_ms
            assert delay_ms is not None
            action_id = self._take_id()
            action = StartTransfer(self.handoff_id, action_id, delay_ms)
            self._issued[action_id] = action
            return [action]
        if self._transfer_completed and not self._destination_activation_issued:
            self._destination_activation_issued = True
            return [self._issue(ActivateDestination)]
        if self._destination_activation_applied and not self._source_release_issued:
            self._source_release_issued = True
            return [self._issue(ReleaseSource)]
        if self._source_cleanup_done:
            return [self._complete()]
        return []

    def _begin_cleanup(self) -> list[Action]:
        self._mode = _CLEANING_UP
        return self._advance_cleanup()

    def _advance_cleanup(self) -> list[Action]:
        actions: list[Action] = []
        if (
            self._source_submit_issued
            and not self._source_cancel_issued
            and not self._source_cleanup_done
        ):
            self._source_cancel_issued = True
            actions.append(self._issue(CancelSource))
        if (
            self._destination_reserve_issued
            and not self._destination_cancel_issued
            and not self._destination_cleanup_done
        ):
            self._destination_cancel_issued = True
            actions.append(self._issue(CancelDestination))
        if (
            not actions
            and (not self._source_submit_issued or self._source_cleanup_done)
            and (not self._destination_reserve_issued or self._destination_cleanup_done)
        ):
            actions.append(self._complete())
        return actions

    def _issue_submit_prefill(self) -> Action:
        self._source_submit_issued = True
        return self._issue(SubmitPrefill)

    def _issue_reserve_destination(self) -> Action:
        self._destination_reserve_issued = True
        return self._issue(ReserveDestination)

    def _complete(self) -> Action:
        completion = _CANCELED if self._mode is _CLEANING_UP else _SUCCESS
        self._completion = completion
        self._mode = _COMPLETE
        self._issued = {}
        self._outcomes = {}
        return Complete(self.handoff_id, self._take_id(), completion)

    def _take_id(self) -> int:
        action_id = self._next_action_id
        self._next_action_id = action_id + 1
        return action_id

    def _issue(self, kind: type[_PlainAction]) -> Action:
        """Issue an action that carries nothing but its ids, and await its outcome."""
        action_id = self._next_action_id
        self._next_action_id = action_id + 1
        action = kind(self.handoff_id, action_id)
        self._issued[action_id] = action
        return action

    # --- Rejections ---------------------------------------------------------------------

    def _checked_delay(self, fact: Fact, timing: HandoffTransferTiming, tokens: int) -> float:
        delay = transfer_delay_ms(timing, tokens, self._fallback_delay_ms)
        if not (math.isfinite(delay) and delay >= 0.0):
            raise self._reject(fact, f"invalid handoff transfer delay {delay}")
        return delay

    def _reject(self, message: Input, reason: str) -> InputRejected:
        return InputRejected(self.handoff_id, self.describe(), repr(message), reason)

    def _premature(self, fact: Fact, reason: str) -> InputRejected:
        # The fact's precondition is an input that may still be on its way: a bus that
        # redelivers can reorder, so the driver may offer this fact again later.
        return InputRejected(self.handoff_id, self.describe(), repr(fact), reason, premature=True)

    def _reject_outcome(self, action_id: int, outcome: Outcome, reason: str) -> InputRejected:
        return InputRejected(
            self.handoff_id, self.describe(), f"outcome {outcome!r} for action {action_id}", reason
        )
