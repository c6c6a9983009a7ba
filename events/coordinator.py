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

State
-----
The coordinator keeps what the reference keeps (the original Rust `HandoffCoordinatorCore`, see
`tests/core/conformance/README.md`), grouped in the same four small records, beside its handoff
id, order, mode and completion:

- `ActionJournal`: whether the handoff started, the next action id, the issued actions and
  the outcomes taken into account (cleared on completion: a reopened cleanup issues fresh ids);
- `SourceProgress`: the prefill, from `SubmitPrefill` issued to its release or cancel;
- `DestinationProgress`: the reservation, from `ReserveDestination` to activation or cancel;
- `TransferProgress`: the one `StartTransfer`, and the delay it carries.

`snapshot()` returns them, copied, in a frozen `CoordinatorState`; `events.replay` shows what each
step changed as `record.field` (`source.held`, `journal.issued`).

Invariants
----------
- Atomicity: every check happens before the first mutation, so a rejected input raises
  `InputRejected` and leaves the coordinator exactly as it was. This is what makes the event
  log safe: only accepted inputs are logged, and replaying them rebuilds the same state.
- Every entry point that is given an input checks its handoff id first: `handle` (any input)
  and `on_fact`. An input for another handoff is rejected like any other, naming this handoff,
  its state and the input, and changes nothing. `start()` and `on_action_outcome()` are the
  reference's forms, which take no handoff id; `handle` is their checked form, and the one the
  worker and replay use.
- Action ids are 0, 1, 2, ... in issue order; each action is issued at most once, and at most
  one `StartTransfer` per handoff.
- Determinism: the same inputs give the same actions and the same `snapshot()`.
- The transfer delay is computed, and validated, by the fact that completes the source/destination
  pair, before that fact is recorded: it is the only check that depends on both sides. A payload
  and its flag (`held` and `transfer_timing`, `reserved` and `transferable_prompt_tokens`) are
  written together, in one place each.

Speed
-----
`handle` runs once per logged input, on the worker's hot path, so it avoids three CPython costs,
each said where it is paid: enum members are read from module constants; handoff ids are
compared as their 128-bit ints; and inputs and actions are told apart by exact type (`_APPLY`,
the outcome checks), not by isinstance() or `match`, whose misses cost several times a hit on
msgspec Structs. The records are msgspec Structs because they are built in C. The transitions
themselves read as the reference's do; `bench/core.py` measures the whole.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from copy import copy
from typing import Any

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


# The four records are mutable: they are the coordinator's working state, changed in place on
# every input. `snapshot()` copies them, so a `CoordinatorState` never changes after the fact.
# gc=False: they hold flags, ids and frozen messages, never a reference cycle, so the collector
# need not track them; that saves 2-4% of a handoff in `bench/core.py`.


class ActionJournal(Struct, gc=False):
    """The actions issued, and the outcomes the handoff took into account."""

    started: bool = False
    next_id: int = 0
    #: Actions awaiting or holding an outcome, by action id, in issue order.
    issued: dict[int, Action] = {}
    #: The outcome taken into account for each answered action, by action id.
    outcomes: dict[int, Outcome] = {}


class SourceProgress(Struct, gc=False):
    """The prefill on the source engine, from `SubmitPrefill` to its release or cancel."""

    submit_issued: bool = False
    submitted: bool = False
    held: bool = False
    #: What `SourceHeld` reported; set with `held`.
    transfer_timing: HandoffTransferTiming | None = None
    release_issued: bool = False
    cancel_issued: bool = False
    cleanup_done: bool = False


class DestinationProgress(Struct, gc=False):
    """The reservation on the destination engine, from `ReserveDestination` to activation or
    cancel."""

    reserve_issued: bool = False
    accepted: bool = False
    reserved: bool = False
    #: What `DestinationReserved` reported; set with `reserved`.
    transferable_prompt_tokens: int | None = None
    activation_issued: bool = False
    activation_applied: bool = False
    cancel_issued: bool = False
    cleanup_done: bool = False


class TransferProgress(Struct, gc=False):
    """The one KV transfer, from `StartTransfer` to `TransferCompleted`."""

    issued: bool = False
    scheduled: bool = False
    completed: bool = False
    #: Known once the source is held and the destination reserved, whichever came last.
    delay_ms: float | None = None


