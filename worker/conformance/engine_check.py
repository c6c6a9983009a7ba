"""Engine conformance: scripted scenarios that hold one engine on the bus to the wire contract
(`docs/contract.md`), rule by rule. `kvhandoff engine-check ENGINE_ID` prints the verdicts.

The checker plays the tier: it publishes actions on the engine's subject with fresh handoff ids,
as the worker would, and reads what the engine publishes on `<prefix>.in.<handoff_id>` as a core
subscriber. So that the engine's JetStream publishes are stored (and so acknowledged) without a
worker, it creates a short-lived stream for the inputs unless one already stores them. If that
is a worker's, the worker holds the checker's inputs back a while and then rejects them (it never
started their handoffs); nothing else happens, and the checker sees them all the same. Each rule
is one scenario on handoffs of its own, so one broken rule fails one line.

What a rule waits for comes within `wait_s`; that nothing more comes (no second effect, no fact
after a cancel) is watched for `quiet_s`. Those windows are the checker's only clock: an engine
whose slow part outlasts `quiet_s` can break the cancel rules unseen, so set it above the
engine's prefill and reservation time.

Order within a scenario is held only where a rule says so: a fact that overtakes its outcome
fails `fact-after-outcome` alone, and the other rules take the two in either order.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from kvhandoff.events.codec import decode_input, encode
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import (
    Accepted,
    Action,
    ActionFailed,
    ActionOutcome,
    ActivateDestination,
    Applied,
    CancelDestination,
    CancelSource,
    DestinationReserved,
    Input,
    Noop,
    Outcome,
    ReleaseSource,
    ReserveDestination,
    Role,
    Scheduled,
    SourceHeld,
    StartTransfer,
    SubmitPrefill,
    Submitted,
    TransferCompleted,
)
from kvhandoff.events.reports import EnginesReport
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus, Message, Subscription
from kvhandoff.worker.bus.streams import capture_unless_captured, delete_stream

# The rules, in the order they run (docs/contract.md, "Check an engine").
RULES = (
    "probe",
    "report",
    "forward-path",
    "fact-after-outcome",
    "repeat",
    "duplicate",
    "cancel-before",
    "cancel-during",
    "cancel-after",
    "late-forward",
)
DEFAULT_WAIT_S = 5.0
DEFAULT_QUIET_S = 1.0

_report_decoder = msgspec.json.Decoder(EnginesReport)


class _RuleBroken(Exception):
    """A scenario saw the engine break its rule; the message says what came instead."""


@dataclass(frozen=True)
class Verdict:
    """One rule's result, and the exchange that decided it (`→` sent, `←` came back)."""

    rule: str
    passed: bool
    exchange: tuple[str, ...]
    detail: str = ""

    def line(self) -> str:
        head = f"{'PASS' if self.passed else 'FAIL'}  {self.rule:<20}"
        said = f"  {self.detail}" if self.detail else ""
        return f"{head}{said}  [{'; '.join(self.exchange)}]"


@dataclass(frozen=True)
class _Side:
    """What an engine of one role is sent first, answers, and reports when the slow part ends."""

    first: type[SubmitPrefill] | type[ReserveDestination]
    answer: type[Outcome]
    fact: type[SourceHeld] | type[DestinationReserved]
    cancel: type[CancelSource] | type[CancelDestination]


_SIDES = {
    Role.SOURCE: _Side(SubmitPrefill, Submitted, SourceHeld, CancelSource),
    Role.DESTINATION: _Side(ReserveDestination, Accepted, DestinationReserved, CancelDestination),
}
_CLEANED = (Applied, Noop)


def role_of(engine_id: str) -> Role | None:
    """The role the kvhandoff naming gives an engine id (`<type>-prefill-<i>` is a source,
    `<type>-decode-<i>` a destination), or None if the id does not follow it."""
    if "-prefill-" in engine_id:
        return Role.SOURCE
    if "-decode-" in engine_id:
        return Role.DESTINATION
    return None


class _Inbox:
    """What is published on the input subjects of the checker's handoffs, queued per handoff
    (the rest of the bus's inputs, a live tier's, are none of its business)."""

    def __init__(self, subjects: Subjects) -> None:
        self._subjects = subjects
        self._queues: dict[HandoffId, asyncio.Queue[Input | str]] = {}

    def open(self) -> HandoffId:
        """A fresh handoff id, whose inputs are queued from now on."""
        handoff_id = uuid.uuid4()
        self._queues[handoff_id] = asyncio.Queue()
        return handoff_id

    async def deliver(self, msg: Message) -> None:
        handoff_id = self._subjects.input_handoff(msg.subject)
        queue = None if handoff_id is None else self._queues.get(handoff_id)
        if queue is None:
            return
        try:
            message = decode_input(msg.data)
        except msgspec.DecodeError as exc:
            queue.put_nowait(f"undecodable {msg.data[:80]!r}: {exc}")
            return
        if message.handoff_id != handoff_id:
            queue.put_nowait(f"{_name(message)} naming {message.handoff_id} on {msg.subject}")
            return
        queue.put_nowait(message)

    def queue(self, handoff_id: HandoffId) -> asyncio.Queue[Input | str]:
        return self._queues[handoff_id]


