"""The worker: JetStream inputs in, the SQLite event log, actions out.

One task processes the input stream in batches, in stream order:

    fetch  ->  decode, apply to coordinators  ->  commit (one transaction)  ->  publish actions
           ->  ack inputs (term rejected ones)

so an input is acknowledged only after it is in the log, and an action is published only after
the input that caused it is. A crash anywhere loses nothing acknowledged:

- before the commit: nothing was logged or acknowledged; JetStream redelivers the batch.
- after the commit, before publishing: the actions are in the log unmarked; recovery publishes
  them (the log is the outbox).
- after publishing, before the acks: the inputs are redelivered and dropped as exact
  duplicates, which the log recognises by digest.

A bus that redelivers can reorder: an input delivered to a worker that died is redelivered
after the ack wait, behind newer ones. So an input that arrived before the input it depends on
(the core marks such rejections `premature`, and a fact for a handoff not yet started is one too)
is not rejected at once but redelivered with growing delays, and rejected only if it is still
premature after `_DEFER_LIMIT` deliveries (well past twice the ack wait).

Early inputs may hold at most `batch_size` places in the pipeline: each one waiting for a
redelivery holds an unacknowledged slot of the consumer, so beyond that budget an early input is
rejected at once, and a flood of inputs for handoffs that never started cannot starve the rest.

No input and no handoff can stop the worker. An input that cannot be decoded, names another
handoff than its subject, or is refused is rejected (logged, published on the rejection subject,
terminated). A handoff whose log cannot be rebuilt (an unreadable record, a replay that no longer
holds) is quarantined: its row says so, the reason is kept with the rejections, its inputs are
rejected, and everything else carries on. A failed commit (a full disk) changes nothing: the
batch's inputs are redelivered later, the handoffs it touched are rebuilt from the log, nothing
is republished, commits back off, and health is red until one succeeds again.

Every action is published only after its commit, and marked published only after the server
confirmed it (the barrier in `Bus.flush`). `Complete` goes to JetStream's completion stream
as well, so a frontend that was disconnected can read its handoff's last completion afterwards.

Coordinators of open handoffs live in memory; a completed handoff leaves memory, and an input
for a handoff not in memory loads its log and replays it (one query per batch). A second task
runs the timers: a handoff's deadline publishes a `TimedOut` input to the handoff's own input
subject, so it is logged and replayed like any other input; an action with no outcome after the
retry interval is published again with the same action id, and again after twice as long, up to
`_RETRY_BACKOFF_CAP` intervals, so a slow engine is not buried under its own backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from uuid import UUID

import msgspec

from events.codec import decode_input, encode, input_digest
from events.coordinator import HandoffCoordinator, Mode
from events.errors import HandoffError, InputRejected
from events.messages import (
    Action,
    ActionOutcome,
    Complete,
    HandoffCompletion,
    Input,
    Rejection,
    Role,
    StartHandoff,
    TimedOut,
)
from events.records import ActionRecord, InputRecord
from events.replay import rebuild
from events.subjects import Subjects
from worker.bus import Bus, Inbound
from worker.config import WorkerConfig
from worker.errors import BusError, StoreError
from worker.metrics import Metrics
from worker.schema import HandoffState
from worker.store import Batch, CorruptHandoff, EventLog, HandoffRow, Loaded
from worker.timers import TimerQueue

logger = logging.getLogger(__name__)

_FETCH_TIMEOUT_S = 0.25  # how long an idle worker waits before noticing a stop request
_REJECTED_PAYLOAD_LIMIT = 2048
_DEFER_LIMIT = 12
_RETRY_BACKOFF_CAP = 8
_COMMIT_BACKOFF_S = (0.1, 5.0)  # first and longest pause after a failed commit


@dataclass(slots=True)
class OpenHandoff:
    """A handoff in memory: its coordinator and what the log knows of it."""

    start: StartHandoff
    coordinator: HandoffCoordinator
    row: HandoffRow
    digests: set[bytes]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class Worker:
    def __init__(self, config: WorkerConfig, log: EventLog, bus: Bus, metrics: Metrics) -> None:
        self._config = config
        self._log = log
        self._bus = bus
        self._metrics = metrics
        self._subjects = Subjects(config.nats.subject_prefix)
        self._open: dict[UUID, OpenHandoff] = {}
        self._quarantined: set[UUID] = set()
        self._deadlines: TimerQueue[UUID] = TimerQueue()
        self._retries: TimerQueue[tuple[UUID, int]] = TimerQueue()
        self._attempts: dict[tuple[UUID, int], int] = {}  # publications per outstanding action
        self._timers_changed = asyncio.Event()
        # Outbox marks for actions published since the last commit; they ride on the next one.
        self._published: list[tuple[UUID, int, int]] = []
        # Early inputs waiting for their redelivery: stream sequence -> when it is due back.
        self._deferred: dict[int, float] = {}
        self._commit_failure: str | None = None
        self._commit_backoff_s = _COMMIT_BACKOFF_S[0]
        self.recovered = False

    @property
    def healthy(self) -> bool:
        return self.recovered and self._bus.is_connected and self._commit_failure is None

    async def run(self, stop: asyncio.Event) -> None:
        """Recover, then process inputs until `stop` is set; the batch in hand is finished."""
        await self._recover_when_possible(stop, first_wait_s=0.0)
        timers = asyncio.create_task(self._run_timers(stop), name="kvhandoff-timers")
        try:
            while not stop.is_set():
                try:
                    deliveries = await self._bus.fetch(self._config.batch_size, _FETCH_TIMEOUT_S)
                except BusError as exc:
                    logger.warning("fetch failed, retrying: %s", exc)
                    await asyncio.sleep(_FETCH_TIMEOUT_S)  # NATS is reconnecting; back off
                    continue
                try:
                    if deliveries:
                        await self.process(deliveries)
                    elif self._published:
                        await self._commit(Batch())
                except BusError as exc:
                    # Committed actions may not have reached NATS. The log knows which were
                    # published, so rebuilding from it republishes exactly what is missing.
                    logger.warning("publishing failed (%s); recovering from the log", exc)
                    await self._recover_when_possible(stop)
                except StoreError as exc:
                    await self._commit_failed(exc, deliveries, stop)
        finally:
            timers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timers
            if self._published:
                with contextlib.suppress(StoreError, BusError):
                    await self._commit(Batch())
        logger.info("stopped with %d open handoffs", len(self._open))

    async def _recover_when_possible(self, stop: asyncio.Event, first_wait_s: float = 0.25) -> None:
        wait_s = first_wait_s
        while not stop.is_set():
            await asyncio.sleep(wait_s)  # give NATS a moment to come back
            wait_s = _FETCH_TIMEOUT_S
            try:
                await self.recover()
                return
            except BusError as exc:
                logger.warning("recovery must wait for NATS: %s", exc)

    async def _commit_failed(
        self, exc: StoreError, deliveries: list[Inbound], stop: asyncio.Event
    ) -> None:
        """A commit failed, so nothing of its batch happened: the inputs come back later, the
        handoffs in memory are rebuilt from the log, and nothing is republished."""
        delay_s = self._commit_backoff_s
        self._commit_backoff_s = min(delay_s * 2, _COMMIT_BACKOFF_S[1])
        self._commit_failure = str(exc)
        self._metrics.commit_failures.inc()
        logger.error("commit failed, retrying in %.1fs: %s", delay_s, exc)
        try:
            for delivery in deliveries:
                await delivery.nak(delay_s)
        except BusError as bus_exc:
            logger.warning("could not return the batch (%s); JetStream redelivers it", bus_exc)
        try:
            await self._rebuild_memory()
        except StoreError as read_exc:
            logger.error("cannot read the log either: %s", read_exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay_s)

    # --- Recovery -----------------------------------------------------------------------

    async def recover(self) -> None:
        """Rebuild every open handoff from the log, rearm its timers, and publish the actions
        that were never published or still await an outcome."""
        began = time.perf_counter()
        self._published.clear()  # re-derived below from the log's own marks
        marks = Batch()
        now = _now_ms()
        loaded = await self._rebuild_memory(marks)
        # The backlog may include a closed handoff's last actions (e.g. its Complete); its
        # row is all that routing needs.
        republish: dict[tuple[UUID, int], tuple[HandoffRow, Action]] = {}
        for unpublished in await self._log.unpublished_actions():
            if isinstance(unpublished, CorruptHandoff):
                self._quarantine(marks, now, unpublished.handoff_id, unpublished.reason)
                continue
            action = unpublished.record.action
            republish[(action.handoff_id, action.action_id)] = (unpublished.row, action)
            marks.mark_published(action.handoff_id, unpublished.seq, now)
        for handoff in self._open.values():
            for action in handoff.coordinator.outstanding():
                republish.setdefault((action.handoff_id, action.action_id), (handoff.row, action))
        for row, action in republish.values():
            await self._publish_action(row, action)
        # Marked published only once the server has them: a restart during an outage must
        # publish them again rather than trust a write buffer that died with the process.
        await self._bus.flush()
        await self._log.commit(marks)
        elapsed = time.perf_counter() - began
        self._metrics.recovery_seconds.set(elapsed)
        self._metrics.recovered.set(loaded)
        logger.info(
            "recovered %d open handoffs and published %d actions in %.3fs",
            loaded, len(republish), elapsed,
        )  # fmt: skip
        self.recovered = True

    async def _rebuild_memory(self, batch: Batch | None = None) -> int:
        """Replace what is in memory with the open handoffs of the log and their timers; an
        action still outstanding is due for a retry one interval from now. Returns how many
        handoffs were loaded; those that cannot be rebuilt are quarantined in `batch`."""
        loaded = await self._log.open_handoffs()
        quarantined = await self._log.quarantined()
        self._open.clear()
        self._quarantined = quarantined
        self._deadlines = TimerQueue()
        self._retries = TimerQueue()
        self._attempts.clear()
        self._deferred.clear()
        now = _now_ms()
        retry_at = time.time() + self._config.retry_interval_s
        for logged in loaded.values():
            handoff = self._adopt(logged, batch or Batch(), now)
            if handoff is None:
                continue
            handoff_id = handoff.start.handoff_id
            self._deadlines.schedule(handoff_id, handoff.row.deadline_at_ms / 1000)
            for action in handoff.coordinator.outstanding():
                if not isinstance(action, Complete):
                    self._attempts[(handoff_id, action.action_id)] = 1
                    self._retries.schedule((handoff_id, action.action_id), retry_at)
        self._timers_changed.set()
        self._metrics.open_handoffs.set(len(self._open))
        self._metrics.quarantined.set(len(self._quarantined))
        return len(loaded)

    def _adopt(self, logged: Loaded, batch: Batch, now: int) -> OpenHandoff | None:
        """Bring a logged handoff into memory, or quarantine it if it cannot be rebuilt."""
        if isinstance(logged, CorruptHandoff):
            self._quarantine(batch, now, logged.handoff_id, logged.reason)
            return None
        handoff_id = logged.row.handoff_id
        try:
            start, coordinator = rebuild(event.record for event in logged.events)
        except HandoffError as exc:
            self._quarantine(batch, now, handoff_id, f"cannot rebuild it from its log: {exc}")
            return None
        digests = {e.digest for e in logged.events if e.digest is not None}
        handoff = OpenHandoff(start, coordinator, logged.row, digests)
        self._open[handoff_id] = handoff
        return handoff

    def _quarantine(self, batch: Batch, now: int, handoff_id: UUID, reason: str) -> None:
        logger.error("handoff %s: quarantined: %s", handoff_id, reason)
        self._open.pop(handoff_id, None)
        self._deadlines.cancel(handoff_id)
        self._quarantined.add(handoff_id)
        self._metrics.quarantined.set(len(self._quarantined))
        batch.quarantine(now, handoff_id, reason)

    # --- Inputs -------------------------------------------------------------------------

    async def process(self, deliveries: list[Inbound]) -> None:
        """Apply one fetched batch: decode, coordinate, commit, publish, acknowledge."""
        now = _now_ms()
        batch = Batch()
        acks: list[Inbound] = []
        deferred: list[Inbound] = []
        rejected: list[tuple[Inbound, Rejection]] = []
        outgoing: list[tuple[HandoffRow, int, Action]] = []  # what to publish once committed
        touched: dict[UUID, OpenHandoff] = {}
        inputs: Counter[str] = Counter()
        issued: Counter[str] = Counter()
        completions: Counter[str] = Counter()
        reasons: Counter[str] = Counter()
        duplicates = 0

        def reject(delivery: Inbound, handoff_id: UUID | None, reason: str, label: str) -> None:
            logger.warning("handoff %s: rejected input: %s", handoff_id, reason)
            batch.reject(now, handoff_id, reason, delivery.data)
            payload = delivery.data[:_REJECTED_PAYLOAD_LIMIT].decode(errors="replace")
            rejected.append((delivery, Rejection(handoff_id, reason, payload)))
            reasons[label] += 1

        def premature(delivery: Inbound, handoff_id: UUID, reason: str, label: str) -> None:
            if delivery.deliveries >= _DEFER_LIMIT:
                reject(delivery, handoff_id, f"{reason} (still, after redeliveries)", label)
            elif not self._may_defer(delivery):
                reject(delivery, handoff_id, f"{reason} (and too many early inputs wait)", label)
            else:
                logger.info("handoff %s: deferring an early input: %s", handoff_id, reason)
                deferred.append(delivery)

        decoded: list[tuple[Inbound, Input]] = []
        for delivery in deliveries:
            self._deferred.pop(delivery.stream_seq, None)
            named = self._subjects.input_handoff(delivery.subject)
            try:
                message = decode_input(delivery.data)
            except msgspec.DecodeError as exc:
                reject(delivery, named, f"undecodable input: {exc}", "undecodable")
                continue
            # The canonical subject, not just the same id: a partitioned stream maps every input
            # of a handoff to one place by its subject, so each handoff has exactly one.
            if delivery.subject != self._subjects.input(message.handoff_id):
                reject(
                    delivery, named,
                    f"input for handoff {message.handoff_id} sent to {delivery.subject}",
                    "subject",
                )  # fmt: skip
                continue
            decoded.append((delivery, message))
        loaded = await self._load_missing({message.handoff_id for _, message in decoded}, batch)

        for delivery, message in decoded:
            handoff_id = message.handoff_id
            if handoff_id in self._quarantined:
                reject(delivery, handoff_id, "handoff is quarantined", "quarantined")
                continue
            handoff = self._open.get(handoff_id)
            if handoff is None:
                if not isinstance(message, StartHandoff):
                    premature(delivery, handoff_id, "no such handoff (not started)", "unknown")
                    continue
                handoff = self._open_new(message, now)
            try:
                digest = input_digest(message)
                if digest in handoff.digests:
                    duplicates += 1
                    acks.append(delivery)
                    continue
                if isinstance(message, StartHandoff) and handoff.row.last_seq >= 0:
                    reject(delivery, handoff_id, "handoff already started differently", "restart")
                    continue
                try:
                    actions = handoff.coordinator.handle(message)
                except InputRejected as exc:
                    if exc.premature:
                        premature(delivery, handoff_id, str(exc), "premature")
                    else:
                        reject(delivery, handoff_id, str(exc), "coordinator")
                    continue
                handoff.digests.add(digest)
                seq = handoff.row.last_seq + 1
                batch.append_input(seq, InputRecord(now, message), digest)
                for action in actions:
                    seq += 1
                    batch.append_action(seq, ActionRecord(now, action))
                    outgoing.append((handoff.row, seq, action))
                    issued[str(action.__struct_config__.tag)] += 1
            except Exception as exc:
                # A bug must cost one handoff, not the worker. The coordinator may be half
                # changed, so the handoff is set aside rather than trusted again.
                logger.exception("handoff %s: failed to apply an input", handoff_id)
                self._quarantine(batch, now, handoff_id, f"internal error applying input: {exc!r}")
                reject(delivery, handoff_id, f"internal error: {exc!r}", "internal")
                continue
            if isinstance(message, ActionOutcome):
                answered = (handoff_id, message.action_id)
                self._retries.cancel(answered)
                self._attempts.pop(answered, None)
            inputs[str(message.__struct_config__.tag)] += 1
            self._project(handoff, seq, now)
            batch.upsert_handoff(handoff.row)
            touched[handoff_id] = handoff
            acks.append(delivery)

        await self._commit(batch)

        for row, seq, action in outgoing:
            await self._publish_action(row, action)
            self._published.append((action.handoff_id, seq, now))
            if isinstance(action, Complete):
                completions[action.completion.value] += 1
        for _, rejection in rejected:
            await self._bus.publish(
                self._subjects.rejected(rejection.handoff_id), encode(rejection)
            )
        for delivery in acks:
            await delivery.ack()
        for delivery, _ in rejected:
            await delivery.term()
        for delivery in deferred:
            await delivery.nak(self._defer(delivery))

        # Handoffs loaded only to check an input against their log leave memory again.
        self._evict_completed([*touched.values(), *loaded])
        self._timers_changed.set()

        m = self._metrics
        Metrics.count(m.inputs, inputs.items())
        Metrics.count(m.actions, issued.items())
        Metrics.count(m.rejections, reasons.items())
        Metrics.count(m.completed, completions.items())
        if duplicates:
            m.duplicates.inc(duplicates)
        if deferred:
            m.deferred.inc(len(deferred))
        m.batch_size.observe(len(deliveries))
        m.open_handoffs.set(len(self._open))

    def _may_defer(self, delivery: Inbound) -> bool:
        """Whether one more early input may wait for a redelivery (see the module docstring)."""
        if len(self._deferred) < self._config.batch_size:
            return True
        # Forget inputs that never came back (their delay and an ack wait are long past).
        now = time.time()
        for seq in [seq for seq, due in self._deferred.items() if due < now]:
            del self._deferred[seq]
        return len(self._deferred) < self._config.batch_size

    def _defer(self, delivery: Inbound) -> float:
        """Note the input as waiting; the delay before JetStream delivers it again."""
        delay_s: float = min(0.05 * 2**delivery.deliveries, self._config.ack_wait_s / 2)
        self._deferred[delivery.stream_seq] = time.time() + delay_s + self._config.ack_wait_s
        return delay_s

    async def _load_missing(self, handoff_ids: set[UUID], batch: Batch) -> list[OpenHandoff]:
        """Bring logged handoffs that are not in memory (completed ones) back for this batch."""
        missing = [h for h in handoff_ids if h not in self._open and h not in self._quarantined]
        if not missing:
            return []
        now = _now_ms()
        adopted = (
            self._adopt(logged, batch, now) for logged in (await self._log.load(missing)).values()
        )
        return [handoff for handoff in adopted if handoff is not None]

    def _open_new(self, start: StartHandoff, now: int) -> OpenHandoff:
        row = HandoffRow(
            handoff_id=start.handoff_id,
            engine_type=start.engine_type.value,
            source=start.source,
            destination=start.destination,
            started_at_ms=now,
            deadline_at_ms=now + start.deadline_ms,
            state=HandoffState.OPEN,
            completed_at_ms=None,
            last_seq=-1,  # nothing logged yet
            updated_at_ms=now,
        )
        handoff = OpenHandoff(start, HandoffCoordinator.for_start(start), row, set())
        self._open[start.handoff_id] = handoff
        # Armed before the commit: if the commit fails, recovery rebuilds every timer anyway.
        self._deadlines.schedule(start.handoff_id, row.deadline_at_ms / 1000)
        return handoff

    @staticmethod
    def _project(handoff: OpenHandoff, last_seq: int, now: int) -> None:
        """Bring the handoff's row up to date after an accepted input."""
        row = handoff.row
        row.last_seq = last_seq
        row.updated_at_ms = now
        completion = handoff.coordinator.completion
        if not handoff.coordinator.is_complete:
            row.state, row.completed_at_ms = HandoffState.OPEN, None  # may reopen for cleanup
        elif row.state is HandoffState.OPEN:
            row.state = (
                HandoffState.SUCCEEDED
                if completion is HandoffCompletion.SUCCESS
                else HandoffState.CANCELED
            )
            row.completed_at_ms = now

    async def _commit(self, batch: Batch) -> None:
        if self._published:
            # "Published" must mean the server has it, not that it sits in our write buffer.
            await self._bus.flush()
        for handoff_id, seq, at_ms in self._published:
            batch.mark_published(handoff_id, seq, at_ms)
        began = time.perf_counter()
        await self._log.commit(batch)
        self._metrics.commit_seconds.observe(time.perf_counter() - began)
        self._published.clear()
        if self._commit_failure is not None:
            logger.info("commits succeed again")
            self._commit_failure = None
            self._commit_backoff_s = _COMMIT_BACKOFF_S[0]

    def _evict_completed(self, handoffs: list[OpenHandoff]) -> None:
        for handoff in handoffs:
            if handoff.coordinator.is_complete:
                handoff_id = handoff.start.handoff_id
                self._open.pop(handoff_id, None)
                self._deadlines.cancel(handoff_id)

    # --- Actions and timers -------------------------------------------------------------

    def _subject_for(self, row: HandoffRow, action: Action) -> str:
        match action.executor:
            case Role.SOURCE:
                return self._subjects.engine(row.source)
            case Role.DESTINATION:
                return self._subjects.engine(row.destination)
            case Role.FRONTEND:
                return self._subjects.done(action.handoff_id)

    async def _publish_action(self, row: HandoffRow, action: Action) -> None:
        subject, payload = self._subject_for(row, action), encode(action)
        if isinstance(action, Complete):
            # Stored by the completion stream (and still seen by core subscribers), so a
            # frontend that was reconnecting can read it afterwards.
            await self._bus.publish_stored(subject, payload)
        else:
            await self._bus.publish(subject, payload)
            key = (action.handoff_id, action.action_id)
            attempts = self._attempts[key] = self._attempts.get(key, 0) + 1
            backoff = min(2 ** (attempts - 1), _RETRY_BACKOFF_CAP)
            self._retries.schedule(key, time.time() + self._config.retry_interval_s * backoff)

    async def _run_timers(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._timers_changed.clear()
            candidates = (self._deadlines.next_due(), self._retries.next_due())
            dues = [d for d in candidates if d is not None]
            wait = min(dues) - time.time() if dues else None
            if wait is None or wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._timers_changed.wait(), wait)
                continue
            now = time.time()
            try:
                for handoff_id in self._deadlines.pop_due(now):
                    await self._expire(handoff_id)
                for handoff_id, action_id in self._retries.pop_due(now):
                    await self._retry(handoff_id, action_id)
            except BusError as exc:
                logger.warning("timer publish failed, will retry: %s", exc)
                await asyncio.sleep(1.0)  # NATS is reconnecting; the timers were rearmed

    async def _expire(self, handoff_id: UUID) -> None:
        handoff = self._open.get(handoff_id)
        if handoff is None or handoff.coordinator.mode is not Mode.ACTIVE:
            return
        try:
            await self._bus.publish_durable(
                self._subjects.input(handoff_id), encode(TimedOut(handoff_id))
            )
        except BusError:
            self._deadlines.schedule(handoff_id, time.time() + 1.0)
            raise
        logger.info("handoff %s: deadline passed, timed out", handoff_id)

    async def _retry(self, handoff_id: UUID, action_id: int) -> None:
        attempts = self._attempts.pop((handoff_id, action_id), 0)
        handoff = self._open.get(handoff_id)
        if handoff is None:
            return
        for action in handoff.coordinator.outstanding():
            if action.action_id == action_id:
                logger.debug("handoff %s: republishing action %d", handoff_id, action_id)
                self._metrics.republished.inc()
                self._attempts[(handoff_id, action_id)] = attempts
                await self._publish_action(handoff.row, action)
                return
