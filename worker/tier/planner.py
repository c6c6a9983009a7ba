"""A partition's batch step without IO: fetched inputs and the handoffs in memory in, a plan out.

Theory of operation
-------------------
A partition's owner handles its inputs a batch at a time (worker.tier.owner). This module
decides what one batch does; `worker.tier.partition` carries the decision out and owns every
wait: its `decide` plans a batch, the owner appends the plan's rows to the partition's
replicated log, and its `act` then arms the plan's timers, queues the rows for the local file
and publishes. A batch is planned in two calls, with the one read the plan may need between
them:

    decoded = planner.decode(deliveries)     # bytes -> inputs; refuses what cannot be read
    loaded  = await log.load(planner.missing(decoded))   # handoffs not in memory (the partition)
    plan    = planner.plan(deliveries, decoded, loaded, now_ms, now_s)

`plan` applies every accepted input to its handoff's coordinator in stream order, so the
handoffs in memory are left as they will be once the plan's batch is appended. The plan holds:

- `batch`: the rows of the batch (inputs, the actions they issued, handoff rows, rejections,
  quarantines), which the replicated log and then the local file take;
- `publish`: the actions to publish once those rows are appended;
- `rejections`: each refused input with the rejection to publish. A refused input is settled
  as an accepted one is: its rejection is in the batch's rows, so the owner acknowledges it
  once they are appended, and JetStream never delivers it again;
- `naks`: early inputs, with their delay: not appended, given back to come again;
- the timers to change: deadlines of new handoffs, retries an outcome answered, deadlines of
  handoffs that left memory;
- the tallies for the metrics.

Invariants
----------
- Only accepted inputs reach `batch`, each with the actions it issued, at the handoff's next
  sequence numbers: planning a run of deliveries in one batch or one at a time gives the same
  rows (the property test in tests/worker/test_planner.py).
- Each delivery is either deferred (in `naks`, once) or settled by the batch's rows (applied,
  dropped as a duplicate, or rejected: in `rejections`, once); none is left out.
- Nothing an input carries can raise out of `plan`: a failure while applying one input rejects
  it and quarantines its handoff (its coordinator may be half changed), and the rest of the
  batch goes on.
- Early inputs (a fact before the input it depends on, or for a handoff not started yet) wait
  for a redelivery, but at most `defer_budget` at once and for at most `DEFER_LIMIT` deliveries:
  each one holds an unacknowledged slot of the consumer while it waits.
- A handoff that ended and takes an input again (a late `Canceled` reopens it, a late outcome
  is logged after its end) was loaded from the file: its entry carries the history it logged
  before (`Batch.carry`), since a snapshot taken after it ended holds its tombstone alone, and a
  file caught up from that snapshot would otherwise hold its events from this entry on.
- A handoff that ended never takes an input on a prefix of its history: one whose file row
  ended by a snapshot's tombstone (its end is in entries the file never had), or whose
  tombstone holds inputs its file lacks (logged after its end in entries the file never had),
  is answered by that tombstone, as if the file lacked its rows (`Planner._ended_elsewhere`).
- If the plan's rows are not appended (fenced, or in doubt), memory is ahead of the log: the
  service rebuilds the handoffs from the log (`adopt`) at the next claim, before it plans again.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from uuid import UUID

import msgspec

from kvhandoff.events.codec import decode_input, input_digest
from kvhandoff.events.coordinator import HandoffCoordinator
from kvhandoff.events.errors import HandoffError, InputRejected, ReplayDivergence
from kvhandoff.events.messages import (
    Action,
    ActionOutcome,
    HandoffCompletion,
    Input,
    Rejection,
    StartHandoff,
)
from kvhandoff.events.records import ActionRecord, InputRecord
from kvhandoff.events.replay import rebuild
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.log.rows import (
    Batch,
    CorruptHandoff,
    HandoffLog,
    HandoffRow,
    Loaded,
    Tombstone,
)
from kvhandoff.worker.log.schema import HandoffState

logger = logging.getLogger(__name__)

# Why an input for a handoff the partition does not know is deferred, then refused.
UNKNOWN_HANDOFF = "no such handoff (not started)"
DEFER_LIMIT = 12  # deliveries before an early input is rejected: well past twice the ack wait
REJECTED_PAYLOAD_LIMIT = 2048  # bytes of a refused input quoted in its published rejection
# Bytes of a refused input kept in the log: any more, and one input of the bus's largest size
# (a megabyte by default) would make a log entry larger than the bus carries (worker.tier.service).
LOGGED_PAYLOAD_LIMIT = 64 * 1024
_ENDED = (HandoffState.SUCCEEDED, HandoffState.CANCELED)


def rejection_for(handoff_id: UUID | None, reason: str, data: bytes) -> Rejection:
    """The rejection published for a refused input: why, and the start of its bytes (as text,
    whatever they are), from the planner's round or, republished, from the logged row."""
    return Rejection(handoff_id, reason, data[:REJECTED_PAYLOAD_LIMIT].decode(errors="replace"))


