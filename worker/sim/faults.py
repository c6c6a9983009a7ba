"""The faults of one simulated run, drawn from its seed: which kinds, how often, when, to whom.

Swarm testing. A run with every fault at a fixed rate tests one mix; the interleavings that
break a system are often found where one fault is frequent and the others absent. So each seed
first draws which kinds of fault it has at all (each kind with even odds) and a rate for each,
then draws the faults of those kinds over the run's fault phase (`Scenario.duration_s`):

    crash      a worker dies at once (SIGKILL: none of its code runs again, its connections
               reset) and comes back after a while, with its partition files or, one time in
               four, without them (a new disk)
    pause      a worker stops (SIGSTOP) for up to 15 s, longer than the consumers' priority
               timeout, so another worker takes its partitions over; then it runs on (SIGCONT),
               a zombie that still believes it owns them
    node       a NATS node dies and comes back; at most one at a time (a cluster of three keeps
               its quorum), so clients fail over to another
    election   JetStream answers nothing for up to 5 s, as while a stream elects a leader; what
               was asked meanwhile times out, and may have landed
    delay      the network is slow for a while: every message takes up to 50 ms
    churn      one more worker joins the tier, and later leaves it cleanly
    engines    the engines' host dies (its leases lapse, and the workers answer for its
               engines) and comes back after a while
    reset      a worker's connection to NATS goes dark for up to 2 s and is then reset (a
               load balancer that lost its state): what either side wrote meanwhile, which
               its socket took, is lost, and the client reconnects; the publishes among it are
               what the outbox's barrier must notice
    full       a worker's disk fills up for up to 10 s: SQLite refuses each write that needs
               room ("database or disk is full"), whichever incarnation of the worker runs
    slow       a worker's disk turns slow for up to 10 s: each of its file operations waits
               for the one before, then up to 200 ms more

and, for the whole fault phase, these properties of the server: a share of publish acks lost
after the message was stored (`lost_acks`), late acks accepted after their ack wait
(nats-server#4786: `late_acks`), and a window after a pin changes in which the old pin is still
served (ADR-42 promises no exclusivity: `pin_overlap_s`). Each worker's wall clock is skewed by
up to two seconds either way (`skews_s`). The engines misbehave as the mock engines can
(`engines`, worker.engines.faults: actions failed, dropped or answered twice, answers late,
an engine silent for long enough that deadlines fire), for the whole run.

A scenario may force the mix (`kinds`, `Scenario.fault_kinds`, `kvhandoff sim --faults`): the
kinds it names are all on, the others off, and the rest is drawn as ever, so that forcing the
kinds a seed draws anyway replays that seed (a kind added later leaves the seeds that found
bugs before it replayable: their tests force the kinds they drew). A hunt for a
bug that one mix makes likely runs that mix on every seed rather than on one seed in 2^7; the
properties of the whole phase are drawn as ever.

Then the quiet phase: every fault heals (the crashed and the paused run again, the node and
JetStream are back, the server keeps its promises) and the tier must converge.

A `FaultPlan` is data: drawn once, before the run, and printed with a failing seed.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass, field

from kvhandoff.worker.engines.faults import Faults as EngineFaults

# The kinds a seed drew from the first; a kind added later is drawn after everything else, so
# that every seed still draws the faults it drew before (its replay tests keep their paths).
_FIRST_KINDS = ("crash", "pause", "node", "election", "delay", "churn", "engines")
_LATER_KINDS = ("reset", "full", "slow")
KINDS = _FIRST_KINDS + _LATER_KINDS


@dataclass(frozen=True)
class Fault:
    """One fault: what happens, to whom, when and for how long (virtual seconds)."""

    kind: str
    target: str  # a worker's name, a node's host, or "" for the whole server or network
    at_s: float
    for_s: float
    keep_files: bool = True  # a crash's: does the worker come back with its files?
    latency_s: float = 0.0  # a slow disk's: how long each of its operations takes

    def __str__(self) -> str:
        what = f"{self.kind} {self.target}".strip()
        files = "" if self.keep_files else ", without its files"
        latency = f", {self.latency_s * 1000:.0f} ms an operation" if self.latency_s else ""
        return f"{what} at {self.at_s:.2f}s for {self.for_s:.2f}s{files}{latency}"


@dataclass(frozen=True)
class FaultPlan:
    """Every fault of one run, in the order they start."""

    faults: tuple[Fault, ...] = ()
    lost_acks: float = 0.0
    late_acks: bool = False
    pin_overlap_s: float = 0.0
    skews_s: dict[str, float] = field(default_factory=dict)
    engines: EngineFaults = field(default_factory=EngineFaults)

    def describe(self) -> list[str]:
        """One line per fault and per property, for a report."""
        lines = [str(fault) for fault in self.faults]
        if self.lost_acks:
            lines.append(f"publish acks lost: {self.lost_acks:.1%}")
        if self.late_acks:
            lines.append("late acks accepted")
        if self.pin_overlap_s:
            lines.append(f"old pins served for {self.pin_overlap_s:.2f}s after a change")
        lines.extend(f"{name}'s clock {skew:+.2f}s" for name, skew in self.skews_s.items() if skew)
        if self.engines != EngineFaults(seed=self.engines.seed):
            lines.append(f"engines: {self.engines}")
        return lines


def draw(
    chance: random.Random,
    *,
    workers: list[str],
    nodes: list[str],
    duration_s: float,
    kinds: Collection[str] | None = None,
) -> FaultPlan:
    """The faults of a run whose fault phase lasts `duration_s`, among these workers and nodes;
    of the `kinds` named, all of them, if given (else each kind with even odds). `ValueError`
    for a kind that is not one of `KINDS`."""
    if kinds is not None and (unknown := sorted(set(kinds) - set(KINDS))):
        raise ValueError(
            f"no fault kind {', '.join(map(repr, unknown))}; the kinds are: {', '.join(KINDS)}"
        )

    def enable(kind: str) -> bool:
        # Drawn even when forced: forcing the kinds a seed draws anyway replays that seed.
        drawn = chance.random() < 0.5
        return kind in kinds if kinds is not None else drawn

    enabled = {kind: enable(kind) for kind in _FIRST_KINDS}
    # A fault starts after the tier had a few seconds to form, and ends by the quiet phase
    # (which heals whatever is still on).
    start, end = min(5.0, duration_s / 4), duration_s
    faults: list[Fault] = []

    def times(kind: str, per_minute_max: float) -> list[float]:
        if not enabled[kind] or end <= start:
            return []
        count = round(chance.uniform(0.5, per_minute_max) * (end - start) / 60.0)
        return sorted(chance.uniform(start, end) for _ in range(max(1, count)))

    for at in times("crash", 4):
        keep = chance.random() >= 0.25
        faults.append(
            Fault("crash", chance.choice(workers), at, chance.uniform(0.5, 10.0), keep_files=keep)
        )
    for at in times("pause", 3):
        faults.append(Fault("pause", chance.choice(workers), at, chance.uniform(0.5, 15.0)))
    node_free_at = 0.0
    for drawn_at in times("node", 3):
        at = max(drawn_at, node_free_at)  # one node down at a time
        down_s = chance.uniform(1.0, 10.0)
        faults.append(Fault("node", chance.choice(nodes), at, down_s))
        node_free_at = at + down_s + 1.0
    for at in times("election", 3):
        faults.append(Fault("election", "", at, chance.uniform(0.2, 5.0)))
    for at in times("delay", 2):
        faults.append(Fault("delay", "", at, chance.uniform(1.0, 10.0)))
    if enabled["churn"]:
        at = chance.uniform(start, end)
        faults.append(Fault("churn", "joiner", at, chance.uniform(2.0, 30.0)))
    for at in times("engines", 2):
        faults.append(Fault("engines", "engines", at, chance.uniform(1.0, 15.0)))
    lost_acks = chance.uniform(0.0, 0.05) if chance.random() < 0.5 else 0.0
    late_acks = chance.random() < 0.5
    pin_overlap_s = chance.uniform(0.0, 0.5) if chance.random() < 0.5 else 0.0
    skews_s = {name: chance.uniform(-2.0, 2.0) for name in workers}
    engines = _engine_faults(chance)
    # Each later kind draws after all that came before it, so that adding it moves no draw.
    enabled["reset"] = enable("reset")
    for at in times("reset", 20):
        faults.append(Fault("reset", chance.choice(workers), at, chance.uniform(0.05, 2.0)))
    for kind in ("full", "slow"):
        enabled[kind] = enable(kind)
        free_at = 0.0  # one disk of each kind broken at a time: each fault heals its own
        for drawn_at in times(kind, 3):
            at, for_s = max(drawn_at, free_at), chance.uniform(0.5, 10.0)
            latency_s = chance.uniform(0.01, 0.2) if kind == "slow" else 0.0
            faults.append(Fault(kind, chance.choice(workers), at, for_s, latency_s=latency_s))
            free_at = at + for_s
    return FaultPlan(
        faults=tuple(sorted(faults, key=lambda fault: fault.at_s)),
        lost_acks=lost_acks,
        late_acks=late_acks,
        pin_overlap_s=pin_overlap_s,
        skews_s=skews_s,
        engines=engines,
    )


def _engine_faults(chance: random.Random) -> EngineFaults:
    """How the engines misbehave in this run: each way with even odds, at a drawn rate."""

    def maybe(high: float) -> float:
        return chance.uniform(0.0, high) if chance.random() < 0.5 else 0.0

    silent = chance.random() < 0.3
    return EngineFaults(
        seed=chance.getrandbits(32),
        fail_rate=maybe(0.1),
        drop_rate=maybe(0.1),
        duplicate_rate=maybe(0.1),
        delay_ms=maybe(200.0),
        # One engine of each type and role silent past a handoff's deadline (10 s by default).
        silent=1 if silent else 0,
        silent_ms=chance.uniform(5_000.0, 20_000.0) if silent else 0.0,
    )
