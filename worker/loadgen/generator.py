"""The load generator: plays the frontend. It starts handoffs, cancels some of them, waits for
each to end, and reports throughput, latency and the engines' leaks.

The model
---------
- Every handoff is planned up front from the seed: its engine type (round robin over the
  roster's types, so the mix is even), a source and a destination of that type (uniformly at
  random, with the engine ids of `worker.engines.Roster`), and, for exactly
  round(cancel_share * handoffs) of them, a frontend cancel after a uniform random 0 to
  cancel_within_ms. Handoff ids are fresh random UUIDs whatever the seed
  (`worker.ambient.new_uuid`): the worker de-duplicates inputs durably, so a second run must
  never reuse an id.
- It is a frontend written with the client (`client.Frontend`): subscribed to every `Complete`
  and `Rejection` before it starts anything, so no `Complete` can slip past it, and reading
  the completion stream after a reconnect. Inputs are stored with JetStream, retried while the
  input stream does not exist yet.
- With `engines_wait_s` (`--wait-for-engines`), it first waits until an engine listens on
  every engine id of its roster (`Connection.engine_listening`), up to that long: the first
  actions sent to an engine that starts late reach nobody and wait out the worker's retry
  interval, which would count in the latencies. Engines still silent then are named in a
  warning, and the load goes ahead.
- Pacing is a closed loop (`concurrency` handoffs open at once; the next starts when one ends)
  or, when `rate_per_s` is set, an open loop (starts at that rate however many are open).
- A handoff ends where `Frontend.wait` returns: at its first `Complete`, completed (success) or
  canceled (any cleanup: a frontend cancel, an engine failure, the worker's deadline). It is
  rejected if the worker rejects its `StartHandoff` (`HandoffRejected`), and timed out if
  neither happens within `wait_timeout_s` (by default the worker's deadline plus 30 s). A
  frontend cancel whose handoff already saw a `Complete` is not sent.
- A handoff whose frontend cancel went out ends only at its `Complete(canceled)`. A `Canceled`
  fact always ends in one (events/coordinator.py): during the handoff it starts the cleanup;
  after a success, which may have been on its way while the cancel was, it reopens the cleanup
  and the handoff completes again as canceled; after a canceled completion it changes nothing,
  and that completion was the last. Only if the worker rejects the cancel does the handoff end
  at its success after all.
- Each handoff's final state is the completion of the `Complete` with the highest action id
  seen for it by the time of the report, which is the state the worker's log holds. It differs
  from how the handoff ended when a `Complete` came after the end: a late engine fact that
  reopened a success, or a `Complete` after the wait timed out. A handoff is *reopened* when a
  success of it was followed by a canceled completion, whether its end waited for that or not.
- Latency runs from just before the `StartHandoff` publish to the receipt of the `Complete`,
  over handoffs that ended completed (percentiles by nearest rank). Throughput is the handoffs
  that ended with a `Complete` per second, from the first publish to the last end.
- Finally it gathers the engine processes' reports, retrying until the engines hold blocks only
  for decodes still running or `settle_timeout_s` passes, and counts their leaks.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import statistics
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from random import Random

import msgspec
from msgspec import Struct

from kvhandoff.client import (
    BusUnavailable,
    CompletionTimeout,
    Connection,
    Frontend,
    HandoffRejected,
)
from kvhandoff.events.ids import MAX_TIMER_MS, HandoffId
from kvhandoff.events.messages import (
    Complete,
    EngineType,
    HandoffCompletion,
    Input,
    Rejection,
    StartHandoff,
)
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.ambient import new_uuid
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.engines import EnginesReport, Leak, Roster, request_reports, settled
from kvhandoff.worker.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadConfig:
    nats: NatsSettings
    handoffs: int
    concurrency: int = 32
    rate_per_s: float | None = None  # when set, an open loop at this rate; concurrency unused
    cancel_share: float = 0.0
    cancel_within_ms: float = 100.0
    roster: Roster = field(default_factory=Roster)
    deadline_ms: int = 30_000
    fallback_delay_ms: float = 0.0
    wait_timeout_s: float | None = None  # None: the deadline plus 30 s
    settle_timeout_s: float = 10.0
    engines_wait_s: float | None = None  # None: start at once
    publish_give_up_s: float = 30.0
    connect_give_up_s: float = 30.0
    seed: int = 0
    # Awaited once every handoff ended here, while the frontend still listens: a caller that can
    # tell when the tier is done with them (the simulation reads its log) lets the Completes of
    # a cleanup reopened after a success count in the final states. None: report at once.
    linger: Callable[[], Awaitable[None]] | None = None

    def __post_init__(self) -> None:
        if self.handoffs < 1:
            raise ConfigError(f"handoffs must be at least 1, got {self.handoffs}")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.rate_per_s is not None and not self.rate_per_s > 0:
            raise ConfigError(f"rate must be positive, got {self.rate_per_s}")
        if not 0.0 <= self.cancel_share <= 1.0:
            raise ConfigError(f"cancel share must be within [0, 1], got {self.cancel_share}")
        if self.cancel_within_ms < 0:
            raise ConfigError(f"cancel delay must be >= 0, got {self.cancel_within_ms}")
        if not 1 <= self.deadline_ms <= MAX_TIMER_MS:
            raise ConfigError(
                f"deadline must be 1 to {MAX_TIMER_MS} ms (the wire's bound),"
                f" got {self.deadline_ms}"
            )
        if self.wait_timeout_s is not None and not self.wait_timeout_s > 0:
            raise ConfigError(f"wait timeout must be positive, got {self.wait_timeout_s}")
        if self.engines_wait_s is not None and not self.engines_wait_s > 0:
            raise ConfigError(f"engines wait must be positive, got {self.engines_wait_s}")

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.nats.subject_prefix)

    @property
    def wait_timeout(self) -> float:
        if self.wait_timeout_s is not None:
            return self.wait_timeout_s
        return self.deadline_ms / 1000.0 + 30.0


class Ending(enum.StrEnum):
    COMPLETED = "completed"
    CANCELED = "canceled"
    TIMED_OUT = "timed_out"
    REJECTED = "rejected"


class LoadProgress(Struct, frozen=True):
    """Counts so far, handed to the progress callback each time a handoff ends."""

    handoffs: int
    started: int
    completed: int
    canceled: int
    timed_out: int
    rejected: int

    @property
    def ended(self) -> int:
        return self.completed + self.canceled + self.timed_out + self.rejected


class Latency(Struct, frozen=True):
    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None
    max: float | None


class FinalStates(Struct, frozen=True):
    """Handoffs by the state the worker's log holds for them (`succeeded`, `canceled`): the
    completion of the last `Complete` seen for each. A handoff with none seen is in neither."""

    succeeded: int = 0
    canceled: int = 0


class LoadReport(Struct, frozen=True):
    """How each handoff ended (`completed`, `canceled`, `timed_out`, `rejected`), the state
    each is left in (`final`, `reopened`), throughput, latency and the engines' leaks."""

    handoffs: int
    completed: int
    canceled: int
    timed_out: int
    rejected: int
    leaks: int
    throughput_per_s: float
    latency_ms: Latency
    duration_s: float
    cancels_sent: int
    # A `Complete` for a handoff that had already ended here: a late terminal fact reopened a
    # successful handoff's cleanup, or the Complete came after the wait timed out.
    extra_completions: int
    # Rejections of inputs other than a StartHandoff (an engine's late fact, a cancel).
    input_rejections: int
    engine_processes: int
    engines_settled: bool
    leak_details: list[Leak]
    # Added after the fields above, with defaults, so that an older report still decodes.
    final: FinalStates = msgspec.field(default_factory=FinalStates)
    # Handoffs that succeeded and then completed again as canceled (a frontend cancel that
    # crossed the success, or a late engine fact).
    reopened: int = 0
    # Engine ids of the roster that no engine process reported: their leaks are not counted.
    unreported: list[str] = []

    @property
    def ok(self) -> bool:
        """Every handoff ended with a Complete and no engine reports a leak."""
        return self.completed + self.canceled == self.handoffs and self.leaks == 0


