"""The coordinator's invariants, property-based (a Hypothesis state machine) and table-driven.

The state machine drives one coordinator with arbitrary inputs in arbitrary order, through
`handle` or the direct methods, and checks after every input:

(a) at every `Complete`, each side that was asked to take ownership was cleaned up and the
    cleanup acknowledged (success: `ActivateDestination` and `ReleaseSource`; canceled:
    `CancelDestination`, and `ReleaseSource` or `CancelSource`), and after a completion only
    the reopened cleanup (`CancelDestination`, `Complete(canceled)`) may follow;
(b) at most one `StartTransfer`; (c) action ids 0, 1, 2, ... in issue order;
(d) a rejected input leaves `snapshot()` unchanged, and its error names the handoff, the state
    and the input; (e) a second coordinator fed the accepted inputs through `handle` issues the
    same actions and compares equal, as does a replay of the whole log at the end;
(f) an accepted input applied again at once returns [] and changes nothing;
(g) the `StartTransfer` delay is finite, >= 0, and the formula of the accepted facts in
    `docs/handoff.md`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from uuid import UUID

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvhandoff.events.coordinator import CoordinatorState, HandoffCoordinator, Mode, Waiting
from kvhandoff.events.errors import InputRejected
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
    Applied,
    CancelDestination,
    Canceled,
    CancelSource,
    Complete,
    DestinationReserved,
    EngineType,
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
    SourceHeld,
    StartHandoff,
    StartTransfer,
    SubmitPrefill,
    TimedOut,
    TransferCompleted,
)

OTHER = UUID("00000000-0000-0000-0000-00000000dead")
SOURCE_FIRST = HandoffOrder.SOURCE_FIRST
DESTINATION_FIRST = HandoffOrder.DESTINATION_FIRST
SUCCESS = HandoffCompletion.SUCCESS
CANCELED = HandoffCompletion.CANCELED
TERMINAL_FACTS: list[type[Failed | TimedOut | Canceled]] = [Failed, TimedOut, Canceled]

# The answer an engine gives when an action worked.
SUCCESS_OUTCOME: dict[type[Action], Outcome] = {
    SubmitPrefill: SUBMITTED,
    ReserveDestination: ACCEPTED,
    StartTransfer: SCHEDULED,
    ActivateDestination: APPLIED,
    ReleaseSource: APPLIED,
    CancelSource: APPLIED,
    CancelDestination: NOOP,
}

# --- strategies -----------------------------------------------------------------------------

bandwidths = st.one_of(
    st.none(),
    st.sampled_from([0.0, -0.0, -1.0, math.nan, math.inf, -math.inf, 5e-324, 1e-300, 1e308]),
    st.floats(min_value=0.01, max_value=1000.0),
    st.floats(allow_nan=True, allow_infinity=True),
)
token_counts = st.one_of(st.integers(0, 8192), st.integers(0, 2**60), st.just(2**60))
byte_counts = st.one_of(st.none(), st.integers(0, 1 << 20), st.integers(0, 2**60))
timings = st.builds(
    HandoffTransferTiming,
    mode=st.sampled_from(KvTransferTimingMode),
    full_prompt_tokens=token_counts,
    kv_bytes_per_token=byte_counts,
    bandwidth_gb_s=bandwidths,
)
outcomes = st.one_of(
    st.sampled_from([SUBMITTED, ACCEPTED, SCHEDULED, APPLIED, NOOP]),
    st.builds(ActionFailed, st.sampled_from(["", "engine lost the request", "oom"])),
)
fallback_delays = st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1e6))
# Mostly our own handoff; sometimes a fact or outcome addressed to another one.
whose = st.sampled_from(["own", "own", "own", "other"])


def model_delay_ms(
    timing: HandoffTransferTiming, destination_tokens: int, fallback: float
) -> float:
    """The transfer delay as `tests/core/conformance/README.md` specifies it."""
    if timing.mode is KvTransferTimingMode.FULL_PROMPT:
        tokens = timing.full_prompt_tokens
    else:
        tokens = destination_tokens
    bandwidth = timing.bandwidth_gb_s
    if timing.kv_bytes_per_token is None or bandwidth is None or bandwidth == 0.0:
        return fallback
    return float(tokens) * float(timing.kv_bytes_per_token) / (bandwidth * 1e9) * 1000.0


def start_command(handoff_id: UUID, order: HandoffOrder) -> StartHandoff:
    engine = EngineType.VLLM if order is SOURCE_FIRST else EngineType.SGLANG
    return StartHandoff(handoff_id, engine, "prefill-0", "decode-0", deadline_ms=30_000)


def call(coordinator: HandoffCoordinator, message: Input, via_handle: bool) -> list[Action]:
    """Apply `message` through `handle`, or through the method that handles its kind."""
    if via_handle:
        return coordinator.handle(message)
    if isinstance(message, StartHandoff):
        return coordinator.start()
    if isinstance(message, ActionOutcome):
        return coordinator.on_action_outcome(message.action_id, message.outcome)
    return coordinator.on_fact(message)


# --- the state machine ----------------------------------------------------------------------


# A shared 2-core machine is noisy: no per-example deadline, and slow generation is no error.
@settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
class CoordinatorMachine(RuleBasedStateMachine):
    coordinator: HandoffCoordinator
    shadow: HandoffCoordinator
    handoff_id: UUID
    order: HandoffOrder
    fallback: float

    def __init__(self) -> None:
        super().__init__()
        self.log: list[Input] = []  # every accepted input, as the worker would log it
        self.history: list[Action] = []  # every issued action, across all batches
        self.acks: dict[int, Outcome] = {}  # outcomes the coordinator took into account
        self.held: HandoffTransferTiming | None = None  # the SourceHeld that was accepted
        self.reserved: int | None = None  # the DestinationReserved tokens that were accepted

    @initialize(
        handoff_id=st.uuids(), order=st.sampled_from(HandoffOrder), fallback=fallback_delays
    )
    def open(self, handoff_id: UUID, order: HandoffOrder, fallback: float) -> None:
        self.handoff_id, self.order, self.fallback = handoff_id, order, fallback
        self.coordinator = HandoffCoordinator(handoff_id, order, fallback)
        self.shadow = HandoffCoordinator(handoff_id, order, fallback)

    # --- rules --------------------------------------------------------------------------

    @rule(via_handle=st.booleans())
    def start(self, via_handle: bool) -> None:
        self.send(start_command(self.handoff_id, self.order), via_handle)

    @rule(who=whose, timing=timings, via_handle=st.booleans())
    def source_held(self, who: str, timing: HandoffTransferTiming, via_handle: bool) -> None:
        self.send(SourceHeld(self.id_of(who), timing), via_handle)

    @rule(who=whose, tokens=token_counts, via_handle=st.booleans())
    def destination_reserved(self, who: str, tokens: int, via_handle: bool) -> None:
        self.send(DestinationReserved(self.id_of(who), tokens), via_handle)

    @rule(who=whose, via_handle=st.booleans())
    def transfer_completed(self, who: str, via_handle: bool) -> None:
        self.send(TransferCompleted(self.id_of(who)), via_handle)

    @rule(who=whose, kind=st.sampled_from(TERMINAL_FACTS), via_handle=st.booleans())
    def terminal_fact(
        self, who: str, kind: type[Failed | TimedOut | Canceled], via_handle: bool
    ) -> None:
        self.send(kind(self.id_of(who)), via_handle)

    @rule(data=st.data(), outcome=outcomes, via_handle=st.booleans())
    def outcome_for_an_issued_action(
        self, data: st.DataObject, outcome: Outcome, via_handle: bool
    ) -> None:
        if self.history:
            action = data.draw(st.sampled_from(self.history))
            self.send(ActionOutcome(self.handoff_id, action.action_id, outcome), via_handle)

    @rule(data=st.data(), via_handle=st.booleans())
    def success_for_an_issued_action(self, data: st.DataObject, via_handle: bool) -> None:
        issued = [a for a in self.history if type(a) in SUCCESS_OUTCOME]
        if issued:
            action = data.draw(st.sampled_from(issued))
            outcome = SUCCESS_OUTCOME[type(action)]
            self.send(ActionOutcome(self.handoff_id, action.action_id, outcome), via_handle)

    @rule(
        ahead=st.one_of(st.integers(0, 3), st.just(2**63)),
        who=whose,
        outcome=outcomes,
        via_handle=st.booleans(),
    )
    def outcome_for_an_unknown_action(
        self, ahead: int, who: str, outcome: Outcome, via_handle: bool
    ) -> None:
        action_id = self.coordinator.next_action_id + ahead
        self.send(ActionOutcome(self.id_of(who), action_id, outcome), via_handle)

    @rule(
        steps=st.integers(1, 12),
        timing=timings,
        tokens=token_counts,
        release=st.sampled_from([APPLIED, NOOP]),
        then=st.one_of(st.none(), st.sampled_from(TERMINAL_FACTS)),
        via_handle=st.booleans(),
    )
    def progress(
        self,
        *,
        steps: int,
        timing: HandoffTransferTiming,
        tokens: int,
        release: Outcome,
        then: type[Failed | TimedOut | Canceled] | None,
        via_handle: bool,
    ) -> None:
        """Send what the handoff waits for, as a cooperative engine would, up to `steps` times;
        then, perhaps, a terminal fact (which, after a success, reopens the cleanup)."""
        for _ in range(steps):
            message = self.next_expected(timing, tokens, release)
            if message is None:
                break
            self.send(message, via_handle)
        if then is not None:
            self.send(then(self.handoff_id), via_handle)

    # --- driving and checking -----------------------------------------------------------

    def id_of(self, who: str) -> UUID:
        return self.handoff_id if who == "own" else OTHER

    def next_expected(
        self, timing: HandoffTransferTiming, tokens: int, release: Outcome
    ) -> Input | None:
        c = self.coordinator
        h = self.handoff_id
        if c.mode is Mode.ACTIVE and not c.snapshot().started:
            return start_command(h, self.order)
        for wait in c.waiting_for():
            if wait.action is not None:
                outcome = SUCCESS_OUTCOME[type(wait.action)]
                if type(wait.action) in (ReleaseSource, CancelSource, CancelDestination):
                    outcome = release
                return ActionOutcome(h, wait.action.action_id, outcome)
            if wait.fact == "source_held":
                return SourceHeld(h, timing)
            if wait.fact == "destination_reserved":
                return DestinationReserved(h, tokens)
            if wait.fact == "transfer_completed":
                return TransferCompleted(h)
        return None

    def send(self, message: Input, via_handle: bool) -> None:
        c = self.coordinator
        if message.handoff_id != self.handoff_id and isinstance(
            message, StartHandoff | ActionOutcome
        ):
            via_handle = True  # start() and on_action_outcome() take no handoff id
        before = c.snapshot()
        state = c.describe()
        try:
            actions = call(c, message, via_handle)
        except InputRejected as exc:
            assert c.snapshot() == before, f"rejected {message!r} changed the coordinator"  # (d)
            self.check_rejection(exc, message, state)
            return
        assert message.handoff_id == self.handoff_id, f"accepted another handoff's {message!r}"
        self.log.append(message)
        self.record(message, before, actions)

        # (e) determinism: the shadow sees only accepted inputs, always through `handle`.
        assert self.shadow.handle(message) == actions
        assert self.shadow == c
        assert self.shadow.snapshot() == c.snapshot()

        # (f) idempotence: the same input again, at once, is a no-op.
        after = c.snapshot()
        try:
            again = call(c, message, via_handle)
        except InputRejected as exc:
            raise AssertionError(f"accepted {message!r}, then rejected it at once: {exc}") from exc
        assert again == [], f"{message!r} applied twice issued {again!r}"
        assert c.snapshot() == after, f"{message!r} applied twice changed the coordinator"

    def check_rejection(self, exc: InputRejected, message: Input, state: str) -> None:
        text = str(exc)
        assert exc.handoff_id == self.handoff_id
        assert exc.state == state == self.coordinator.describe()
        assert str(self.handoff_id) in text
        assert f"[{state}]" in text
        assert exc.reason and exc.reason in text
        if isinstance(message, ActionOutcome) and message.handoff_id == self.handoff_id:
            assert exc.input_desc == f"outcome {message.outcome!r} for action {message.action_id}"
        else:
            assert exc.input_desc == repr(message)
        assert exc.input_desc in text

    def record(self, message: Input, before: CoordinatorState, actions: list[Action]) -> None:
        after = self.coordinator.snapshot()
        if isinstance(message, SourceHeld) and not before.source_held and after.source_held:
            self.held = message.timing
            bandwidth = message.timing.bandwidth_gb_s
            assert bandwidth is None or (math.isfinite(bandwidth) and bandwidth >= 0.0)
        if (
            isinstance(message, DestinationReserved)
            and after.destination_reserved
            and not before.destination_reserved
        ):
            self.reserved = message.transferable_prompt_tokens
        if isinstance(message, ActionOutcome) and before.mode is not Mode.COMPLETE:
            self.acks[message.action_id] = message.outcome

        for action in actions:
            assert action.handoff_id == self.handoff_id
            assert action.action_id == len(self.history), "action ids must be 0, 1, 2, ..."  # (c)
            self.check_after_completion(action)
            self.history.append(action)
            if isinstance(action, StartTransfer):
                assert sum(isinstance(a, StartTransfer) for a in self.history) == 1  # (b)
                assert math.isfinite(action.delay_ms) and action.delay_ms >= 0.0  # (g)
                assert self.held is not None and self.reserved is not None
                assert action.delay_ms == model_delay_ms(self.held, self.reserved, self.fallback)
            if isinstance(action, Complete):
                self.check_cleaned_up(action.completion)  # (a)

    def check_after_completion(self, action: Action) -> None:
        """After a completion only the reopened cleanup of a success may be issued."""
        completions = [a.completion for a in self.history if isinstance(a, Complete)]
        if not completions:
            return
        assert completions == [SUCCESS], f"{action!r} issued after {completions}"
        since = self.history[[type(a) for a in self.history].index(Complete) + 1 :]
        expected: list[type[Action]] = [CancelDestination, Complete]
        assert type(action) is expected[len(since)]
        if isinstance(action, Complete):
            assert action.completion is CANCELED

    def acked(self, action: Action, *accepted: type[Outcome]) -> bool:
        return type(self.acks.get(action.action_id)) in accepted

    def check_cleaned_up(self, completion: HandoffCompletion) -> None:
        history = self.history
        for i, action in enumerate(history):
            later = history[i + 1 :]
            if isinstance(action, SubmitPrefill):
                source_cleanup: tuple[type[Action], ...] = (
                    (ReleaseSource,) if completion is SUCCESS else (ReleaseSource, CancelSource)
                )
                assert any(
                    isinstance(a, source_cleanup) and self.acked(a, Applied, Noop) for a in later
                ), f"{completion}: the prefill {action!r} was never released or canceled"
            if isinstance(action, ReserveDestination):
                if completion is SUCCESS:
                    done = any(
                        isinstance(a, ActivateDestination) and self.acked(a, Applied) for a in later
                    )
                else:
                    done = any(
                        isinstance(a, CancelDestination) and self.acked(a, Applied, Noop)
                        for a in later
                    )
                assert done, f"{completion}: the reservation {action!r} was left behind"

    @invariant()
    def ids_state_and_completion_agree_with_the_history(self) -> None:
        c = self.coordinator
        assert c.next_action_id == len(self.history)
        last = self.history[-1] if self.history else None
        assert c.is_complete == isinstance(last, Complete)
        completions = [a.completion for a in self.history if isinstance(a, Complete)]
        # During a reopened cleanup `completion` still reports the earlier success.
        assert c.completion is (completions[-1] if completions else None)
        outstanding = c.outstanding()
        assert all(a in self.history and a.action_id not in self.acks for a in outstanding)
        if c.is_complete:
            assert outstanding == [] and c.waiting_for() == []

    def teardown(self) -> None:
        if not hasattr(self, "coordinator"):
            return
        completions = [str(a.completion) for a in self.history if isinstance(a, Complete)]
        event(f"{self.order}: completed {' then '.join(completions) or 'never'}")
        # (e) replay: the whole log through a fresh coordinator re-derives every action.
        replayed = HandoffCoordinator(self.handoff_id, self.order, self.fallback)
        actions = [a for message in self.log for a in replayed.handle(message)]
        assert actions == self.history
        assert replayed == self.coordinator


TestCoordinatorMachine = CoordinatorMachine.TestCase


# --- a cooperative engine -------------------------------------------------------------------

FACT_AFTER: dict[type[Action], Callable[[UUID, HandoffTransferTiming, int], Input]] = {
    SubmitPrefill: lambda h, timing, tokens: SourceHeld(h, timing),
    ReserveDestination: lambda h, timing, tokens: DestinationReserved(h, tokens),
    StartTransfer: lambda h, timing, tokens: TransferCompleted(h),
}

DOCUMENTED_SEQUENCE: dict[HandoffOrder, list[type[Action]]] = {
    SOURCE_FIRST: [
        SubmitPrefill,
        ReserveDestination,
        StartTransfer,
        ActivateDestination,
        ReleaseSource,
        Complete,
    ],
    DESTINATION_FIRST: [
        ReserveDestination,
        SubmitPrefill,
        StartTransfer,
        ActivateDestination,
        ReleaseSource,
        Complete,
    ],
}

valid_timings = st.builds(
    HandoffTransferTiming,
    mode=st.sampled_from(KvTransferTimingMode),
    full_prompt_tokens=st.integers(0, 2**60),
    kv_bytes_per_token=st.one_of(st.none(), st.integers(0, 1 << 40)),
    bandwidth_gb_s=st.one_of(st.none(), st.just(0.0), st.floats(min_value=1e-3, max_value=1e4)),
)


@settings(deadline=None)
@given(
    handoff_id=st.uuids(),
    order=st.sampled_from(HandoffOrder),
    timing=valid_timings,
    tokens=st.integers(0, 2**60),
    fallback=fallback_delays,
    release=st.sampled_from([APPLIED, NOOP]),
)
def test_a_cooperative_engine_completes_with_the_documented_sequence(
    *,
    handoff_id: UUID,
    order: HandoffOrder,
    timing: HandoffTransferTiming,
    tokens: int,
    fallback: float,
    release: Outcome,
) -> None:
    coordinator = HandoffCoordinator(handoff_id, order, fallback)
    issued: list[Action] = []
    inbox: deque[Input] = deque([start_command(handoff_id, order)])
    while inbox:
        for action in coordinator.handle(inbox.popleft()):
            issued.append(action)
            if isinstance(action, Complete):
                continue
            outcome = (
                release if isinstance(action, ReleaseSource) else SUCCESS_OUTCOME[type(action)]
            )
            inbox.append(ActionOutcome(handoff_id, action.action_id, outcome))
            if (fact := FACT_AFTER.get(type(action))) is not None:
                inbox.append(fact(handoff_id, timing, tokens))

    assert [type(a) for a in issued] == DOCUMENTED_SEQUENCE[order]
    assert [a.action_id for a in issued] == list(range(len(issued)))
    transfer = issued[2]
    assert isinstance(transfer, StartTransfer)
    assert transfer.delay_ms == model_delay_ms(timing, tokens, fallback)
    final = issued[-1]
    assert isinstance(final, Complete) and final.completion is SUCCESS
    assert coordinator.is_complete and coordinator.completion is SUCCESS
    assert coordinator.outstanding() == [] and coordinator.waiting_for() == []


# --- table-driven ---------------------------------------------------------------------------

H = UUID("3b8f9c1e-2d4a-4e6b-8c0d-5f7a9b1c3e5d")
TIMING = HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, 4096, 131_072, 25.0)


def drive(order: HandoffOrder, inputs: Sequence[Input]) -> tuple[HandoffCoordinator, list[Action]]:
    coordinator = HandoffCoordinator(H, order)
    issued = [a for message in inputs for a in coordinator.handle(message)]
    return coordinator, issued


def outcome(action_id: int, result: Outcome) -> ActionOutcome:
    return ActionOutcome(H, action_id, result)


# The happy paths, input by input; each ends in Complete(success) as action 5.
HAPPY: dict[HandoffOrder, list[Input]] = {
    SOURCE_FIRST: [
        start_command(H, SOURCE_FIRST),
        outcome(0, SUBMITTED),
        SourceHeld(H, TIMING),
        outcome(1, ACCEPTED),
        DestinationReserved(H, 4096),
        outcome(2, SCHEDULED),
        TransferCompleted(H),
        outcome(3, APPLIED),
        outcome(4, APPLIED),
    ],
    DESTINATION_FIRST: [
        start_command(H, DESTINATION_FIRST),
        outcome(0, ACCEPTED),
        DestinationReserved(H, 4096),
        outcome(1, SUBMITTED),
        SourceHeld(H, TIMING),
        outcome(2, SCHEDULED),
        TransferCompleted(H),
        outcome(3, APPLIED),
        outcome(4, APPLIED),
    ],
}

START = start_command(H, SOURCE_FIRST)
SUBMITTED_SOURCE_FIRST: list[Input] = [START, outcome(0, SUBMITTED)]
REJECTIONS: list[tuple[str, HandoffOrder, list[Input], Input, str]] = [
    (
        "held before submitted",
        SOURCE_FIRST,
        [START],
        SourceHeld(H, TIMING),
        "source held before prefill submission was acknowledged",
    ),
    (
        "reserved before accepted",
        DESTINATION_FIRST,
        [start_command(H, DESTINATION_FIRST)],
        DestinationReserved(H, 1),
        "destination reserved before ownership was accepted",
    ),
    (
        "transferred before scheduled",
        SOURCE_FIRST,
        HAPPY[SOURCE_FIRST][:5],
        TransferCompleted(H),
        "transfer completed before it was scheduled",
    ),
    (
        "another handoff's fact",
        SOURCE_FIRST,
        [START],
        Canceled(OTHER),
        "belongs to a different handoff",
    ),
    (
        "another handoff's outcome",
        SOURCE_FIRST,
        [START],
        ActionOutcome(OTHER, 0, SUBMITTED),
        "belongs to a different handoff",
    ),
    ("unknown action", SOURCE_FIRST, [START], outcome(7, SUBMITTED), "unknown handoff action 7"),
    (
        "wrong outcome kind",
        SOURCE_FIRST,
        [START],
        outcome(0, ACCEPTED),
        "invalid handoff action outcome Accepted",
    ),
    (
        "conflicting outcome",
        SOURCE_FIRST,
        [START, outcome(0, SUBMITTED)],
        outcome(0, ActionFailed("late")),
        "conflicting outcome for handoff action 0",
    ),
    (
        "cleanup failed",
        SOURCE_FIRST,
        [START, Canceled(H)],
        outcome(1, ActionFailed("gone")),
        "handoff cleanup action 1 failed",
    ),
    *(
        (
            f"bandwidth {bandwidth}",
            SOURCE_FIRST,
            SUBMITTED_SOURCE_FIRST,
            SourceHeld(H, HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, 1, 1, bandwidth)),
            "invalid handoff transfer bandwidth",
        )
        for bandwidth in (-1.0, math.nan, math.inf, -math.inf)
    ),
    (
        "infinite delay",
        SOURCE_FIRST,
        [
            START,
            outcome(0, SUBMITTED),
            SourceHeld(
                H, HandoffTransferTiming(KvTransferTimingMode.DESTINATION_MISSING, 1, 2**60, 5e-324)
            ),
            outcome(1, ACCEPTED),
        ],
        DestinationReserved(H, 2**60),
        "invalid handoff transfer delay inf",
    ),
    (
        "infinite delay, destination first",
        DESTINATION_FIRST,
        HAPPY[DESTINATION_FIRST][:4],
        SourceHeld(
            H, HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, 8192, 1 << 20, 5e-324)
        ),
        "invalid handoff transfer delay inf",
    ),
]


# Rejected only because an earlier input has not arrived yet: a redelivering bus may still
# bring it, so the driver may offer these again.
PREMATURE = {"held before submitted", "reserved before accepted", "transferred before scheduled"}


@pytest.mark.parametrize(
    ("name", "order", "setup", "bad", "reason"), REJECTIONS, ids=[case[0] for case in REJECTIONS]
)
def test_a_rejection_names_the_handoff_the_state_and_the_input(
    name: str, order: HandoffOrder, setup: list[Input], bad: Input, reason: str
) -> None:
    coordinator, _ = drive(order, setup)
    before = coordinator.snapshot()
    state = coordinator.describe()
    with pytest.raises(InputRejected) as excinfo:
        coordinator.handle(bad)
    text = str(excinfo.value)
    assert str(H) in text
    assert f"[{state}]" in text
    shown = (
        f"outcome {bad.outcome!r} for action {bad.action_id}"
        if isinstance(bad, ActionOutcome) and bad.handoff_id == H
        else repr(bad)
    )
    assert shown in text
    assert reason in excinfo.value.reason
    assert excinfo.value.premature == (name in PREMATURE)
    assert coordinator.snapshot() == before
    # Refused again the same way: the rejection recorded nothing.
    with pytest.raises(InputRejected) as again:
        coordinator.handle(bad)
    assert str(again.value) == text


@pytest.mark.parametrize("order", HandoffOrder)
@pytest.mark.parametrize("terminal", TERMINAL_FACTS)
@pytest.mark.parametrize("ack", [APPLIED, NOOP])
def test_a_terminal_fact_after_success_reopens_cleanup(
    order: HandoffOrder, terminal: type[Failed | TimedOut | Canceled], ack: Outcome
) -> None:
    coordinator, issued = drive(order, HAPPY[order])
    assert issued[-1] == Complete(H, 5, SUCCESS)

    assert coordinator.handle(terminal(H)) == [CancelDestination(H, 6)]
    assert not coordinator.is_complete
    assert coordinator.mode is Mode.CLEANING_UP
    assert coordinator.waiting_for() == [
        Waiting(role=Role.DESTINATION, action=CancelDestination(H, 6))
    ]
    # Further terminal facts change nothing; the cleanup may not fail.
    for again in TERMINAL_FACTS:
        assert coordinator.handle(again(H)) == []
    with pytest.raises(InputRejected, match="cleanup action 6 failed"):
        coordinator.handle(outcome(6, ActionFailed("still there")))

    assert coordinator.handle(outcome(6, ack)) == [Complete(H, 7, CANCELED)]
    assert coordinator.is_complete and coordinator.completion is CANCELED
    assert coordinator.handle(terminal(H)) == []
    assert coordinator.next_action_id == 8


@pytest.mark.parametrize("order", HandoffOrder)
@pytest.mark.parametrize("terminal", TERMINAL_FACTS)
def test_start_after_a_terminal_fact_issues_nothing(
    order: HandoffOrder, terminal: type[Failed | TimedOut | Canceled]
) -> None:
    coordinator = HandoffCoordinator(H, order)
    assert coordinator.handle(terminal(H)) == [Complete(H, 0, CANCELED)]
    closed = coordinator.snapshot()
    assert coordinator.handle(start_command(H, order)) == []
    assert coordinator.start() == []
    assert coordinator.snapshot() == closed
    assert coordinator.next_action_id == 1


CANCELED_SOURCE_FIRST: list[Input] = [
    START,
    outcome(0, SUBMITTED),
    SourceHeld(H, TIMING),
    Failed(H),
    outcome(2, APPLIED),
    outcome(3, NOOP),
]


@pytest.mark.parametrize(
    ("order", "inputs", "last_id"),
    [
        pytest.param(SOURCE_FIRST, HAPPY[SOURCE_FIRST], 5, id="success"),
        pytest.param(SOURCE_FIRST, CANCELED_SOURCE_FIRST, 4, id="canceled"),
    ],
)
@pytest.mark.parametrize(
    "late",
    [
        pytest.param(lambda last: outcome(0, SUBMITTED), id="repeat"),
        pytest.param(lambda last: outcome(0, ActionFailed("late")), id="conflicting"),
        pytest.param(lambda last: outcome(1, SCHEDULED), id="wrong-kind"),
        pytest.param(lambda last: outcome(last, APPLIED), id="for-complete"),
        pytest.param(lambda last: outcome(last + 40, APPLIED), id="unknown"),
    ],
)
def test_an_outcome_for_a_completed_handoff_is_ignored(
    order: HandoffOrder, inputs: list[Input], last_id: int, late: Callable[[int], Input]
) -> None:
    coordinator, issued = drive(order, inputs)
    assert issued[-1].action_id == last_id and isinstance(issued[-1], Complete)
    done = coordinator.snapshot()
    assert coordinator.handle(late(last_id)) == []
    assert coordinator.snapshot() == done


def _waits(order: HandoffOrder, inputs: list[Input]) -> list[Waiting]:
    coordinator, _ = drive(order, inputs)
    return coordinator.waiting_for()


def test_waiting_for_names_outstanding_actions_then_expected_facts() -> None:
    sf = HAPPY[SOURCE_FIRST]
    df = HAPPY[DESTINATION_FIRST]
    assert _waits(SOURCE_FIRST, []) == []
    assert _waits(SOURCE_FIRST, sf[:1]) == [Waiting(Role.SOURCE, action=SubmitPrefill(H, 0))]
    assert _waits(SOURCE_FIRST, sf[:2]) == [Waiting(Role.SOURCE, fact="source_held")]
    assert _waits(SOURCE_FIRST, sf[:3]) == [
        Waiting(Role.DESTINATION, action=ReserveDestination(H, 1))
    ]
    assert _waits(SOURCE_FIRST, sf[:4]) == [Waiting(Role.DESTINATION, fact="destination_reserved")]
    assert _waits(SOURCE_FIRST, sf[:6]) == [Waiting(Role.SOURCE, fact="transfer_completed")]
    assert _waits(DESTINATION_FIRST, df[:1]) == [
        Waiting(Role.DESTINATION, action=ReserveDestination(H, 0))
    ]
    assert _waits(DESTINATION_FIRST, df[:2]) == [
        Waiting(Role.DESTINATION, fact="destination_reserved")
    ]
    assert _waits(DESTINATION_FIRST, df[:8]) == [Waiting(Role.SOURCE, action=ReleaseSource(H, 4))]
    # Cleaning up: only the cancels, in issue order, and no facts. The unanswered reservation
    # is superseded by its cancel: a driver that retried it could reserve after the cancel
    # and leak the blocks (its late outcome is still accepted, see the state machine).
    assert _waits(SOURCE_FIRST, CANCELED_SOURCE_FIRST[:4]) == [
        Waiting(Role.SOURCE, action=CancelSource(H, 2)),
        Waiting(Role.DESTINATION, action=CancelDestination(H, 3)),
    ]
    assert _waits(SOURCE_FIRST, CANCELED_SOURCE_FIRST) == []
    assert _waits(SOURCE_FIRST, sf) == []


def test_describe_shows_the_mode_and_what_the_handoff_awaits() -> None:
    coordinator = HandoffCoordinator(H, SOURCE_FIRST)
    assert coordinator.describe() == "active (not started)"
    coordinator.handle(START)
    assert coordinator.describe() == "active, awaiting submit_prefill#0"
    coordinator.handle(outcome(0, SUBMITTED))
    assert coordinator.describe() == "active, awaiting source_held"
    coordinator.handle(Canceled(H))
    assert coordinator.describe() == "cleaning_up, awaiting cancel_source#1"
    coordinator.handle(outcome(1, NOOP))
    assert coordinator.describe() == "complete (canceled)"
