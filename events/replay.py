"""Replaying a handoff's log through the coordinator: rebuild, timeline, verify.

Only accepted inputs are logged, and an accepted input does the same thing every time it is
applied to the same state, so feeding a handoff's `InputRecord`s, in sequence order, to a fresh
coordinator rebuilds exactly the coordinator that logged them. The first input of every
handoff's log is its `StartHandoff`, and the `ActionRecord`s that follow an input, up to the
next input, are the actions that input issued. Three entry points read a log that way:

- `rebuild`: the coordinator after every logged input (what the worker's recovery uses).
- `timeline`: one `Step` per logged input, as data: the input, which fields of the
  coordinator's `CoordinatorState` it changed, the actions the current coordinator derives and
  the actions that were logged; `until` stops after a given step and keeps the full state there.
- `find_divergence` / `verify`: re-derive every action and compare it with the logged one
  (kind, action id, every field, order). The first step where they differ is a `Divergence`,
  returned as data or raised as `ReplayDivergence`. This is the check that makes a coordinator
  change safe to deploy against existing logs. `find_divergence_stored` does the same from the
  stored (encoded) records: it is `kvhandoff verify`'s hot loop, takes no snapshots and decodes
  no logged action that is byte for byte the re-derived one.

Steps are numbered by the `seq` of their input in the log. A log is given as `(seq, record)`
pairs of one handoff, in sequence order; sequence numbers count from 0 without gaps. A log that
breaks those rules raises `LogCorrupt`. Nothing here logs: a replay of a million events must
stay quiet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any
from uuid import UUID

import msgspec
from msgspec import Struct

from events.codec import decode_record, encode_record
from events.coordinator import CoordinatorState, HandoffCoordinator, Waiting
from events.errors import InputRejected, LogCorrupt, ReplayDivergence
from events.messages import Action, Input, StartHandoff
from events.records import ActionRecord, InputRecord, LogRecord

#: One entry of a handoff's log: its sequence number and the decoded record.
LoggedRecord = tuple[int, LogRecord]
#: The same, as stored: the record encoded by `events.codec.encode_record`.
StoredRecord = tuple[int, bytes]

_STATE_FIELDS: tuple[str, ...] = CoordinatorState.__struct_fields__


def rebuild(records: Iterable[LogRecord]) -> tuple[StartHandoff, HandoffCoordinator]:
    """The handoff's start command and its coordinator after every logged input."""
    start: StartHandoff | None = None
    coordinator: HandoffCoordinator | None = None
    for record in records:
        if not isinstance(record, InputRecord):
            continue
        message = record.input
        if coordinator is None:
            if not isinstance(message, StartHandoff):
                raise LogCorrupt(f"handoff {message.handoff_id}: log does not begin with a start")
            start = message
            coordinator = HandoffCoordinator.for_start(message)
        try:
            coordinator.handle(message)
        except InputRejected as exc:
            raise LogCorrupt(f"logged input no longer accepted: {exc}") from exc
    if start is None or coordinator is None:
        raise LogCorrupt("empty handoff log")
    return start, coordinator


# --- Timeline -------------------------------------------------------------------------------


class Change(Struct, frozen=True):
    """One field of `CoordinatorState` that a step changed."""

    field: str
    before: Any
    after: Any


class Step(Struct, frozen=True):
    """What one logged input did.

    `actions` are what the current coordinator derives from the input; `logged` are the actions
    the log holds for it. They are equal unless the coordinator changed since the log was
    written (`verify` reports the first step where they are not). `rejection` is set when the
    current coordinator refuses the logged input; the state is then unchanged by the step.
    """

    step: int
    at_ms: int
    input: Input
    changes: tuple[Change, ...]
    actions: tuple[Action, ...]
    logged: tuple[Action, ...]
    state: str
    rejection: str | None = None


class Timeline(Struct, frozen=True):
    """A handoff's replay, step by step, and the full state after the last step replayed."""

    handoff_id: UUID
    start: StartHandoff
    steps: tuple[Step, ...]
    state: CoordinatorState
    waiting: tuple[Waiting, ...]
    outstanding: tuple[int, ...]