def latency_summary(latencies_ms: list[float]) -> Latency:
    """Nearest-rank percentiles, mean and maximum; all None when there are no values."""
    if not latencies_ms:
        return Latency(count=0, p50=None, p90=None, p99=None, mean=None, max=None)
    ordered = sorted(latencies_ms)

    def rank(percent: float) -> float:
        return ordered[max(0, math.ceil(percent / 100.0 * len(ordered)) - 1)]

    return Latency(
        count=len(ordered),
        p50=rank(50),
        p90=rank(90),
        p99=rank(99),
        mean=statistics.fmean(ordered),
        max=ordered[-1],
    )


@dataclass(frozen=True)
class HandoffPlan:
    start: StartHandoff
    cancel_after_s: float | None


@dataclass
class _Handoff:
    """What the load generator knows of one handoff it started."""

    # Every Complete seen for it, with its receipt time, in order of arrival.
    arrivals: list[tuple[float, Complete]] = field(default_factory=list)
    ending: Ending | None = None
    # Arrivals up to and including the one that ended it; those after are extra completions.
    arrivals_at_end: int = 0

    @property
    def last_complete(self) -> Complete | None:
        """The Complete with the highest action id: the state the log holds. By action id, not
        arrival: a republished (recovered) Complete may come again later."""
        completes = [complete for _, complete in self.arrivals]
        return max(completes, key=lambda c: c.action_id, default=None)

    @property
    def reopened(self) -> bool:
        last = self.last_complete
        succeeded = any(c.completion is HandoffCompletion.SUCCESS for _, c in self.arrivals)
        return succeeded and last is not None and last.completion is HandoffCompletion.CANCELED

    def ended_by(self, complete: Complete, now: float) -> float:
        """Record the end at `complete` (the first arrival of its action id); its time."""
        for index, (at, seen) in enumerate(self.arrivals):
            if seen.action_id == complete.action_id:
                self.arrivals_at_end = index + 1
                return at
        # Read from the completion stream after a reconnect: it arrives now.
        self.arrivals.append((now, complete))
        self.arrivals_at_end = len(self.arrivals)
        return now