class Delivery(Protocol):
    """What the planner reads of a fetched input (`worker.bus.pull.Inbound` is one)."""

    @property
    def data(self) -> bytes: ...
    @property
    def subject(self) -> str: ...
    @property
    def deliveries(self) -> int: ...
    @property
    def stream_seq(self) -> int: ...


@dataclass(slots=True)
class OpenHandoff:
    """A handoff in memory: its coordinator and what the log knows of it."""

    start: StartHandoff
    coordinator: HandoffCoordinator
    row: HandoffRow
    digests: set[bytes]
    # Its id as its subject and its rows spell it, made once: `str` of a UUID is a Python
    # call, and every input and event of the handoff needs the text (bench/README.md).
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = str(self.start.handoff_id)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A delivery that is not an input the planner can apply: why, and whose it seems to be."""

    handoff_id: UUID | None
    reason: str
    label: str


@dataclass(slots=True)
class Decoded:
    """A batch after decoding, in delivery order: each delivery's input, or why it has none."""

    items: list[Input | Refusal] = field(default_factory=list)

    @property
    def inputs(self) -> Iterable[Input]:
        return (item for item in self.items if not isinstance(item, Refusal))


@dataclass(slots=True)
class Plan:
    batch: Batch = field(default_factory=Batch)
    publish: list[tuple[HandoffRow, int, Action]] = field(default_factory=list)
    rejections: list[tuple[int, Rejection]] = field(default_factory=list)  # delivery, why
    naks: list[tuple[int, float]] = field(default_factory=list)
    new_deadlines: list[tuple[UUID, float]] = field(default_factory=list)  # handoff, due (s)
    answered: list[tuple[UUID, int]] = field(default_factory=list)
    left_memory: list[UUID] = field(default_factory=list)
    ended: list[Tombstone] = field(default_factory=list)  # of the handoffs it ended
    inputs: Counter[str] = field(default_factory=Counter)
    issued: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0


@dataclass(frozen=True, slots=True)
class _Round:
    """One call of `Planner.plan`: the plan it builds and what every input in it shares."""

    plan: Plan
    deliveries: Sequence[Delivery]
    now_ms: int
    now_s: float
    # Handoffs loaded for this plan that ended in entries their file never had, by the
    # tombstone they are known by (see `_ended_elsewhere`).
    ended: dict[UUID, Tombstone] = field(default_factory=dict)


