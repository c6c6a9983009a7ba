"""The benches' scripted success traffic, and what they share to measure it.

Every handoff is a success, half source-first (vLLM) and half destination-first (SGLang). Its
inputs are not written down here: `scripted_handoff` drives an `events.coordinator.
HandoffCoordinator` with a healthy engine's answers (`success_script`), so each handoff's
inputs (9 of them) and the actions each input makes the coordinator issue (6 in all) come from
the protocol itself. `interleave` mixes handoffs the way a closed loop of `window` handoffs in
flight would: a seeded random pick among the open handoffs emits that handoff's next input, and
a handoff that ends makes room for the next. So a batch mixes inputs of many handoffs, each
handoff's own inputs stay in order, and about `window` handoffs are open at a time.

`success_script` is the benches' own copy of the scripted engines' success path in
`tests.worker.scripted_engine`: benches are programs and import nothing from `tests`.

The rest is what the benches measure with: the load average, a process's CPU time and resident
size from /proc, nearest-rank percentiles, and `WorkerChild`, `kvhandoff run` as a child process
(`worker.harness.child`, which the demo and the tests share) with its metrics endpoint read.
"""

from __future__ import annotations

import os
import random
import sqlite3
import sys
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

# The repository root holds the packages: runnable from a checkout without installing.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvhandoff.worker.harness.child  # noqa: E402
from kvhandoff.events.codec import encode  # noqa: E402
from kvhandoff.events.coordinator import HandoffCoordinator  # noqa: E402
from kvhandoff.events.messages import (  # noqa: E402
    Action,
    EngineType,
    HandoffCompletion,
    Input,
    Role,
    StartHandoff,
)
from kvhandoff.events.subjects import Subjects  # noqa: E402
from kvhandoff.worker.engines.healthy import success_script  # noqa: E402
from kvhandoff.worker.harness.child import metric_sum  # noqa: E402

SUBJECTS = Subjects()
DEADLINE_MS = 600_000  # far beyond any run: no handoff may time out
T = TypeVar("T")


# --- The traffic ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    """One input of the traffic, and what the worker publishes when it handles it."""

    subject: str
    payload: bytes
    handoff_id: str
    index: int  # position among its handoff's inputs
    actions: tuple[tuple[str, bytes], ...]  # (subject, payload) of each action it issues


@dataclass(frozen=True, slots=True)
class Traffic:
    handoffs: int
    steps: list[Step]

    @property
    def actions(self) -> int:
        return sum(len(s.actions) for s in self.steps)


def new_start(i: int) -> StartHandoff:
    """The i-th handoff: engine types alternate, four engines of each role."""
    engine_type = EngineType.VLLM if i % 2 == 0 else EngineType.SGLANG
    return StartHandoff(
        uuid.uuid4(), engine_type, f"prefill-{i % 4}", f"decode-{i % 4}", DEADLINE_MS
    )


def route(start: StartHandoff, action: Action) -> str:
    """The subject the worker publishes `action` of `start`'s handoff to."""
    match action.executor:
        case Role.SOURCE:
            return SUBJECTS.engine(start.source)
        case Role.DESTINATION:
            return SUBJECTS.engine(start.destination)
        case Role.FRONTEND:
            return SUBJECTS.done(action.handoff_id)


def scripted_handoff(start: StartHandoff) -> list[Step]:
    """A success handoff's inputs, in the order the worker sees them: the coordinator's actions
    answered with `success_script`, first issued first answered."""
    coordinator = HandoffCoordinator.for_start(start)
    pending: deque[Input] = deque([start])
    steps: list[Step] = []
    hid = str(start.handoff_id)
    while pending:
        message = pending.popleft()
        actions = coordinator.handle(message)
        steps.append(
            Step(
                SUBJECTS.input(start.handoff_id),
                encode(message),
                hid,
                len(steps),
                tuple((route(start, a), encode(a)) for a in actions),
            )
        )
        for action in actions:
            pending.extend(success_script(action))
    if coordinator.completion is not HandoffCompletion.SUCCESS:
        raise SystemExit(f"the success script did not complete handoff {hid}")
    return steps


def interleave(handoffs: Iterator[list[T]], window: int, seed: int) -> Iterator[T]:
    """The inputs of `handoffs`, interleaved as a closed loop of `window` handoffs in flight
    would interleave them; lazily, so a long run never holds more than `window` in memory."""
    rng = random.Random(seed)
    open_: list[Iterator[T]] = [iter(h) for _, h in zip(range(window), handoffs, strict=False)]
    while open_:
        i = rng.randrange(len(open_))
        item = next(open_[i], None)
        if item is not None:
            yield item
            continue
        following = next(handoffs, None)
        if following is not None:
            open_[i] = iter(following)
        else:
            open_[i] = open_[-1]
            open_.pop()


def build_traffic(handoffs: int, window: int, seed: int) -> Traffic:
    """`handoffs` scripted handoffs, interleaved (see `interleave`), all in memory."""
    scripted = (scripted_handoff(new_start(i)) for i in range(handoffs))
    return Traffic(handoffs, list(interleave(scripted, window, seed)))


# --- Measuring ----------------------------------------------------------------------------------


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest rank."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU time of process `pid` so far (Linux only: None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # utime and stime are fields 14 and 15 of stat(5), 12 and 13 after the command name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def resident_mb(pid: int) -> float | None:
    """Resident set size of process `pid` in MB (Linux only: None elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class WorkerChild(kvhandoff.worker.harness.child.WorkerChild):
    """`kvhandoff run` with its defaults, on a fresh log, metrics on a free port: started (and
    healthy) when made, as every bench wants it."""

    def __init__(self, url: str, scratch: Path, batch_size: int) -> None:
        db = scratch / "worker.sqlite3"
        super().__init__(url, db, "--batch-size", str(batch_size), cwd=ROOT)
        self.start()

    def counter(self, name: str) -> float:
        """The sum of a metric's samples of that name, from /metrics."""
        return self.metric(name)

    def commits(self) -> tuple[float, float, float]:
        """Group commits so far, the inputs they held, and the seconds they took."""
        text = self.metrics()
        return (
            metric_sum(text, "kvhandoff_commit_batch_size_count"),
            metric_sum(text, "kvhandoff_commit_batch_size_sum"),
            metric_sum(text, "kvhandoff_commit_seconds_sum"),
        )


class RawLog:
    """The floor of a durable log: one raw row per input, one WAL synchronous=FULL transaction
    per batch, no projection, no outbox. Commit from a thread (`asyncio.to_thread`)."""

    def __init__(self, db: Path) -> None:
        self._db = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS inputs (handoff_id TEXT NOT NULL, seq INTEGER NOT NULL,"
            " at_ms INTEGER NOT NULL, payload BLOB NOT NULL, PRIMARY KEY (handoff_id, seq))"
        )

    def commit(self, rows: list[tuple[str, int, int, bytes]]) -> None:
        self._db.execute("BEGIN")
        self._db.executemany("INSERT INTO inputs VALUES (?, ?, ?, ?)", rows)
        self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()