def plan_handoffs(config: LoadConfig) -> list[HandoffPlan]:
    """Every handoff's routing and frontend cancel, drawn from the seed."""
    rng = Random(config.seed)
    roster = config.roster
    types = roster.engine_types
    canceled = set(
        rng.sample(range(config.handoffs), k=round(config.cancel_share * config.handoffs))
    )
    plans = []
    for index in range(config.handoffs):
        engine_type: EngineType = types[index % len(types)]
        start = StartHandoff(
            handoff_id=new_uuid(),
            engine_type=engine_type,
            source=rng.choice(roster.source_ids(engine_type)),
            destination=rng.choice(roster.destination_ids(engine_type)),
            deadline_ms=config.deadline_ms,
            fallback_delay_ms=config.fallback_delay_ms,
        )
        cancel_after_s = None
        if index in canceled:
            cancel_after_s = rng.uniform(0.0, config.cancel_within_ms) / 1000.0
        plans.append(HandoffPlan(start, cancel_after_s))
    return plans


async def run_load(
    config: LoadConfig, *, progress: Callable[[LoadProgress], None] | None = None
) -> LoadReport:
    """Run one load against the bus at `config.nats.url` and report. NATS failures raise
    `BusUnavailable`: no server answered within `connect_give_up_s`, an input could not be
    stored within `publish_give_up_s`; `Refused` if NATS refused our credentials or TLS."""
    try:
        connection = await asyncio.wait_for(
            Connection.open(config.nats, "kvhandoff-load"), config.connect_give_up_s
        )
    except TimeoutError as exc:
        raise BusUnavailable(
            f"cannot connect to NATS at {config.nats.url}: no answer within "
            f"{config.connect_give_up_s:g}s"
        ) from exc
    async with connection:
        return await _LoadRun(connection, config, progress).run()