class Planner:
    """The handoffs in memory and the rules that apply a batch of inputs to them."""

    def __init__(
        self,
        subjects: Subjects,
        defer_budget: int,
        ack_wait_s: float,
        *,
        tombstone_ttl_ms: int | None = None,
    ) -> None:
        self.subjects = subjects
        self.defer_budget = defer_budget
        self.ack_wait_s = ack_wait_s
        self.open: dict[UUID, OpenHandoff] = {}
        self.quarantined: set[UUID] = set()
        # Handoffs that ended lately, for a late input that names one whose rows the local
        # file lacks, or holds in part (it was caught up from a snapshot): see `_too_late`.
        # The worker cuts it to its --tombstone-ttl (None: keeps none), oldest first.
        self.tombstone_ttl_ms = tombstone_ttl_ms
        self.tombstones: dict[UUID, Tombstone] = {}
        # Early inputs waiting for their redelivery: stream sequence -> when it is due back.
        self.deferred: dict[int, float] = {}
        # Engine leases (worker.tier.leases): why a start is refused (an engine is gone), or None.
        self.admit: Callable[[StartHandoff], str | None] | None = None

    # --- The two steps --------------------------------------------------------------------

    def decode(self, deliveries: Sequence[Delivery]) -> Decoded:
        decoded = Decoded()
        for delivery in deliveries:
            self.deferred.pop(delivery.stream_seq, None)  # it came back
            try:
                message = decode_input(delivery.data)
            except msgspec.DecodeError as exc:
                named = self.subjects.input_handoff(delivery.subject)
                decoded.items.append(Refusal(named, f"undecodable input: {exc}", "undecodable"))
                continue
            # The canonical subject, not just the same id: a partitioned stream maps every
            # input of a handoff to one place by its subject, so each handoff has exactly one.
            handoff = self.open.get(message.handoff_id)
            named_as = message.handoff_id if handoff is None else handoff.key
            if delivery.subject != self.subjects.input(named_as):
                named = self.subjects.input_handoff(delivery.subject)
                reason = (
                    f"the subject {delivery.subject} is not the input subject of handoff"
                    f" {message.handoff_id}, which the input names"
                )
                decoded.items.append(Refusal(named, reason, "subject"))
                continue
            decoded.items.append(message)
        return decoded

    def missing(self, decoded: Decoded) -> list[UUID]:
        """Handoffs the batch names that are in neither memory nor quarantine: load these."""
        named = {message.handoff_id for message in decoded.inputs}
        return [h for h in named if h not in self.open and h not in self.quarantined]

    def plan(
        self,
        deliveries: Sequence[Delivery],
        decoded: Decoded,
        loaded: Mapping[UUID, Loaded],
        now_ms: int,
        now_s: float,
    ) -> Plan:
        """Apply the decoded batch."""
        r = _Round(Plan(), deliveries, now_ms, now_s)
        self._forget_tombstones(now_ms)
        # Handoffs loaded only to check an input against their log leave memory again.
        visiting = []
        for adopted in self.adopt(loaded.values(), r.plan.batch, now_ms):
            if (tombstone := self._ended_elsewhere(adopted)) is None:
                visiting.append(adopted)
            else:
                del self.open[tombstone.handoff_id]
                r.ended[tombstone.handoff_id] = tombstone
        touched: dict[UUID, OpenHandoff] = {}
        for index, item in enumerate(decoded.items):
            if isinstance(item, Refusal):
                self._reject(r, index, item.handoff_id, item.reason, label=item.label)
            elif (handoff := self._apply(r, index, item)) is not None:
                touched[item.handoff_id] = handoff
        for handoff_id, handoff in touched.items():
            r.plan.batch.upsert_handoff(handoff.row)  # its row as this batch leaves it
            if isinstance(logged := loaded.get(handoff_id), HandoffLog):
                # Not in memory, so it had ended: the entry carries what it logged before,
                # which a snapshot since knows nothing of but its tombstone (seeds 3000, 3003).
                r.plan.batch.carry(logged)
            if not handoff.coordinator.is_complete:
                # Reopened (a late `Canceled` after it succeeded), its tombstone says an ending
                # it no longer has: a snapshot would carry it beside the open row (seed 200).
                self.tombstones.pop(handoff_id, None)
        for handoff in [*touched.values(), *visiting]:
            if handoff.coordinator.is_complete:
                handoff_id = handoff.start.handoff_id
                if self.open.pop(handoff_id, None) is not None:
                    r.plan.left_memory.append(handoff_id)
                self._entomb(handoff, r.plan, now_ms)
        return r.plan

    def _ended_elsewhere(self, handoff: OpenHandoff) -> Tombstone | None:
        """The tombstone a loaded handoff is known by if its file holds only a prefix of its
        history, else None: if it ended in entries its file never had (its row says it ended,
        but its events rebuild it unfinished), or took inputs after its end in entries its
        file never had (its events end it, but its tombstone holds digests they lack).

        A claim that caught the file up from a snapshot ended the row the file held open as the
        snapshot's tombstone says, and kept the prefix of its history the file had
        (`Batch.merge`, worker.log.store). Rebuilt from that prefix, it would take a late input
        (a redelivered outcome) as new and reopen; so its tombstone answers instead
        (`_too_late`): the planner's, which holds the digests of all its inputs, or, past its
        life, one made from its row, which holds those of the prefix.

        A file that held the handoff ended keeps its rows as they are through that catch-up,
        though an owner since may have logged late inputs after the end (entries that carry
        its history, but lie before the snapshot). Its next late input would be logged at the
        sequence numbers the log gave those, as other events (sim seed 3003); so the tombstone
        answers it too, while it lives. Past its life, nothing tells that prefix from the whole
        history."""
        row = handoff.row
        if row.state not in _ENDED:
            return None
        handoff_id = handoff.start.handoff_id
        tombstone = self.tombstones.get(handoff_id)
        if handoff.coordinator.is_complete:
            if tombstone is None or handoff.digests.issuperset(tombstone.digests):
                return None
            return tombstone
        if tombstone is None:
            ended_ms = row.completed_at_ms or row.updated_at_ms
            tombstone = Tombstone(handoff_id, row.state_name, ended_ms, sorted(handoff.digests))
        return tombstone

    def _entomb(self, handoff: OpenHandoff, plan: Plan, now_ms: int) -> None:
        """Keep the tombstone of a handoff that ended, for its life (see `tombstones`), and
        give it to the plan, whose log entry carries it (so that a claim reads it there)."""
        if self.tombstone_ttl_ms is None:
            return
        row = handoff.row
        ended_ms = row.completed_at_ms or row.updated_at_ms
        if ended_ms >= now_ms - self.tombstone_ttl_ms:
            tombstone = Tombstone(
                handoff.start.handoff_id, row.state_name, ended_ms, sorted(handoff.digests)
            )
            # Last, as the newest: `_forget_tombstones` drops them in the order they ended.
            self.tombstones.pop(tombstone.handoff_id, None)
            self.tombstones[tombstone.handoff_id] = tombstone
            plan.ended.append(tombstone)

    def _forget_tombstones(self, now_ms: int) -> None:
        """Drop the tombstones past their life, the oldest first (they are kept in the order
        their handoffs ended, so this stops at the first one still alive)."""
        if self.tombstone_ttl_ms is None:
            return
        cut = now_ms - self.tombstone_ttl_ms
        while self.tombstones:
            oldest = next(iter(self.tombstones.values()))
            if oldest.completed_at_ms >= cut:
                return
            del self.tombstones[oldest.handoff_id]

    # --- Handoffs in and out of memory ----------------------------------------------------

    def adopt(
        self, loaded: Iterable[Loaded], batch: Batch, now_ms: int, *, diverging: bool = False
    ) -> list[OpenHandoff]:
        """Bring logged handoffs into memory, quarantining (in `batch`) those that cannot be
        rebuilt from their log; the adopted ones are returned. With `diverging`, a log that this
        build's coordinator re-derives differently raises `ReplayDivergence` instead."""
        adopted = []
        for logged in loaded:
            if isinstance(logged, CorruptHandoff):
                self.quarantine(batch, now_ms, logged.handoff_id, logged.reason)
                continue
            handoff_id = logged.handoff.handoff_id
            try:
                start, coordinator = rebuild((event.seq, event.record) for event in logged.events)
            except ReplayDivergence:
                if diverging:
                    raise
                self.quarantine(batch, now_ms, handoff_id, "its log diverges from this build")
                continue
            except HandoffError as exc:
                self.quarantine(batch, now_ms, handoff_id, f"cannot rebuild it from its log: {exc}")
                continue
            digests = {e.digest for e in logged.events if e.digest is not None}
            handoff = OpenHandoff(start, coordinator, logged.handoff, digests)
            self.open[handoff_id] = handoff
            adopted.append(handoff)
        return adopted

    def quarantine(self, batch: Batch, now_ms: int, handoff_id: UUID, reason: str) -> None:
        logger.error("handoff %s: quarantined: %s", handoff_id, reason)
        self.open.pop(handoff_id, None)
        self.quarantined.add(handoff_id)
        batch.quarantine(now_ms, handoff_id, reason)

    # --- One input ------------------------------------------------------------------------

    def _apply(self, r: _Round, index: int, message: Input) -> OpenHandoff | None:
        """Apply one input; the handoff if the input was accepted (and so logged)."""
        plan, handoff_id = r.plan, message.handoff_id
        if handoff_id in self.quarantined:
            self._reject(r, index, handoff_id, "handoff is quarantined", label="quarantined")
            return None
        handoff = self.open.get(handoff_id)
        if (
            handoff is None
            and (tombstone := r.ended.get(handoff_id, self.tombstones.get(handoff_id))) is not None
        ):
            self._too_late(r, index, message, tombstone)
            return None
        if handoff is None:
            if not isinstance(message, StartHandoff):
                reason = UNKNOWN_HANDOFF
                self._early(r, index, handoff_id, reason, label="unknown")
                return None
            refusal = None if self.admit is None else self.admit(message)
            if refusal is not None:
                self._reject(r, index, handoff_id, refusal, label="engine")
                return None
            handoff = self._open_new(plan, message, r.now_ms)
        try:
            digest = input_digest(message)
            if digest in handoff.digests:
                plan.duplicates += 1
                return None
            if isinstance(message, StartHandoff) and handoff.row.last_seq >= 0:
                reason = "handoff already started differently"
                self._reject(r, index, handoff_id, reason, label="restart")
                return None
            try:
                actions = handoff.coordinator.handle(message)
            except InputRejected as exc:
                if exc.premature:
                    self._early(r, index, handoff_id, str(exc), label="premature")
                else:
                    self._reject(r, index, handoff_id, str(exc), label="coordinator")
                return None
            handoff.digests.add(digest)
            seq = handoff.row.last_seq + 1
            plan.batch.append_input(seq, InputRecord(r.now_ms, message), handoff.key)
            for action in actions:
                seq += 1
                plan.batch.append_action(seq, ActionRecord(r.now_ms, action), handoff.key)
                plan.publish.append((handoff.row, seq, action))
                plan.issued[str(action.__struct_config__.tag)] += 1
        except Exception as exc:
            # A bug must cost one handoff, not the worker. The coordinator may be half
            # changed, so the handoff is set aside rather than trusted again.
            logger.exception("handoff %s: failed to apply an input", handoff_id)
            self.quarantine(plan.batch, r.now_ms, handoff_id, f"internal error: {exc!r}")
            self._reject(r, index, handoff_id, f"internal error: {exc!r}", label="internal")
            return None
        if isinstance(message, ActionOutcome):
            plan.answered.append((handoff_id, message.action_id))
        plan.inputs[str(message.__struct_config__.tag)] += 1
        _project(handoff, seq, r.now_ms)
        return handoff

    def _too_late(self, r: _Round, index: int, message: Input, tombstone: Tombstone) -> None:
        """An input for a handoff that ended and is known by its tombstone alone: answered as
        its whole log would answer it, a duplicate of an input it accepted as a duplicate, and
        anything else (a start again, a late outcome) rejected, as a handoff that ended
        accepts nothing that would start it anew."""
        if input_digest(message) in tombstone.digests:
            r.plan.duplicates += 1
            return
        reason = (
            f"handoff {tombstone.handoff_id} ended ({tombstone.state}) at "
            f"{tombstone.completed_at_ms} ms; it accepts no more inputs"
        )
        self._reject(r, index, message.handoff_id, reason, label="ended")

    def _open_new(self, plan: Plan, start: StartHandoff, now_ms: int) -> OpenHandoff:
        row = HandoffRow(
            handoff_id=start.handoff_id,
            engine_type=start.engine_type.value,
            source=start.source,
            destination=start.destination,
            started_at_ms=now_ms,
            deadline_at_ms=now_ms + start.deadline_ms,
            state=HandoffState.OPEN,
            completed_at_ms=None,
            last_seq=-1,  # nothing logged yet
            updated_at_ms=now_ms,
        )
        handoff = OpenHandoff(start, HandoffCoordinator.for_start(start), row, set())
        self.open[start.handoff_id] = handoff
        plan.new_deadlines.append((start.handoff_id, row.deadline_at_ms / 1000))
        return handoff

    def _reject(
        self, r: _Round, index: int, handoff_id: UUID | None, reason: str, *, label: str
    ) -> None:
        logger.warning("handoff %s: rejected input: %s", handoff_id, reason)
        data = r.deliveries[index].data
        r.plan.batch.reject(r.now_ms, handoff_id, reason, data[:LOGGED_PAYLOAD_LIMIT])
        r.plan.rejections.append((index, rejection_for(handoff_id, reason, data)))
        r.plan.reasons[label] += 1

    def _early(self, r: _Round, index: int, handoff_id: UUID, reason: str, *, label: str) -> None:
        """An input that may be accepted once the one it depends on is: wait, within bounds."""
        delivery = r.deliveries[index]
        if delivery.deliveries >= DEFER_LIMIT:
            reason = f"{reason} (still, after redeliveries)"
            self._reject(r, index, handoff_id, reason, label=label)
        elif not self._may_defer(r.now_s):
            reason = f"{reason} (and too many early inputs wait)"
            self._reject(r, index, handoff_id, reason, label=label)
        else:
            logger.info("handoff %s: deferring an early input: %s", handoff_id, reason)
            delay_s = min(0.05 * 2**delivery.deliveries, self.ack_wait_s / 2)
            self.deferred[delivery.stream_seq] = r.now_s + delay_s + self.ack_wait_s
            r.plan.naks.append((index, delay_s))

    def _may_defer(self, now_s: float) -> bool:
        if len(self.deferred) < self.defer_budget:
            return True
        # Forget inputs that never came back (their delay and an ack wait are long past).
        for seq in [seq for seq, due in self.deferred.items() if due < now_s]:
            del self.deferred[seq]
        return len(self.deferred) < self.defer_budget


def _project(handoff: OpenHandoff, last_seq: int, now_ms: int) -> None:
    """Bring the handoff's row up to date after an accepted input."""
    row = handoff.row
    row.last_seq = last_seq
    row.updated_at_ms = now_ms
    completion = handoff.coordinator.completion
    if not handoff.coordinator.is_complete:
        row.state, row.completed_at_ms = HandoffState.OPEN, None  # may reopen for cleanup
    elif row.state is HandoffState.OPEN:
        row.state = (
            HandoffState.SUCCEEDED
            if completion is HandoffCompletion.SUCCESS
            else HandoffState.CANCELED
        )
        row.completed_at_ms = now_ms
