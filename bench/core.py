"""Throughput of the pure handoff coordinator, with no bus and no log.

Run as `python bench/core.py [--runs N] [--handoffs N]`.

What is measured
----------------
Four complete handoffs, each driven through `HandoffCoordinator.handle`, the one entry point
the worker and replay use, by an engine that answers every action at once:

- ``source-first success``: start, Submitted, SourceHeld, Accepted, DestinationReserved,
  Scheduled, TransferCompleted, Applied (activation), Applied (release): 9 inputs.
- ``destination-first success``: the same nine inputs in the SGLang order.
- ``source-first cancel``: start, Submitted, SourceHeld (issues ReserveDestination), Canceled
  (issues CancelSource and CancelDestination), then both cleanup outcomes: 6 inputs.
- ``destination-first cancel``: start (issues ReserveDestination), Canceled (issues
  CancelDestination), Applied: 3 inputs.

Every input Struct (and each handoff's UUID) is built before the clock starts; a fresh
coordinator per handoff is part of the timed cost, as it is in the worker. Each handoff's
result is checked once, outside the timing, to end in the expected `Complete`. Every figure is
the median of `--runs` runs (default 7), since the machine is shared and noisy; the garbage
collector stays on, as in the worker.

The baseline
------------
Numbers of handoffs per second mean little on their own: they move with the machine, its load
and the interpreter. So each run also times a bare-Python floor for the same work shape, and the
table prints the coordinator's cost as a multiple of it. The floor is what any implementation
of this API must pay in CPython, with no state machine logic at all: per handoff, construct one
small slotted object; per input, one bound-method call that takes the input Struct, builds one
small frozen msgspec Struct (an action-sized object) and returns it in a new list. So
"x baseline = 3.0" means the coordinator's decisions, bookkeeping and validation cost twice as
much again as the unavoidable call-and-allocate overhead. Each run times the coordinator and
the floor back to back, and the multiple is the median of the per-run ratios, so a burst of load
from a neighbour moves both sides of a ratio together. Comparing the multiple across commits is
far more stable than comparing raw rates.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from msgspec import Struct

# Runnable from a checkout (`python bench/core.py`) without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvhandoff.events.coordinator import HandoffCoordinator
from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    SCHEDULED,
    SUBMITTED,
    Action,
    ActionOutcome,
    Canceled,
    Complete,
    DestinationReserved,
    EngineType,
    HandoffCompletion,
    HandoffOrder,
    HandoffTransferTiming,
    Input,
    KvTransferTimingMode,
    SourceHeld,
    StartHandoff,
    TransferCompleted,
)

_TIMING = HandoffTransferTiming(
    mode=KvTransferTimingMode.FULL_PROMPT,
    full_prompt_tokens=4096,
    kv_bytes_per_token=131_072,
    bandwidth_gb_s=25.0,
)

Script = list[tuple[HandoffOrder, list[Input]]]


def _start(handoff_id: uuid.UUID, order: HandoffOrder) -> StartHandoff:
    engine = EngineType.VLLM if order is HandoffOrder.SOURCE_FIRST else EngineType.SGLANG
    return StartHandoff(handoff_id, engine, "prefill-0", "decode-0", deadline_ms=30_000)


def source_first_success(h: uuid.UUID) -> list[Input]:
    return [
        _start(h, HandoffOrder.SOURCE_FIRST),
        ActionOutcome(h, 0, SUBMITTED),
        SourceHeld(h, _TIMING),
        ActionOutcome(h, 1, ACCEPTED),
        DestinationReserved(h, 4096),
        ActionOutcome(h, 2, SCHEDULED),
        TransferCompleted(h),
        ActionOutcome(h, 3, APPLIED),
        ActionOutcome(h, 4, APPLIED),
    ]


def destination_first_success(h: uuid.UUID) -> list[Input]:
    return [
        _start(h, HandoffOrder.DESTINATION_FIRST),
        ActionOutcome(h, 0, ACCEPTED),
        DestinationReserved(h, 4096),
        ActionOutcome(h, 1, SUBMITTED),
        SourceHeld(h, _TIMING),
        ActionOutcome(h, 2, SCHEDULED),
        TransferCompleted(h),
        ActionOutcome(h, 3, APPLIED),
        ActionOutcome(h, 4, APPLIED),
    ]


def source_first_cancel(h: uuid.UUID) -> list[Input]:
    return [
        _start(h, HandoffOrder.SOURCE_FIRST),
        ActionOutcome(h, 0, SUBMITTED),
        SourceHeld(h, _TIMING),
        Canceled(h),
        ActionOutcome(h, 2, APPLIED),
        ActionOutcome(h, 3, APPLIED),
    ]


def destination_first_cancel(h: uuid.UUID) -> list[Input]:
    return [
        _start(h, HandoffOrder.DESTINATION_FIRST),
        Canceled(h),
        ActionOutcome(h, 1, APPLIED),
    ]


@dataclass(frozen=True)
class Scenario:
    name: str
    order: HandoffOrder
    build: Callable[[uuid.UUID], list[Input]]
    completion: HandoffCompletion


SCENARIOS = [
    Scenario(
        "source-first success",
        HandoffOrder.SOURCE_FIRST,
        source_first_success,
        HandoffCompletion.SUCCESS,
    ),
    Scenario(
        "destination-first success",
        HandoffOrder.DESTINATION_FIRST,
        destination_first_success,
        HandoffCompletion.SUCCESS,
    ),
    Scenario(
        "source-first cancel",
        HandoffOrder.SOURCE_FIRST,
        source_first_cancel,
        HandoffCompletion.CANCELED,
    ),
    Scenario(
        "destination-first cancel",
        HandoffOrder.DESTINATION_FIRST,
        destination_first_cancel,
        HandoffCompletion.CANCELED,
    ),
]


def run_coordinator(handoffs: Sequence[tuple[uuid.UUID, HandoffOrder, list[Input]]]) -> float:
    """Seconds to drive every prebuilt handoff through a fresh coordinator."""
    new = HandoffCoordinator
    t0 = time.perf_counter()
    for handoff_id, order, inputs in handoffs:
        handle = new(handoff_id, order).handle
        for message in inputs:
            handle(message)
    return time.perf_counter() - t0


class _Floor:
    """The baseline's per-handoff object: one slotted instance, one method per input."""

    __slots__ = ("handoff_id", "n")

    def __init__(self, handoff_id: uuid.UUID) -> None:
        self.handoff_id = handoff_id
        self.n = 0

    def handle(self, message: Input) -> list[_Step]:
        n = self.n
        self.n = n + 1
        return [_Step(message.handoff_id, n)]