class _LoadRun:
    def __init__(
        self,
        connection: Connection,
        config: LoadConfig,
        progress: Callable[[LoadProgress], None] | None,
    ) -> None:
        self._connection = connection
        self._config = config
        self._progress = progress
        self._plans = plan_handoffs(config)
        self._loop = asyncio.get_running_loop()
        self._handoffs: dict[HandoffId, _Handoff] = {}
        self._counts = dict.fromkeys(Ending, 0)
        self._latencies_ms: list[float] = []
        self._started = 0
        self._cancels_sent = 0
        self._rejections = 0
        self._began = 0.0
        self._last_end = 0.0
        self._cancelers: dict[asyncio.Task[None], None] = {}  # in the order made, as a list

    async def run(self) -> LoadReport:
        # Its subscriptions are registered before the first StartHandoff goes out.
        frontend = await Frontend.open(
            self._connection,
            remember=len(self._plans),  # every handoff's completions count in the report
            publish_give_up_s=self._config.publish_give_up_s,
            on_complete=self._on_complete,
            on_rejection=self._on_rejection,
        )
        try:
            if self._config.engines_wait_s is not None:
                await self._wait_for_engines(self._config.engines_wait_s)
            self._began = self._last_end = self._loop.time()
            if self._config.rate_per_s is None:
                await self._closed_loop(frontend)
            else:
                await self._open_loop(frontend, self._config.rate_per_s)
            if self._config.linger is not None:
                await self._config.linger()
            reports, engines_settled = await self._settle()
        finally:
            await _cancel_all(self._cancelers)
            await frontend.close()
        return self._report(reports, engines_settled)

    async def _wait_for_engines(self, within_s: float) -> None:
        """Until every engine of the roster listens, or `within_s` has passed (see the module
        docstring). A silent engine's probe waits a second for an answer: the poll's pace."""
        silent = self._config.roster.engine_ids()
        give_up_at = self._loop.time() + within_s
        while silent and self._loop.time() < give_up_at:
            silent = [e for e in silent if not await self._connection.engine_listening(e)]
        if silent:
            logger.warning(
                "%d engines not listening after %gs, starting anyway: %s",
                len(silent),
                within_s,
                ", ".join(silent),
            )

    async def _closed_loop(self, frontend: Frontend) -> None:
        plans = iter(self._plans)

        async def lane() -> None:
            for plan in plans:
                await self._one(frontend, plan)

        lanes = [asyncio.create_task(lane()) for _ in range(self._config.concurrency)]
        try:
            await asyncio.gather(*lanes)
        finally:  # after a failure, the other lanes stop too
            await _cancel_all(lanes)

    async def _open_loop(self, frontend: Frontend, rate_per_s: float) -> None:
        handoffs: list[asyncio.Task[None]] = []
        try:
            for index, plan in enumerate(self._plans):
                start_at = self._began + index / rate_per_s
                await asyncio.sleep(max(0.0, start_at - self._loop.time()))
                handoffs.append(asyncio.create_task(self._one(frontend, plan)))
            await asyncio.gather(*handoffs)
        finally:
            await _cancel_all(handoffs)

    async def _one(self, frontend: Frontend, plan: HandoffPlan) -> None:
        handoff_id = plan.start.handoff_id
        handoff = self._handoffs[handoff_id] = _Handoff()
        sent_at = self._loop.time()
        await frontend.start(plan.start)
        self._started += 1
        if plan.cancel_after_s is not None:
            canceler = asyncio.create_task(
                self._cancel_later(frontend, handoff_id, plan.cancel_after_s)
            )
            self._cancelers[canceler] = None
            canceler.add_done_callback(self._forget_canceler)
        try:
            complete = await frontend.wait(handoff_id, self._config.wait_timeout)
        except CompletionTimeout:
            ending, at = Ending.TIMED_OUT, self._loop.time()
            handoff.arrivals_at_end = len(handoff.arrivals)  # later ones are extra
            logger.warning("handoff %s: no Complete within the wait timeout", handoff_id)
        except HandoffRejected:
            ending, at = Ending.REJECTED, self._loop.time()
            handoff.arrivals_at_end = len(handoff.arrivals)
        else:
            at = handoff.ended_by(complete, self._loop.time())
            success = complete.completion is HandoffCompletion.SUCCESS
            ending = Ending.COMPLETED if success else Ending.CANCELED
        handoff.ending = ending
        self._counts[ending] += 1
        self._last_end = max(self._last_end, at)
        if ending is Ending.COMPLETED:
            self._latencies_ms.append((at - sent_at) * 1000.0)
        if self._progress is not None:
            self._progress(self.progress())

    async def _cancel_later(
        self, frontend: Frontend, handoff_id: HandoffId, after_s: float
    ) -> None:
        await asyncio.sleep(after_s)
        handoff = self._handoffs[handoff_id]
        # Any Complete before the cancel goes out ends the handoff (the wait may not have
        # returned yet): a cancel now would only reopen it.
        if handoff.ending is not None or handoff.arrivals:
            return
        await frontend.cancel(handoff_id)
        self._cancels_sent += 1

    def _forget_canceler(self, canceler: asyncio.Task[None]) -> None:
        self._cancelers.pop(canceler, None)

    def _on_complete(self, complete: Complete) -> None:
        self._handoffs[complete.handoff_id].arrivals.append((self._loop.time(), complete))

    def _on_rejection(self, rejection: Rejection, refused: Input | None) -> None:
        logger.warning(
            "handoff %s: the worker rejected an input: %s", rejection.handoff_id, rejection.reason
        )
        self._rejections += 1

    async def _settle(self) -> tuple[list[EnginesReport], bool]:
        give_up_at = self._loop.time() + self._config.settle_timeout_s
        while True:
            reports = await request_reports(self._connection)
            if settled(reports):
                return reports, True
            if self._loop.time() >= give_up_at:
                return reports, False
            await asyncio.sleep(0.1)  # the poll interval: decodes end on their own time

    def progress(self) -> LoadProgress:
        return LoadProgress(
            handoffs=len(self._plans),
            started=self._started,
            completed=self._counts[Ending.COMPLETED],
            canceled=self._counts[Ending.CANCELED],
            timed_out=self._counts[Ending.TIMED_OUT],
            rejected=self._counts[Ending.REJECTED],
        )

    def _report(self, reports: list[EnginesReport], engines_settled: bool) -> LoadReport:
        duration_s = self._last_end - self._began
        ended_with_complete = self._counts[Ending.COMPLETED] + self._counts[Ending.CANCELED]
        leaks = [leak for report in reports for leak in report.leaks]
        reported = {status.engine_id for report in reports for status in report.engines}
        handoffs = self._handoffs.values()
        final = Counter(
            last.completion for handoff in handoffs if (last := handoff.last_complete) is not None
        )
        return LoadReport(
            handoffs=len(self._plans),
            completed=self._counts[Ending.COMPLETED],
            canceled=self._counts[Ending.CANCELED],
            timed_out=self._counts[Ending.TIMED_OUT],
            rejected=self._counts[Ending.REJECTED],
            leaks=len(leaks),
            throughput_per_s=ended_with_complete / duration_s if duration_s > 0 else 0.0,
            latency_ms=latency_summary(self._latencies_ms),
            duration_s=duration_s,
            cancels_sent=self._cancels_sent,
            extra_completions=sum(
                len(handoff.arrivals) - handoff.arrivals_at_end
                for handoff in handoffs
                if handoff.ending is not None
            ),
            # A rejected StartHandoff is counted as the handoff's ending instead.
            input_rejections=self._rejections - self._counts[Ending.REJECTED],
            engine_processes=len(reports),
            engines_settled=engines_settled,
            leak_details=leaks,
            final=FinalStates(
                succeeded=final[HandoffCompletion.SUCCESS],
                canceled=final[HandoffCompletion.CANCELED],
            ),
            reopened=sum(handoff.reopened for handoff in handoffs),
            unreported=[e for e in self._config.roster.engine_ids() if e not in reported],
        )


async def _cancel_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel them in their order (never a set's, which is their addresses': the order of the
    cancellations is the order of what the tasks do next), and wait for them."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
