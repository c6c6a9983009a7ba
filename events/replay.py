"""Replaying a handoff's log through the coordinator: rebuild, timeline, verify.

Only accepted inputs are logged, and an accepted input does the same thing every time it is
applied to the same state, so feeding a handoff's `InputRecord`s, in sequence order, to a fresh
coordinator rebuilds exactly the coordinator that logged them. The first input of every
handoff's log is its `StartHandoff`, and the `ActionRecord`s that follow an input, up to the
next input, are the actions that input issued. Four entry points read a log that way:

- `rebuild`: the coordinator after every logged input (what the worker's recovery uses).
- `timeline`: one `Step` per logged input, as data: the input, which fields of the
  coordinator's `CoordinatorState` it changed, the actions the current coordinator derives and
  the actions that were logged; `until` stops after a given step and keeps the full state there.
- `find_divergence` / `verify`: re-derive every action and compare it with the logged one
  (kind, action id, every field, order). The first step where they differ is a `Divergence`,
  returned as data or raised as `ReplayDivergence`. This is the check that makes a coordinator
  change safe to deploy against existing logs.
- `check_stored`: everything `kvhandoff verify` checks in one handoff's log as stored (encoded
  records, with the digest stored beside each input): records that do not decode, a sequence
  that is not one handoff's log, inputs whose stored digest is not their own, and the first
  divergence. It is `verify`'s hot loop: it takes no snapshots and decodes no logged action
  that is byte for byte the re-derived one.

Steps are numbered by the `seq` of their input in the log. A log is given as `(seq, record)`
pairs of one handoff, in sequence order; sequence numbers count from 0 without gaps. A log that
breaks those rules raises `LogCorrupt` (`check_stored` returns it as data instead, so that a
whole log can be checked past its first bad handoff). Nothing here logs: a replay of a million
events must stay quiet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any
from uuid import UUID

import msgspec
from msgspec import Struct

from events.codec import decode_record, encode_record, input_digest
from events.coordinator import CoordinatorState, HandoffCoordinator, Waiting
from events.errors import InputRejected, LogCorrupt, ReplayDivergence
from events.messages import Action, Input, StartHandoff
from events.records import ActionRecord, InputRecord, LogRecord

#: One entry of a handoff's log: its sequence number and the decoded record.
LoggedRecord = tuple[int, LogRecord]
#: The same, as stored: the sequence number, the digest stored with an input (None for an
#: action), and the record encoded by `events.codec.encode_record`.
StoredRecord = tuple[int, bytes | None, bytes]

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


class StoredCheck(Struct, frozen=True):
    """What `check_stored` found wrong with one handoff's stored log; nothing at all if `ok`.

    `corrupt` holds each record that does not decode, as (seq, why). `malformed` says why the
    log is not one handoff's log in sequence order (it skips or repeats a sequence number, does
    not begin at 0 with the handoff's start, begins with an action). `digest_mismatches` are
    the seqs of the inputs whose stored digest is not `events.codec.input_digest` of the input.
    `divergence` is the first step whose re-derived actions differ from the logged ones; a log
    with corrupt records or a malformed sequence is not replayed, so it has none.
    """

    corrupt: tuple[tuple[int, str], ...] = ()
    malformed: str | None = None
    digest_mismatches: tuple[int, ...] = ()
    divergence: Divergence | None = None

    @property
    def ok(self) -> bool:
        return not (self.corrupt or self.malformed or self.digest_mismatches or self.divergence)


_OK = StoredCheck()


def check_stored(rows: Sequence[StoredRecord], *, digests: bool = True) -> StoredCheck:
    """Check one handoff's log as stored: decoding, sequence, input digests and replay.

    With `digests` false (a log that keeps no digests, such as a JSONL export), the stored
    digests are not compared; otherwise an input stored without a digest is a mismatch.

    The fast path replays the stored records directly: a logged action is not decoded when its
    stored bytes equal the encoding of the re-derived action stamped with its input's time,
    since equal encodings are equal records. When it passes, the rows are one handoff's log in
    order from its start: every input was accepted by the coordinator of the first (which
    refuses another handoff's inputs), and every action is byte for byte one that it issued.
    Anything else (a difference, an extra or missing action, a rejected input, a digest that
    does not match, a record of an older schema version, a different timestamp) sends the log
    through the slow path, which decodes every record and decides and describes.
    """
    decode, encode, digest_of = decode_record, encode_record, input_digest
    coordinator: HandoffCoordinator | None = None
    pending: list[Action] = []  # the current step's re-derived actions
    count = matched = 0  # how many there are, and how many the log has shown so far
    at_ms = expected = 0
    try:
        for seq, digest, blob in rows:
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
            message = record.input
            if digests and digest != digest_of(message):
                break
            if coordinator is None:
                if not isinstance(message, StartHandoff):
                    break
                coordinator = HandoffCoordinator.for_start(message)
            pending = coordinator.handle(message)
            count, matched, at_ms = len(pending), 0, record.at_ms
        else:
            if coordinator is not None and matched == count:
                return _OK
    except (InputRejected, LogCorrupt):
        pass
    return _check_decoded(rows, digests)


def _check_decoded(rows: Sequence[StoredRecord], digests: bool) -> StoredCheck:
    """`check_stored`'s slow path: decode everything, then check what can be checked."""
    corrupt: list[tuple[int, str]] = []
    mismatches: list[int] = []
    records: list[LoggedRecord] = []
    for seq, digest, blob in rows:
        try:
            record = decode_record(blob)
        except LogCorrupt as exc:
            corrupt.append((seq, str(exc)))
            continue
        records.append((seq, record))
        if digests and isinstance(record, InputRecord) and digest != input_digest(record.input):
            mismatches.append(seq)
    malformed = divergence = None
    if corrupt:
        # Without every record, only the numbering can still be checked.
        malformed = next(
            (_sequence_error(i, seq) for i, (seq, _, _) in enumerate(rows) if seq != i), None
        )
    else:
        try:
            divergence = find_divergence(records)
        except LogCorrupt as exc:
            malformed = str(exc)
    return StoredCheck(tuple(corrupt), malformed, tuple(mismatches), divergence)


def verify(log: Iterable[LoggedRecord]) -> None:
    """Like `find_divergence`, but raise the first divergence as `ReplayDivergence`."""
    divergence = find_divergence(log)
    if divergence is not None:
        raise divergence.error()


def _sequence_error(expected: int, seq: int) -> str:
    if expected == 0:
        return f"log begins at sequence {seq}, not 0"
    if seq < expected:
        return f"log goes back from sequence {expected - 1} to {seq}"
    return f"log skips from sequence {expected - 1} to {seq}"


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