class _Step(Struct, frozen=True):
    handoff_id: uuid.UUID
    action_id: int


def run_baseline(handoffs: Sequence[tuple[uuid.UUID, HandoffOrder, list[Input]]]) -> float:
    """Seconds for the bare-Python floor over the same prebuilt inputs (see module docstring)."""
    new = _Floor
    t0 = time.perf_counter()
    for handoff_id, _order, inputs in handoffs:
        handle = new(handoff_id).handle
        for message in inputs:
            handle(message)
    return time.perf_counter() - t0


def _check(scenario: Scenario, inputs: list[Input], handoff_id: uuid.UUID) -> None:
    coordinator = HandoffCoordinator(handoff_id, scenario.order)
    last: list[Action] = []
    for message in inputs:
        last = coordinator.handle(message)
    if not (last and isinstance(last[-1], Complete) and last[-1].completion is scenario.completion):
        raise SystemExit(f"{scenario.name}: did not end in Complete({scenario.completion})")


@dataclass
class Row:
    name: str
    inputs: int
    handoffs_per_s: float
    inputs_per_s: float
    us_per_handoff: float
    x_baseline: float


def measure(scenario: Scenario, n: int, runs: int) -> Row:
    handoffs = []
    for _ in range(n):
        h = uuid.uuid4()
        handoffs.append((h, scenario.order, scenario.build(h)))
    _check(scenario, handoffs[0][2], handoffs[0][0])
    steps = len(handoffs[0][2])
    ours: list[float] = []
    ratios: list[float] = []
    for _ in range(runs):
        gc.collect()
        t = run_coordinator(handoffs)
        gc.collect()
        ours.append(t)
        ratios.append(t / run_baseline(handoffs))
    t = statistics.median(ours)
    return Row(scenario.name, steps, n / t, n * steps / t, t / n * 1e6, statistics.median(ratios))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs per figure (median)")
    parser.add_argument("--handoffs", type=int, default=10_000, help="handoffs per run")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.handoffs < 1:
        parser.error("--runs and --handoffs must be at least 1")

    rows = [measure(s, args.handoffs, args.runs) for s in SCENARIOS]
    print(f"python {sys.version.split()[0]}, {args.handoffs} handoffs x {args.runs} runs, medians")
    header = (
        f"{'scenario':<26} {'inputs':>6} {'handoffs/s':>11} {'inputs/s':>11} "
        f"{'us/handoff':>10} {'x baseline':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.name:<26} {r.inputs:>6} {r.handoffs_per_s:>11,.0f} {r.inputs_per_s:>11,.0f} "
            f"{r.us_per_handoff:>10.2f} {r.x_baseline:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