class _Script:
    """One scenario's handoff: what it sent, what came back, and what came early."""

    def __init__(self, check: EngineCheck) -> None:
        self.check = check
        self.handoff_id = check.inbox.open()
        self.exchange: list[str] = []
        self.unread: list[Input] = []  # arrived while the script waited for something else
        self.arrivals: list[Input] = []  # everything of this handoff, in arrival order

    def next_handoff(self) -> None:
        """Go on with a fresh handoff, in the same exchange."""
        self.handoff_id = self.check.inbox.open()
        self.unread, self.arrivals = [], []
        self.exchange.append("(a second handoff)")

    async def send(self, action: Action) -> None:
        self.exchange.append(f"→ {_name(action)}")
        await self.check.bus.publish(
            self.check.subjects.engine(self.check.engine_id), encode(action)
        )

    async def _next(self, wait_s: float) -> Input | None:
        queue = self.check.inbox.queue(self.handoff_id)
        try:
            async with asyncio.timeout(wait_s):
                message = await queue.get()
        except TimeoutError:
            return None
        if isinstance(message, str):
            self.exchange.append(f"← {message}")
            raise _RuleBroken(f"published {message}")
        self.exchange.append(f"← {_name(message)}")
        self.arrivals.append(message)
        return message

    async def outcome(self, action_id: int) -> Outcome:
        """The outcome of action `action_id`."""
        message = await self._take(
            lambda m: isinstance(m, ActionOutcome) and m.action_id == action_id,
            f"outcome for action #{action_id}",
        )
        assert isinstance(message, ActionOutcome)
        return message.outcome

    async def fact(self, kind: type[Input]) -> None:
        """Wait for a fact of `kind`."""
        await self._take(lambda m: type(m) is kind, _tag(kind))

    async def _take(self, wanted: Callable[[Input], bool], what: str) -> Input:
        """The first message `wanted`, of those that came early or within `wait_s`; the others
        that come meanwhile are kept (`unread`)."""
        for message in self.unread:
            if wanted(message):
                self.unread.remove(message)
                return message
        clock = asyncio.get_running_loop().time
        give_up = clock() + self.check.wait_s
        while (left := give_up - clock()) > 0:
            arrived = await self._next(left)
            if arrived is not None and wanted(arrived):
                return arrived
            if arrived is not None:
                self.unread.append(arrived)
        raise _RuleBroken(f"no {what} within {self.check.wait_s:g}s")

    async def quiet(self) -> list[Input]:
        """What else comes within `quiet_s` (besides what came early and was not read)."""
        extra, self.unread = list(self.unread), []
        clock = asyncio.get_running_loop().time
        give_up = clock() + self.check.quiet_s
        while (left := give_up - clock()) > 0:
            message = await self._next(left)
            if message is not None:
                extra.append(message)
        return extra


def _expect(outcome: Outcome, *kinds: type[Outcome], what: str) -> None:
    if not isinstance(outcome, kinds):
        wanted = " or ".join(_tag(kind) for kind in kinds)
        raise _RuleBroken(f"{what} was answered {_describe(outcome)}, not {wanted}")


def _no_facts(extra: list[Input], after: str) -> None:
    facts = [_name(message) for message in extra if not isinstance(message, ActionOutcome)]
    if facts:
        raise _RuleBroken(f"{', '.join(facts)} after {after}")


