"""Replaying a handoff's log through the coordinator: rebuild, timeline, verify.

Only accepted inputs are logged, and an accepted input does the same thing every time it is
applied to the same state, so feeding a handoff's `InputRecord`s, in sequence order, to a fresh
coordinator rebuilds exactly the coordinator that logged them. The first input of every
handoff's log is its `StartHandoff`, and the `ActionRecord`s that follow an input, up to the
next input, are the actions that input issued.

There is one walk over a log, `Replay`: it checks the log's shape (sequence numbers from 0 with
no gaps, a start first, no action before it), applies each input to one coordinator and
re-derives the step's actions beside the logged ones. Four entry points read a log through it:

- `rebuild`: the coordinator after every logged input, raising `ReplayDivergence` at the first
  step whose re-derived actions are not the logged ones (what the worker's recovery uses: a
  coordinator change that no longer matches the log is an error, not a silent adoption).
- `timeline`: one `Step` per logged input, as data: the input, which fields of the
  coordinator's `CoordinatorState` it changed (a field of one of its four records is named
  `record.field`, such as `source.held`), the actions the current coordinator derives and the
  actions that were logged; `until` stops after a given step and keeps the full state there.
- `find_divergence` / `verify`: re-derive every action and compare it with the logged one
  (kind, action id, every field, order). The first step where they differ is a `Divergence`,
  returned as data or raised as `ReplayDivergence`. This is the check that makes a coordinator
  change safe to deploy against existing logs.
- `check_stored`: everything `kvhandoff verify` checks in one handoff's log as stored (encoded
  records, with the digest stored beside each input): records that do not decode, a sequence
  that is not one handoff's log, inputs whose stored digest is not their own, and the first
  divergence. It is `verify`'s hot loop: a fast path that only confirms, byte for byte, that
  each logged action is the re-derived one; at the first doubt the log goes through the walk.

Steps are numbered by the `seq` of their input in the log. A log is given as `(seq, record)`
pairs of one handoff, in sequence order; sequence numbers count from 0 without gaps. A log that
breaks those rules raises `LogCorrupt` (`check_stored` returns it as data instead, so that a
whole log can be checked past its first bad handoff). Nothing here logs: a replay of a million
events must stay quiet.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple
from uuid import UUID

import msgspec
from msgspec import Struct

from kvhandoff.events.codec import decode_record, encode_record, input_digest
from kvhandoff.events.coordinator import CoordinatorState, HandoffCoordinator, Waiting
from kvhandoff.events.errors import InputRejected, LogCorrupt, ReplayDivergence
from kvhandoff.events.messages import Action, Input, StartHandoff
from kvhandoff.events.records import ActionRecord, InputRecord, LogRecord

#: One entry of a handoff's log: its sequence number and the decoded record.
LoggedRecord = tuple[int, LogRecord]
#: The same, as stored: the sequence number, the digest stored with an input (None for an
#: action), and the record encoded by `events.codec.encode_record`.
StoredRecord = tuple[int, bytes | None, bytes]

_STATE_FIELDS: tuple[str, ...] = CoordinatorState.__struct_fields__


class Replayed(NamedTuple):
    """One step of the walk: a logged input, what it logged, and what it re-derives now."""

    seq: int
    record: InputRecord
    logged: tuple[Action, ...]
    rederived: tuple[Action, ...]
    rejection: InputRejected | None  # the coordinator now refuses the logged input

    def divergence(self) -> Divergence | None:
        if self.rejection is not None:
            detail = f"the coordinator now rejects the logged input: {self.rejection.reason}"
            return _divergence(self.seq, self.record, self.logged, (), detail)
        if self.rederived != self.logged:
            return _divergence(self.seq, self.record, self.logged, self.rederived)
        return None


class Replay:
    """The one walk over a handoff's log: iterate it for its steps; afterwards `start` and
    `coordinator` are the handoff's start and its coordinator after every logged input.

    Raises `LogCorrupt` (while iterating) if the log is empty, does not begin with the
    handoff's start, begins with an action, or skips a sequence number.
    """

    def __init__(self, log: Iterable[LoggedRecord]) -> None:
        self._log = log
        self._coordinator: HandoffCoordinator | None = None
        self._start: StartHandoff | None = None

    def __iter__(self) -> Iterator[Replayed]:
        for seq, record, logged in _steps(self._log):
            message = record.input
            if self._coordinator is None:
                self._start = _start(message)
                self._coordinator = HandoffCoordinator.for_start(self._start)
            try:
                rederived, rejection = tuple(self._coordinator.handle(message)), None
            except InputRejected as exc:
                rederived, rejection = (), exc
            yield Replayed(seq, record, tuple(logged), rederived, rejection)

    @property
    def start(self) -> StartHandoff:
        assert self._start is not None, "walk the log first"
        return self._start

    @property
    def coordinator(self) -> HandoffCoordinator:
        assert self._coordinator is not None, "walk the log first"
        return self._coordinator


def rebuild(log: Iterable[LoggedRecord]) -> tuple[StartHandoff, HandoffCoordinator]:
    """The handoff's start command and its coordinator after every logged input.

    Raises `ReplayDivergence` at the first step whose re-derived actions differ from the logged
    ones (or whose input the coordinator now refuses), and `LogCorrupt` for a log of the wrong
    shape.
    """
    replay = Replay(log)
    for step in replay:
        divergence = step.divergence()
        if divergence is not None:
            raise divergence.error()
    return replay.start, replay.coordinator


# --- Timeline -------------------------------------------------------------------------------


class Change(Struct, frozen=True):
    """One field of `CoordinatorState` that a step changed: `mode`, say, or `source.held` for a
    field of one of its records."""

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
    """The fields of the state that differ, in declaration order; within a record that
    differs, each of its fields that does, as `record.field`."""
    astuple = msgspec.structs.astuple
    changes: list[Change] = []
    for name, old, new in zip(_STATE_FIELDS, astuple(before), astuple(after), strict=True):
        if old == new:
            continue
        if not isinstance(old, Struct):
            changes.append(Change(name, old, new))
            continue
        # One of the four records: each of its fields that changed.
        fields = old.__struct_fields__
        for field, o, n in zip(fields, astuple(old), astuple(new), strict=True):
            if o != n:
                changes.append(Change(f"{name}.{field}", o, n))
    return tuple(changes)


def timeline(log: Iterable[LoggedRecord], *, until: int | None = None) -> Timeline:
    """Replay a handoff's log, one `Step` per input, stopping after step `until` if given.

    Raises `LogCorrupt` if the log is empty, does not begin with the handoff's start, skips a
    sequence number, or (with `until`) has no input at or before that step.
    """
    replay = Replay(log)
    steps = []
    state: CoordinatorState | None = None
    waiting: tuple[Waiting, ...] = ()
    outstanding: tuple[int, ...] = ()
    for step in replay:
        if until is not None and step.seq > until:
            break  # the walk has applied this step already: the state was kept before it
        coordinator = replay.coordinator
        if state is None:
            state = HandoffCoordinator.for_start(replay.start).snapshot()  # before the start
        after = coordinator.snapshot()
        steps.append(
            Step(
                step=step.seq,
                at_ms=step.record.at_ms,
                input=step.record.input,
                changes=diff(state, after),
                actions=step.rederived,
                logged=step.logged,
                state=coordinator.describe(),
                rejection=None if step.rejection is None else step.rejection.reason,
            )
        )
        state = after
        waiting = tuple(coordinator.waiting_for())
        outstanding = tuple(a.action_id for a in coordinator.outstanding())
    if state is None:
        raise LogCorrupt(f"no step at or before {until}")
    return Timeline(
        handoff_id=replay.start.handoff_id,
        start=replay.start,
        steps=tuple(steps),
        state=state,
        waiting=waiting,
        outstanding=outstanding,
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
    for step in Replay(log):
        divergence = step.divergence()
        if divergence is not None:
            return divergence
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