class CoordinatorState(Struct, frozen=True):
    """A complete, deterministic snapshot of a coordinator: equal snapshots, equal futures.

    The four records are copies that nothing else holds.
    """

    handoff_id: HandoffId
    order: HandoffOrder
    fallback_delay_ms: float
    mode: Mode
    completion: HandoffCompletion | None
    journal: ActionJournal
    source: SourceProgress
    destination: DestinationProgress
    transfer: TransferProgress

    # Shorthands for the three questions a driver (and the property tests) asks of a snapshot
    # most: has the handoff started, is the source held, is the destination reserved.

    @property
    def started(self) -> bool:
        return self.journal.started

    @property
    def source_held(self) -> bool:
        return self.source.held

    @property
    def destination_reserved(self) -> bool:
        return self.destination.reserved


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


_FOREIGN = "input belongs to a different handoff"


class HandoffCoordinator:
    """Coordinates one handoff. Feed it inputs; it returns the actions to carry out, in order.

    Every public method either returns the newly issued actions or raises `InputRejected`
    and changes nothing.
    """

    __slots__ = (
        "_completion",
        "_destination",
        "_fallback_delay_ms",
        "_journal",
        "_mode",
        "_source",
        "_transfer",
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
        self._journal = ActionJournal()
        self._source = SourceProgress()
        self._destination = DestinationProgress()
        self._transfer = TransferProgress()

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
        return self._journal.next_id

    def outstanding(self) -> list[Action]:
        """Issued actions whose outcome the handoff still needs, in issue order.

        While cleaning up only the cancels count: an unanswered action from before the cleanup
        is superseded by its cancel, and carrying it out late (a driver retrying it) would take
        ownership that nothing would release.
        """
        outcomes = self._journal.outcomes
        pending = [a for i, a in self._journal.issued.items() if i not in outcomes]
        if self._mode is _CLEANING_UP:
            return [a for a in pending if type(a) is CancelSource or type(a) is CancelDestination]
        return pending

    def waiting_for(self) -> list[Waiting]:
        """What an open handoff is waiting for: outstanding outcomes, then expected facts."""
        waits = [Waiting(role=a.executor, action=a) for a in self.outstanding()]
        if self._mode is not _ACTIVE:
            return waits
        source, destination, transfer = self._source, self._destination, self._transfer
        if source.submitted and not source.held:
            waits.append(Waiting(role=Role.SOURCE, fact="source_held"))
        if destination.accepted and not destination.reserved:
            waits.append(Waiting(role=Role.DESTINATION, fact="destination_reserved"))
        if transfer.scheduled and not transfer.completed:
            waits.append(Waiting(role=Role.SOURCE, fact="transfer_completed"))
        return waits

    def describe(self) -> str:
        """A short human-readable state, as used in rejections: mode plus what it waits for."""
        if self._mode is _COMPLETE:
            return f"complete ({self._completion})"
        if not self._journal.started and not self._journal.issued:
            return f"{self._mode} (not started)"
        waits = [
            f"{w.action.__struct_config__.tag}#{w.action.action_id}" if w.action else str(w.fact)
            for w in self.waiting_for()
        ]
        return f"{self._mode}, awaiting {', '.join(waits) or 'nothing'}"

    def snapshot(self) -> CoordinatorState:
        journal = self._journal
        return CoordinatorState(
            handoff_id=self.handoff_id,
            order=self.order,
            fallback_delay_ms=self._fallback_delay_ms,
            mode=self._mode,
            completion=self._completion,
            journal=ActionJournal(
                started=journal.started,
                next_id=journal.next_id,
                issued=dict(journal.issued),
                # In id order, whatever order the outcomes came in: equal states, equal bytes.
                outcomes=dict(sorted(journal.outcomes.items())),
            ),
            source=copy(self._source),
            destination=copy(self._destination),
            transfer=copy(self._transfer),
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
        """Apply any input, after checking that it is for this handoff: the one entry point
        the worker and replay use."""
        # Comparing the 128-bit ints skips `UUID.__eq__`, a Python-level call, on every input.
        if message.handoff_id.int != self.handoff_id.int:
            raise self._reject(message, _FOREIGN)
        if type(message) is ActionOutcome:  # most inputs: straight to their method
            return self.on_action_outcome(message.action_id, message.outcome)
        return _APPLY[type(message)](self, message)

    def start(self) -> list[Action]:
        """Issue the first action of the handoff's order (once)."""
        journal = self._journal
        # A handoff that a terminal fact already closed must not begin: nothing would ever
        # clean up the prefill or the reservation.
        if journal.started or self._mode is not _ACTIVE:
            return []
        journal.started = True
        if self.order is _SOURCE_FIRST:
            self._source.submit_issued = True
            return [self._issue(SubmitPrefill)]
        self._destination.reserve_issued = True
        return [self._issue(ReserveDestination)]

    def on_fact(self, fact: Fact) -> list[Action]:
        """Apply a fact, after checking that it is for this handoff."""
        if fact.handoff_id.int != self.handoff_id.int:
            raise self._reject(fact, _FOREIGN)
        return _APPLY[type(fact)](self, fact)

    # One method per kind of input, found by `_APPLY`; the handoff id is checked already.

    def _on_start(self, command: StartHandoff) -> list[Action]:
        return self.start()

    def _on_source_held(self, fact: SourceHeld) -> list[Action]:
        source = self._source
        if self._mode is not _ACTIVE or source.held:
            return []
        if not source.submitted:
            raise self._premature(fact, "source held before prefill submission was acknowledged")
        timing = fact.timing
        bandwidth = timing.bandwidth_gb_s
        if bandwidth is not None and not (math.isfinite(bandwidth) and bandwidth >= 0.0):
            raise self._reject(fact, f"invalid handoff transfer bandwidth {bandwidth}")
        # The pair is complete if the destination is reserved already.
        tokens = self._destination.transferable_prompt_tokens
        if tokens is not None:
            self._transfer.delay_ms = self._checked_delay(fact, timing, tokens)
        source.held = True
        source.transfer_timing = timing
        return self._advance_active()

    def _on_destination_reserved(self, fact: DestinationReserved) -> list[Action]:
        destination = self._destination
        if self._mode is not _ACTIVE or destination.reserved:
            return []
        if not destination.accepted:
            raise self._premature(fact, "destination reserved before ownership was accepted")
        tokens = fact.transferable_prompt_tokens
        # The pair is complete if the source is held already.
        timing = self._source.transfer_timing
        if timing is not None:
            self._transfer.delay_ms = self._checked_delay(fact, timing, tokens)
        destination.reserved = True
        destination.transferable_prompt_tokens = tokens
        return self._advance_active()

    def _on_transfer_completed(self, fact: TransferCompleted) -> list[Action]:
        transfer = self._transfer
        if self._mode is not _ACTIVE or transfer.completed:
            return []
        if not transfer.scheduled:
            raise self._premature(fact, "transfer completed before it was scheduled")
        transfer.completed = True
        return self._advance_active()

    def _on_terminal(self, fact: Failed | TimedOut | Canceled) -> list[Action]:
        if self._mode is _ACTIVE:
            return self._begin_cleanup()
        if self._mode is _COMPLETE and self._completion is _SUCCESS:
            # The destination owns the request after a success; a late terminal fact means
            # it must give it up again.
            return self._begin_cleanup()
        return []

    def on_action_outcome(self, action_id: int, outcome: Outcome) -> list[Action]:
        """Apply an engine's answer to the action `action_id` of this handoff."""
        if self._mode is _COMPLETE:
            return []
        journal = self._journal
        action = journal.issued.get(action_id)
        if action is None:
            raise self._reject_outcome(action_id, outcome, f"unknown handoff action {action_id}")
        previous = journal.outcomes.get(action_id)
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
            journal.outcomes[action_id] = outcome
            return self._begin_cleanup()
        if type(outcome) not in _ALLOWED_OUTCOMES[kind]:
            raise self._reject_outcome(
                action_id, outcome, f"invalid handoff action outcome {type(outcome).__name__}"
            )
        journal.outcomes[action_id] = outcome
        # What the acknowledgement achieved. Exact-type tests rather than `match`: a class
        # pattern is an isinstance() per miss, several times dearer on Struct types, and this
        # runs on every outcome.
        if kind is SubmitPrefill:
            self._source.submitted = True
        elif kind is ReserveDestination:
            self._destination.accepted = True
        elif kind is StartTransfer:
            self._transfer.scheduled = True
        elif kind is ActivateDestination:
            self._destination.activation_applied = True
        elif kind is ReleaseSource or kind is CancelSource:
            self._source.cleanup_done = True
        elif kind is CancelDestination:
            self._destination.cleanup_done = True
        else:  # pragma: no cover - `_ALLOWED_OUTCOMES` admits no outcome for Complete
            raise AssertionError(f"no outcome is allowed for {kind.__name__}")
        if self._mode is _ACTIVE:
            return self._advance_active()
        return self._advance_cleanup()

    # --- Transitions --------------------------------------------------------------------

    def _advance_active(self) -> list[Action]:
        # The progress rule: the first step whose preconditions hold and that was not issued.
        source, destination, transfer = self._source, self._destination, self._transfer
        if self.order is _SOURCE_FIRST:
            if source.held and not destination.reserve_issued:
                destination.reserve_issued = True
                return [self._issue(ReserveDestination)]
        elif destination.reserved and not source.submit_issued:
            source.submit_issued = True
            return [self._issue(SubmitPrefill)]
        # The delay is known exactly when the source is held and the destination reserved.
        delay_ms = transfer.delay_ms
        if delay_ms is not None and not transfer.issued:
            transfer.issued = True
            journal = self._journal
            action_id = journal.next_id
            journal.next_id = action_id + 1
            action = StartTransfer(self.handoff_id, action_id, delay_ms)
            journal.issued[action_id] = action
            return [action]
        if transfer.completed and not destination.activation_issued:
            destination.activation_issued = True
            return [self._issue(ActivateDestination)]
        if destination.activation_applied and not source.release_issued:
            source.release_issued = True
            return [self._issue(ReleaseSource)]
        if source.cleanup_done:
            return [self._complete()]
        return []

    def _begin_cleanup(self) -> list[Action]:
        self._mode = _CLEANING_UP
        return self._advance_cleanup()

    def _advance_cleanup(self) -> list[Action]:
        # The cleanup rule: cancel each side that was asked to take ownership and is not
        # cleaned; complete once both are.
        source, destination = self._source, self._destination
        actions: list[Action] = []
        if source.submit_issued and not source.cancel_issued and not source.cleanup_done:
            source.cancel_issued = True
            actions.append(self._issue(CancelSource))
        if (
            destination.reserve_issued
            and not destination.cancel_issued
            and not destination.cleanup_done
        ):
            destination.cancel_issued = True
            actions.append(self._issue(CancelDestination))
        if (
            not actions
            and (not source.submit_issued or source.cleanup_done)
            and (not destination.reserve_issued or destination.cleanup_done)
        ):
            actions.append(self._complete())
        return actions

    def _complete(self) -> Action:
        completion = _CANCELED if self._mode is _CLEANING_UP else _SUCCESS
        self._completion = completion
        self._mode = _COMPLETE
        journal = self._journal
        action_id = journal.next_id
        journal.next_id = action_id + 1
        # As in the reference: once complete, outcomes are ignored, and a reopened cleanup
        # issues fresh ids.
        journal.issued = {}
        journal.outcomes = {}
        return Complete(self.handoff_id, action_id, completion)

    def _issue(self, kind: type[_PlainAction]) -> Action:
        """Issue an action that carries nothing but its ids, and await its outcome."""
        journal = self._journal
        action_id = journal.next_id
        journal.next_id = action_id + 1
        action = kind(self.handoff_id, action_id)
        journal.issued[action_id] = action
        return action

    # --- Rejections ---------------------------------------------------------------------

    def _checked_delay(self, fact: Fact, timing: HandoffTransferTiming, tokens: int) -> float:
        """The transfer delay, once `fact` completes the source/destination pair; rejects
        `fact` if that delay is not finite and >= 0."""
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


# Each kind of input and the method that applies it, looked up by exact type: inputs are final
# msgspec Structs, and on CPython 3.11 an isinstance() or class pattern that misses costs about
# six times this lookup. `handle` takes outcomes, most inputs, before it looks.
_APPLY: dict[type[Input], Callable[[HandoffCoordinator, Any], list[Action]]] = {
    StartHandoff: HandoffCoordinator._on_start,
    SourceHeld: HandoffCoordinator._on_source_held,
    DestinationReserved: HandoffCoordinator._on_destination_reserved,
    TransferCompleted: HandoffCoordinator._on_transfer_completed,
    Failed: HandoffCoordinator._on_terminal,
    TimedOut: HandoffCoordinator._on_terminal,
    Canceled: HandoffCoordinator._on_terminal,
}
