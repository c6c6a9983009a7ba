"""The worker: JetStream inputs in, the SQLite event log, actions out.

The loop
--------
The input stream is handled in batches, in stream order, as a pipeline of three stages:

    fetch  ->  plan (decode; load handoffs not in memory; apply to coordinators)
           ->  carry out (commit one transaction; publish the actions; ack, term or nak)

`worker.planner` decides everything a batch does without IO; this module carries it out. While
batch k is carried out (the event loop waits on the log's writer thread and the fsync), batch
k+1 is fetched and planned. When k's carry-out returns, k+1 is topped up with what arrived in the
meantime, planned into the same commit: an input that arrives during a commit goes out with the
next one, not the one after. What may overlap, and why it is safe:

- Planning k+1 mutates the handoffs in memory on top of k's effects before k has committed. That
  is only ever visible inside this process: nothing of k+1 is written, published or settled until
  k's carry-out returned and k+1's own commit did. (A batch's rows are copies taken when it was
  planned, so k's commit writes k's state of a handoff, not k+1's.)
- Planning reads the log only for handoffs not in memory. A handoff that k completed has left
  memory before k committed, so a read of one waits for k's carry-out first; any other handoff
  not in memory is not in k either, so its read may overtake k's commit. A top-up is planned
  after k's carry-out, but before k+1's commit: a top-up input that needs a handoff k+1 took out
  of memory is held back, to be planned with k+2.
- Commits stay in order and one at a time (one writer): k+1's carry-out starts after k's ended.
- An action is published only after the commit that recorded it, and an input acknowledged only
  after its commit: each within its own batch's carry-out.
- If k's carry-out fails, memory is ahead of the log by k and k+1: k+1 is returned to JetStream
  unapplied, and the handoffs are rebuilt from the log before anything else is planned.

A crash anywhere loses nothing acknowledged:

- before a commit: nothing of the batch was logged or acknowledged; JetStream redelivers it.
- after the commit, before publishing: the actions are in the log unmarked; recovery publishes
  them (the log is the outbox).
- after publishing, before the acks: the inputs are redelivered and dropped as exact
  duplicates, which the log recognises by digest.

Every action is marked published only after the server confirmed it: each carry-out starts a
barrier (`Bus.flush`) behind its publishes and does not wait for it; the marks of the batches
whose barrier has returned ride on a commit at most every `_MARK_INTERVAL_S` (and on the commit
of an idle or stopping worker), so no commit waits for a round trip to NATS, and most write no
marks at all. A mark is the outbox's bookmark, not a durability rule: it costs an UPDATE per
handoff (a quarter of a small batch's commit), and all that a later one costs is that a crash
republishes the actions of the last interval, which engines answer by action id as they answer
any republished action.
`Complete` goes to JetStream's completion stream as well, so a frontend that was disconnected
can read its handoff's last completion afterwards.

Faults
------
No input and no handoff can stop the worker (see `worker.planner`: rejections, quarantine, the
budget of early inputs). A failed commit (a full disk) changes nothing: the batch's inputs are
returned with a growing delay, the handoffs in memory are rebuilt from the log, nothing is
republished, commits back off, and health is red until one succeeds again. A failed publish
rebuilds from the log and republishes exactly what it does not mark published.

Coordinators of open handoffs live in memory; a completed handoff leaves memory, and an input
for a handoff not in memory loads its log and replays it (one query per batch). A second task
runs the timers (`worker.timers.HandoffTimers`): a handoff's deadline publishes a `TimedOut`
input to the handoff's own input subject, so it is logged and replayed like any other input; an
action with no outcome after the retry interval is published again with the same action id, and
again after twice as long, up to `RETRY_BACKOFF_CAP` intervals, so a slow engine is not buried
under its own backlog. They are armed when a batch is planned, and rearmed whenever memory is
rebuilt from the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from kvhandoff.events.codec import encode
from kvhandoff.events.errors import ReplayDivergence
from kvhandoff.events.messages import Action, Complete
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus import Bus, Inbound
from kvhandoff.worker.clock import now_ms
from kvhandoff.worker.config import WorkerConfig
from kvhandoff.worker.errors import BusError, LogDiverges, StoreConflict, StoreError
from kvhandoff.worker.metrics import Metrics
from kvhandoff.worker.planner import Decoded, Plan, Planner
from kvhandoff.worker.rows import HandoffRow
from kvhandoff.worker.store import Batch, CorruptHandoff, EventLog
from kvhandoff.worker.timers import HandoffTimers

logger = logging.getLogger(__name__)

_FETCH_TIMEOUT_S = 0.25  # how long an idle worker waits before noticing a stop request
_COMMIT_BACKOFF_S = (0.1, 5.0)  # first and longest pause after a failed commit
_MARK_INTERVAL_S = 0.2  # the longest time confirmed outbox marks wait for a commit to ride on


class Worker:
    def __init__(self, config: WorkerConfig, log: EventLog, bus: Bus, metrics: Metrics) -> None:
        self._config = config
        self._log = log
        self._bus = bus
        self._metrics = metrics
        self._subjects = Subjects(config.nats.subject_prefix)
        # Early inputs may hold at most a batch's worth of the consumer's unacknowledged slots.
        self._planner = Planner(self._subjects, config.batch_size, config.ack_wait_s)
        self._timers = HandoffTimers(
            self._planner, bus, self._subjects, metrics,
            retry_interval_s=config.retry_interval_s, republish=self._publish_action,
        )  # fmt: skip
        # Outbox marks of published actions, each batch's with the barrier that confirms them;
        # they ride on the first commit after their barrier returned.
        self._published: deque[tuple[asyncio.Future[None], list[tuple[UUID, int, int]]]] = deque()
        self._commit_failure: str | None = None
        self._commit_backoff_s = _COMMIT_BACKOFF_S[0]
        self._marks_due = 0.0  # when confirmed marks ride on the next commit (monotonic)
        self.recovered = False

    @property
    def healthy(self) -> bool:
        return self.recovered and self._bus.is_connected and self._commit_failure is None

    async def run(self, stop: asyncio.Event) -> None:
        """Recover, then process inputs until `stop` is set; the batch in hand is finished."""
        await self._recover_when_possible(stop, first_wait_s=0.0)
        timers = asyncio.create_task(self._timers.run(), name="kvhandoff-timers")
        carrying: asyncio.Task[None] | None = None  # the previous batch's carry-out
        evicted: set[UUID] = set()  # handoffs that batch completed and took out of memory
        held: list[Inbound] = []  # fetched for a top-up, but to be planned with the next batch
        try:
            while not stop.is_set():
                deliveries = await self._fetch(held)
                held = []
                parts: list[tuple[Plan, list[Inbound]]] = []
                if deliveries:
                    decoded = self._planner.decode(deliveries)
                    missing = self._planner.missing(decoded)
                    if carrying is not None and not evicted.isdisjoint(missing):
                        # A handoff the previous batch completed has left memory, but that
                        # batch may not have committed yet: let it finish before reading.
                        failure = await _failure_of(carrying)
                        carrying = None
                        if failure is not None:
                            await self._give_back(deliveries, self._commit_backoff_s)
                            await self._failed(failure, stop)
                            continue
                    try:
                        parts.append((await self._plan(deliveries, decoded, missing), deliveries))
                    except StoreError as exc:  # the read failed before anything was applied
                        logger.error("cannot read the log (%s); inputs will be redelivered", exc)
                        await self._give_back(deliveries, self._commit_backoff_s)
                if carrying is not None:
                    failure = await _failure_of(carrying)
                    carrying = None
                    if failure is not None:
                        for _, planned in parts:  # planned on top of the batch that failed
                            await self._give_back(planned, self._commit_backoff_s)
                        await self._failed(failure, stop)
                        continue
                    if parts:
                        held = await self._top_up(parts)
                if parts:
                    carrying = asyncio.create_task(self._carry_out(parts))
                    evicted = {h for plan, _ in parts for h in plan.left_memory}
                elif self._published:  # idle: write the marks still waiting for a commit
                    carrying = asyncio.create_task(self._carry_out([], every_mark=True))
        finally:
            if carrying is not None:
                await _failure_of(carrying)
            timers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timers
            if self._published:
                with contextlib.suppress(StoreError, BusError):
                    await self._commit(Batch(), every_mark=True)
        logger.info("stopped with %d open handoffs", len(self._planner.open))

    async def _fetch(self, held: list[Inbound]) -> list[Inbound]:
        """The held deliveries and what else is ready, or else the next to arrive in a while."""
        try:
            if held:
                return held + await self._bus.fetch(self._config.batch_size - len(held), 0.0)
            return await self._bus.fetch(self._config.batch_size, _FETCH_TIMEOUT_S)
        except BusError as exc:
            logger.warning("fetch failed, retrying: %s", exc)
            await asyncio.sleep(_FETCH_TIMEOUT_S)  # NATS is reconnecting; back off
            return held

    async def _top_up(self, parts: list[tuple[Plan, list[Inbound]]]) -> list[Inbound]:
        """Plan what arrived while the previous batch was carried out into the batch about to
        be carried out, so that it commits now rather than after that batch. Returns the
        deliveries to hold for the next batch instead: those that need a handoff this batch
        took out of memory (not committed yet, so not to be read)."""
        plan, deliveries = parts[0]
        room = self._config.batch_size - len(deliveries)
        if room <= 0:
            return []
        try:
            more = await self._bus.fetch(room, 0.0)
        except BusError:
            return []  # the next fetch reports it
        if not more:
            return []
        decoded = self._planner.decode(more)
        missing = self._planner.missing(decoded)
        if not set(plan.left_memory).isdisjoint(missing):
            return more
        try:
            parts.append((await self._plan(more, decoded, missing, into=plan.batch), more))
        except StoreError as exc:
            logger.error("cannot read the log (%s); inputs will be redelivered", exc)
            await self._give_back(more, self._commit_backoff_s)
        return []

    async def _failed(self, failure: BusError | StoreError, stop: asyncio.Event) -> None:
        if isinstance(failure, BusError):
            # Committed actions may not have reached NATS. The log knows which were
            # published, so rebuilding from it republishes exactly what is missing.
            logger.warning("publishing failed (%s); recovering from the log", failure)
            await self._recover_when_possible(stop)
        else:
            await self._commit_failed(failure, stop)

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

    async def _commit_failed(self, exc: StoreError, stop: asyncio.Event) -> None:
        """A commit failed, so nothing of its batch happened (its inputs were given back): the
        handoffs in memory are rebuilt from the log, and nothing is republished. A conflict
        (the log changed under us: an event where this worker meant to append one) is not a
        failing disk: once memory is rebuilt from the log, the next commit can succeed, so it
        is retried without growing the backoff."""
        delay_s = self._commit_backoff_s
        self._commit_failure = str(exc)
        self._metrics.commit_failures.inc()
        if isinstance(exc, StoreConflict):
            logger.error("the log changed under this worker; rebuilding from it: %s", exc)
        else:
            self._commit_backoff_s = min(delay_s * 2, _COMMIT_BACKOFF_S[1])
            logger.error("commit failed, retrying in %.1fs: %s", delay_s, exc)
        try:
            await self._rebuild_memory()
        except StoreError as read_exc:
            logger.error("cannot read the log either: %s", read_exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay_s)

    def _drop_marks(self) -> None:
        """Forget the marks not yet committed: their actions count as never published."""
        for barrier, _ in self._published:
            if barrier.done() and not barrier.cancelled():
                barrier.exception()  # retrieved: a failure that nobody waits for any more
            barrier.cancel()
        self._published.clear()

    async def _give_back(self, deliveries: Sequence[Inbound], delay_s: float) -> None:
        """Return inputs to JetStream unapplied, to be delivered again after `delay_s`."""
        try:
            for delivery in deliveries:
                await delivery.nak(delay_s)
        except BusError as exc:
            logger.warning("could not give back a batch (%s); JetStream redelivers it", exc)

    # --- Recovery -----------------------------------------------------------------------

    async def recover(self) -> None:
        """Rebuild every open handoff from the log, rearm its timers, and publish the actions
        that were never published or still await an outcome."""
        began = time.perf_counter()
        self._drop_marks()  # re-derived below from the log's own marks
        marks = Batch()
        now = now_ms()
        loaded = await self._rebuild_memory(marks)
        # The backlog may include a closed handoff's last actions (e.g. its Complete); its
        # row is all that routing needs.
        republish: dict[tuple[UUID, int], tuple[HandoffRow, Action]] = {}
        for unpublished in await self._log.unpublished_actions():
            if isinstance(unpublished, CorruptHandoff):
                self._planner.quarantine(marks, now, unpublished.handoff_id, unpublished.reason)
                continue
            action = unpublished.record.action
            republish[(action.handoff_id, action.action_id)] = (unpublished.row, action)
            marks.mark_published(action.handoff_id, unpublished.seq, now)
        for handoff in self._planner.open.values():
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
        self._metrics.quarantined.set(len(self._planner.quarantined))
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
        planner = self._planner
        planner.open.clear()
        planner.quarantined = quarantined
        planner.deferred.clear()
        # Not `batch or Batch()`: a Batch is falsy until it holds rows.
        into = Batch() if batch is None else batch
        try:
            adopted = planner.adopt(loaded.values(), into, now_ms(), diverging=True)
        except ReplayDivergence as exc:
            raise LogDiverges(
                f"{exc}; this build's coordinator does not re-derive the log of an open handoff."
                " Run `kvhandoff verify` on the log, and run the build that wrote it"
            ) from exc
        self._timers.rearm(adopted)
        self._metrics.open_handoffs.set(len(planner.open))
        self._metrics.quarantined.set(len(planner.quarantined))
        return len(loaded)

    # --- A batch ------------------------------------------------------------------------

    async def _plan(
        self, deliveries: list[Inbound], decoded: Decoded, missing: list[UUID],
        into: Batch | None = None,
    ) -> Plan:  # fmt: skip
        """Load the handoffs the batch names that are not in memory, and apply the batch."""
        planner = self._planner
        loaded = await self._log.load(missing) if missing else {}
        plan = planner.plan(deliveries, decoded, loaded, now_ms(), time.time(), into=into)
        self._timers.arm(plan)
        return plan

    async def _carry_out(
        self, parts: Sequence[tuple[Plan, Sequence[Inbound]]], *, every_mark: bool = False
    ) -> None:
        """Commit the batch that the plans share, then publish their actions and settle their
        inputs, plan by plan."""
        try:
            await self._commit(parts[0][0].batch if parts else Batch(), every_mark=every_mark)
        except StoreError:
            for _, deliveries in parts:
                await self._give_back(deliveries, self._commit_backoff_s)
            raise
        for plan, deliveries in parts:
            await self._settle(plan, deliveries)

    async def _settle(self, plan: Plan, deliveries: Sequence[Inbound]) -> None:
        """Publish a committed plan's actions and rejections, and settle its inputs."""
        now = now_ms()
        completions: Counter[str] = Counter()
        marks = []
        for row, seq, action in plan.publish:
            await self._publish_action(row, action)
            marks.append((action.handoff_id, seq, now))
            if isinstance(action, Complete):
                completions[action.completion.value] += 1
        if marks:
            # Not awaited here: the next batch goes on while the server confirms these.
            self._published.append((asyncio.ensure_future(self._bus.flush()), marks))
        for _, rejection in plan.terms:
            await self._bus.publish(
                self._subjects.rejected(rejection.handoff_id), encode(rejection)
            )
        for index in plan.acks:
            await deliveries[index].ack()
        for index, _ in plan.terms:
            await deliveries[index].term()
        for index, delay_s in plan.naks:
            await deliveries[index].nak(delay_s)

        m = self._metrics
        Metrics.count(m.inputs, plan.inputs.items())
        Metrics.count(m.actions, plan.issued.items())
        Metrics.count(m.rejections, plan.reasons.items())
        Metrics.count(m.completed, completions.items())
        if plan.duplicates:
            m.duplicates.inc(plan.duplicates)
        if plan.naks:
            m.deferred.inc(len(plan.naks))
        if deliveries:
            m.batch_size.observe(len(deliveries))
        m.open_handoffs.set(len(self._planner.open))
        m.quarantined.set(len(self._planner.quarantined))

    async def _commit(self, batch: Batch, *, every_mark: bool = False) -> None:
        """Commit `batch`, with the outbox marks whose barrier has returned, in publication
        order, if they are due (module docstring); with `every_mark`, first wait for every
        barrier. A barrier that failed raises its `BusError` before anything is written."""
        # "Published" must mean the server has it, not that it sits in our write buffer.
        confirmed = 0
        due = every_mark or time.monotonic() >= self._marks_due
        for barrier, marks in self._published if due else ():
            if every_mark:
                await barrier
            elif not barrier.done():
                break
            barrier.result()
            for handoff_id, seq, at_ms in marks:
                batch.mark_published(handoff_id, seq, at_ms)
            confirmed += 1
        began = time.perf_counter()
        await self._log.commit(batch)
        self._metrics.commit_seconds.observe(time.perf_counter() - began)
        for _ in range(confirmed):
            self._published.popleft()
        if confirmed:
            self._marks_due = time.monotonic() + _MARK_INTERVAL_S
        if self._commit_failure is not None:
            logger.info("commits succeed again")
            self._commit_failure = None
            self._commit_backoff_s = _COMMIT_BACKOFF_S[0]

    # --- Actions ------------------------------------------------------------------------

    async def _publish_action(self, row: HandoffRow, action: Action) -> None:
        await publish_action(self._bus, self._subjects, row, action)
        self._timers.sent(action)


async def publish_action(
    bus: Bus, subjects: Subjects, row: HandoffRow, action: Action
) -> asyncio.Future[Any] | None:
    """Publish an action to its engine's subject (worker.partitioned's too). A `Complete` is
    also stored by the completion stream (and still seen by core subscribers), so a frontend
    that was reconnecting can read it afterwards: its ack is returned (see `Bus.confirm`)."""
    subject = subjects.action(action, row.source, row.destination)
    if isinstance(action, Complete):
        return await bus.publish_stored(subject, encode(action))
    await bus.publish(subject, encode(action))
    return None


async def _failure_of(task: asyncio.Task[None]) -> BusError | StoreError | None:
    """Wait for a carry-out; the bus or log failure that ended it, if one did."""
    try:
        await task
    except (BusError, StoreError) as exc:
        return exc
    return None