def diff(before: CoordinatorState, after: CoordinatorState) -> tuple[Change, ...]:
    """The fields of the state that differ, in declaration order."""
    return tuple(
        Change(name, old, new)
        for name, old, new in zip(
            _STATE_FIELDS,
            msgspec.structs.astuple(before),
            msgspec.structs.astuple(after),
            strict=True,
        )
        if old != new
    )


def timeline(log: Iterable[LoggedRecord], *, until: int | None = None) -> Timeline:
    """Replay a handoff's log, one `Step` per input, stopping after step `until` if given.

    Raises `LogCorrupt` if the log is empty, does not begin with the handoff's start, skips a
    sequence number, or (with `until`) has no input at or before that step.
    """
    groups = list(_steps(log))
    if until is not None:
        groups = [g for g in groups if g[0] <= until]
        if not groups:
            raise LogCorrupt(f"no step at or before {until}")
    first = _start(groups[0][1].input)
    coordinator = HandoffCoordinator.for_start(first)
    state = coordinator.snapshot()
    steps = []
    for seq, record, logged in groups:
        message = record.input
        rejection = None
        try:
            actions = tuple(coordinator.handle(message))
        except InputRejected as exc:
            actions, rejection = (), exc.reason
        after = coordinator.snapshot()
        steps.append(
            Step(
                step=seq,
                at_ms=record.at_ms,
                input=message,
                changes=diff(state, after),
                actions=actions,
                logged=tuple(logged),
                state=coordinator.describe(),
                rejection=rejection,
            )
        )
        state = after
    return Timeline(
        handoff_id=first.handoff_id,
        start=first,
        steps=tuple(steps),
        state=state,
        waiting=tuple(coordinator.waiting_for()),
        outstanding=tuple(a.action_id for a in coordinator.outstanding()),
    )


def _steps(log: Iterable[LoggedRecord]) -> Iterable[tuple[int, InputRecord, list[Action]]]:
    """Group a log into (step, input record, logged actions), checking its shape."""
    current: tuple[int, InputRecord, list[Action]] | None = None
    expected = 0
    for seq, record in log:
        if seq != expected:
            raise LogCorrupt(_sequence_error(expected, seq))
        expected = seq + 1
        if isinstance(record, ActionRecord):
            if current is None:
                raise LogCorrupt(f"log begins with an action at sequence {seq}")
            current[2].append(record.action)
            continue
        if current is not None:
            yield current
        current = (seq, record, [])
    if current is None:
        raise LogCorrupt("empty handoff log")
    yield current


# --- Verification ---------------------------------------------------------------------------


class Divergence(Struct, frozen=True):
    """The first step at which the re-derived actions differ from the logged ones."""

    handoff_id: UUID
    step: int
    at_ms: int
    input: Input
    logged: tuple[Action, ...]
    rederived: tuple[Action, ...]
    detail: str

    def error(self) -> ReplayDivergence:
        """This divergence as the core's exception, with input and actions in its context."""
        return ReplayDivergence(
            self.handoff_id,
            self.step,
            self.detail,
            input=self.input,
            logged=self.logged,
            rederived=self.rederived,
        )


def find_divergence(log: Iterable[LoggedRecord]) -> Divergence | None:
    """Re-derive every logged action with the current coordinator; the first difference.

    Returns None when every step's re-derived actions equal its logged actions, in kind, action
    id, every field and order. A logged input that the coordinator now rejects is a divergence
    too. Raises `LogCorrupt` for a log that is empty, does not begin with a start, begins with
    an action, or skips a sequence number.
    """
    coordinator: HandoffCoordinator | None = None
    for seq, record, logged in _steps(log):
        message = record.input
        if coordinator is None:
            coordinator = HandoffCoordinator.for_start(_start(message))
        try:
            rederived = coordinator.handle(message)
        except InputRejected as exc:
            detail = f"the coordinator now rejects the logged input: {exc.reason}"
            return _divergence(seq, record, logged, (), detail)
        if rederived != logged:
            return _divergence(seq, record, logged, rederived)
    return None