class EngineCheck:
    """The scenarios, against one engine id of one role, on a connected `Bus`."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        engine_id: str,
        role: Role,
        *,
        wait_s: float = DEFAULT_WAIT_S,
        quiet_s: float = DEFAULT_QUIET_S,
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.engine_id = engine_id
        self.role = role
        self.side = _SIDES[role]
        self.wait_s = wait_s
        self.quiet_s = quiet_s
        self.inbox = _Inbox(subjects)

    @property
    def scenarios(self) -> dict[str, Callable[[_Script], Awaitable[str]]]:
        """Each rule's scenario; each returns what it saw on a pass."""
        return {
            "probe": self._probe,
            "report": self._report,
            "forward-path": self._forward_path,
            "fact-after-outcome": self._fact_after_outcome,
            "repeat": self._repeat,
            "duplicate": self._duplicate,
            "cancel-before": self._cancel_before,
            "cancel-during": self._cancel_during,
            "cancel-after": self._cancel_after,
            "late-forward": self._late_forward,
        }

    async def run(self, only: set[str] | None = None) -> list[Verdict]:
        """Run every rule (or those named in `only`) and return one verdict per rule."""
        stream_subjects = self.subjects.inputs
        # One per prefix (a stream name has no dots), gone at the end or after five minutes.
        stream = f"KVHANDOFF_ENGINE_CHECK_{self.subjects.prefix.replace('.', '_')}"
        created = await capture_unless_captured(self.bus, stream, stream_subjects, max_age_s=300.0)
        subscription: Subscription = await self.bus.subscribe(stream_subjects, self.inbox.deliver)
        await self.bus.flush()
        try:
            verdicts = []
            scenarios = self.scenarios
            for rule in RULES:
                if only is None or rule in only:
                    verdicts.append(await self._verdict(rule, scenarios[rule]))
            return verdicts
        finally:
            await subscription.unsubscribe()
            if created:
                await delete_stream(self.bus, stream)

    async def _verdict(self, rule: str, scenario: Callable[[_Script], Awaitable[str]]) -> Verdict:
        script = _Script(self)
        try:
            seen = await scenario(script)
        except _RuleBroken as exc:
            return Verdict(rule, False, tuple(script.exchange), str(exc))
        return Verdict(rule, True, tuple(script.exchange), seen)

    # --- The scenarios ----------------------------------------------------------------------

    async def _probe(self, script: _Script) -> str:
        script.exchange.append("→ empty request on the action subject")
        replies = await self.bus.gather(
            self.subjects.engine(self.engine_id), b"", first_reply_s=self.wait_s, quiet_s=0.0
        )
        if not replies:
            raise _RuleBroken(f"no reply within {self.wait_s:g}s")
        script.exchange.append(f"← {replies[0][:40]!r}")
        if replies[0]:
            raise _RuleBroken("the reply to a probe must be empty")
        return "answered, empty"

    async def _report(self, script: _Script) -> str:
        script.exchange.append(f"→ request on {self.subjects.engines_report}")
        replies = await self.bus.gather(
            self.subjects.engines_report, b"", first_reply_s=self.wait_s, quiet_s=0.2
        )
        script.exchange.append(f"← {len(replies)} replies")
        for reply in replies:
            try:
                report = _report_decoder.decode(reply)
            except msgspec.DecodeError:
                continue  # another process's business; ours must decode
            for status in report.engines:
                if status.engine_id == self.engine_id:
                    if status.role is not self.role:
                        raise _RuleBroken(f"reported as a {status.role}, not a {self.role}")
                    leaks = sum(leak.engine_id == self.engine_id for leak in report.leaks)
                    return f"process {report.process}, {leaks} leaks"
        raise _RuleBroken(f"no engines_report that decodes names {self.engine_id}")

    async def _forward_path(self, script: _Script) -> str:
        """The role's actions in the order the coordinator issues them, each answered as the
        contract says, with its fact."""
        side, h = self.side, script.handoff_id
        await script.send(side.first(h, 0))
        _expect(await script.outcome(0), side.answer, what=_tag(side.first))
        await script.fact(side.fact)
        if self.role is Role.SOURCE:
            await script.send(StartTransfer(h, 1, delay_ms=0.0))
            _expect(await script.outcome(1), Scheduled, what="start_transfer")
            await script.fact(TransferCompleted)
            await script.send(ReleaseSource(h, 2))
            _expect(await script.outcome(2), *_CLEANED, what="release_source")
        else:
            await script.send(ActivateDestination(h, 1))
            _expect(await script.outcome(1), Applied, what="activate_destination")
            # A terminal fact after a success reopens cleanup: the decode is canceled.
            await script.send(CancelDestination(h, 2))
            _expect(await script.outcome(2), *_CLEANED, what="cancel_destination after success")
        return "every action answered as the contract says, facts included"

    async def _fact_after_outcome(self, script: _Script) -> str:
        side = self.side
        await script.send(side.first(script.handoff_id, 0))
        await script.outcome(0)
        await script.fact(side.fact)
        kinds = [type(message) for message in script.arrivals]
        if kinds.index(side.fact) < kinds.index(ActionOutcome):
            raise _RuleBroken(f"{_tag(side.fact)} overtook the outcome it follows from")
        await self._clean(script, 1)
        return f"{_tag(side.fact)} came after {_tag(side.answer)}"

    async def _repeat(self, script: _Script) -> str:
        """The worker's retry of an action whose outcome it missed, arriving after a later
        action: the same outcome again, and no second effect."""
        side, h = self.side, script.handoff_id
        await script.send(side.first(h, 0))
        first = await script.outcome(0)
        await script.fact(side.fact)
        await script.send(side.cancel(h, 1))
        await script.outcome(1)
        await script.send(side.first(h, 0))
        again = await script.outcome(0)
        if again != first:
            raise _RuleBroken(
                f"#0 repeated was answered {_describe(again)}, first {_describe(first)}"
            )
        _no_facts(await script.quiet(), "the repeat")
        return f"#0 answered {_describe(first)} again, no second effect"

    async def _duplicate(self, script: _Script) -> str:
        """Two copies of one action delivered back to back: one effect."""
        side, h = self.side, script.handoff_id
        await script.send(side.first(h, 0))
        await script.send(side.first(h, 0))
        first, second = await script.outcome(0), await script.outcome(0)
        if first != second:
            raise _RuleBroken(f"copies answered {_describe(first)} and {_describe(second)}")
        await script.fact(side.fact)
        _no_facts(await script.quiet(), f"the first {_tag(side.fact)}")
        await self._clean(script, 1)
        return f"both copies answered {_describe(first)}, one {_tag(side.fact)}"

    async def _cancel_before(self, script: _Script) -> str:
        await script.send(self.side.cancel(script.handoff_id, 0))
        _expect(await script.outcome(0), *_CLEANED, what="a cancel of nothing")
        _no_facts(await script.quiet(), "the cancel")
        return "nothing held: the cancel did not fail"

    async def _cancel_during(self, script: _Script) -> str:
        """A cancel while the first action's work runs; for a source, also while the transfer
        runs, whose length the checker sets (`delay_ms`, within the quiet window)."""
        side, h = self.side, script.handoff_id
        await script.send(side.first(h, 0))
        await script.send(side.cancel(h, 1))
        await script.outcome(0)
        seen = [await self._dropped(script, 1, side.fact)]
        if self.role is Role.SOURCE:
            script.next_handoff()
            h = script.handoff_id
            await script.send(SubmitPrefill(h, 0))
            await script.outcome(0)
            await script.fact(SourceHeld)
            await script.send(StartTransfer(h, 1, delay_ms=self.quiet_s * 1000 / 2))
            await script.send(CancelSource(h, 2))
            await script.outcome(1)
            seen.append(await self._dropped(script, 2, TransferCompleted))
        return "; ".join(seen)

    async def _dropped(self, script: _Script, cancel_id: int, fact: type[Input]) -> str:
        """The cancel `cancel_id` is a cleanup's answer and no `fact` follows it."""
        cancel = await script.outcome(cancel_id)
        _expect(cancel, *_CLEANED, what=f"a cancel mid-work (#{cancel_id})")
        # A fact that came before the cancel's outcome finished before the cancel was handled.
        early = [m for m in script.arrivals if isinstance(m, fact)]
        script.unread = [m for m in script.unread if not isinstance(m, fact)]
        _no_facts(await script.quiet(), f"the cancel #{cancel_id}")
        if early:
            return f"{_tag(fact)} came before the cancel (not exercised)"
        return f"{_describe(cancel)}, no {_tag(fact)}"

    async def _cancel_after(self, script: _Script) -> str:
        side, h = self.side, script.handoff_id
        await script.send(side.first(h, 0))
        await script.outcome(0)
        await script.fact(side.fact)
        await script.send(side.cancel(h, 1))
        _expect(await script.outcome(1), Applied, what=f"{_tag(side.cancel)} of what is held")
        return "what was held was freed: applied"

    async def _late_forward(self, script: _Script) -> str:
        """A forward action that arrives after the handoff was cleaned up here (the worker's
        retry of a first copy that was lost) must not take ownership: nothing would free it."""
        side, h = self.side, script.handoff_id
        await script.send(side.cancel(h, 1))
        await script.outcome(1)
        await script.send(side.first(h, 0))
        _expect(await script.outcome(0), ActionFailed, what=f"{_tag(side.first)} after cleanup")
        _no_facts(await script.quiet(), f"the refused {_tag(side.first)}")
        return "refused: failed"

    async def _clean(self, script: _Script, action_id: int) -> None:
        """Leave nothing held by the scenario's handoff (the engine's report stays clean)."""
        await script.send(self.side.cancel(script.handoff_id, action_id))
        await script.outcome(action_id)


def _tag(kind: type[msgspec.Struct]) -> str:
    return str(kind.__struct_config__.tag)


def _name(message: Input | Action) -> str:
    tag = _tag(type(message))
    if isinstance(message, ActionOutcome):
        return f"{_describe(message.outcome)}#{message.action_id}"
    action_id = getattr(message, "action_id", None)
    return tag if action_id is None else f"{tag}#{action_id}"


def _describe(outcome: Outcome) -> str:
    if isinstance(outcome, ActionFailed):
        return f"failed({outcome.reason!r})"
    return _tag(type(outcome))