def find_divergence_stored(rows: Sequence[StoredRecord]) -> Divergence | None:
    """`find_divergence` over a handoff's records as stored (encoded by `events.codec`).

    The hot loop of `kvhandoff verify`: no snapshots, and a logged action is not decoded when
    its stored bytes equal the encoding of the re-derived action stamped with its input's time,
    since equal encodings are equal records. Anything else (a difference, an extra or missing
    action, a rejected input, a record of an older schema version, a different timestamp)
    sends the handoff through `find_divergence` on the decoded records, which decides and
    describes. Raises `LogCorrupt` as `find_divergence` does, naming the handoff if it can.
    """
    decode, encode = decode_record, encode_record
    coordinator: HandoffCoordinator | None = None
    pending: list[Action] = []  # the current step's re-derived actions
    count = matched = 0  # how many there are, and how many the log has shown so far
    at_ms = expected = 0
    try:
        for seq, blob in rows:
            if seq != expected:
                break
            expected = seq + 1
            if matched < count:
                if encode(ActionRecord(at_ms, pending[matched])) != blob:
                    break
                matched += 1
                continue
            record = decode(blob)
            if not isinstance(record, InputRecord):
                break
            if coordinator is None:
                if not isinstance(record.input, StartHandoff):
                    break
                coordinator = HandoffCoordinator.for_start(record.input)
            pending = coordinator.handle(record.input)
            count, matched, at_ms = len(pending), 0, record.at_ms
        else:
            if coordinator is not None and matched == count:
                return None
    except (InputRejected, LogCorrupt):
        pass
    try:
        return find_divergence([(seq, decode(blob)) for seq, blob in rows])
    except LogCorrupt as exc:
        raise LogCorrupt(f"{_whose(rows)}{exc}") from exc


def verify(log: Iterable[LoggedRecord]) -> None:
    """Like `find_divergence`, but raise the first divergence as `ReplayDivergence`."""
    divergence = find_divergence(log)
    if divergence is not None:
        raise divergence.error()


def _sequence_error(expected: int, seq: int) -> str:
    if expected == 0:
        return f"log begins at sequence {seq}, not 0"
    if seq < expected:
        # What a scan by seq 0 makes of a handoff whose first event is lost: its events run on
        # from the previous handoff's.
        return f"log goes back from sequence {expected - 1} to {seq} (another handoff's events?)"
    return f"log skips from sequence {expected - 1} to {seq}"


def _whose(rows: Sequence[StoredRecord]) -> str:
    """`handoff <id>: ` from a stored log's first record, if it can tell."""
    try:
        first = decode_record(rows[0][1])
    except (IndexError, LogCorrupt):
        return ""
    message = first.input if isinstance(first, InputRecord) else first.action
    return f"handoff {message.handoff_id}: "


def _start(message: Input) -> StartHandoff:
    if not isinstance(message, StartHandoff):
        raise LogCorrupt("log does not begin with a start")
    return message


def _divergence(
    step: int,
    record: InputRecord,
    logged: Sequence[Action],
    rederived: Sequence[Action],
    detail: str | None = None,
) -> Divergence:
    return Divergence(
        handoff_id=record.input.handoff_id,
        step=step,
        at_ms=record.at_ms,
        input=record.input,
        logged=tuple(logged),
        rederived=tuple(rederived),
        detail=detail or _first_difference(logged, rederived),
    )


def _first_difference(logged: Sequence[Action], rederived: Sequence[Action]) -> str:
    for position, (old, new) in enumerate(zip(logged, rederived, strict=False)):
        if old == new:
            continue
        where = f"action {position + 1} of the step"
        old_tag, new_tag = old.__struct_config__.tag, new.__struct_config__.tag
        if old_tag != new_tag:
            return f"{where}: logged {old_tag}, re-derived {new_tag}"
        fields = [
            f"{name} logged {getattr(old, name)!r}, re-derived {getattr(new, name)!r}"
            for name in old.__struct_fields__
            if getattr(old, name) != getattr(new, name)
        ]
        return f"{where} ({old_tag}): {'; '.join(fields)}"
    if len(logged) > len(rederived):
        extra = logged[len(rederived)]
        return f"logged {extra.__struct_config__.tag}#{extra.action_id}, re-derived nothing"
    extra = rederived[len(logged)]
    return f"re-derived {extra.__struct_config__.tag}#{extra.action_id}, logged nothing"
