"""A flood of inputs for handoffs that never started must not starve the valid ones.

Reproduced before the fix: 5,000 well-formed `failed` facts for unknown handoffs (60 bytes each,
sent in about half a second) cut a 500-handoff load from 115 to 2.9 handoffs/s, and 64 handoffs
missed their deadline. Here a closed-loop load of valid handoffs is measured alone and then
with that flood published beside it, against the same worker in the same test: the flooded
median latency must stay within twice the baseline's, no handoff may time out, and every fact
of the flood must end rejected.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from kvhandoff.events.messages import EngineType, HandoffCompletion, StartHandoff
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.eventually import until
from tests.worker.bus_probe import BusProbe, assert_alive, rejected_ids, running
from tests.worker.conftest import WorkerProcess
from tests.worker.scripted_engine import ScriptedEngines

LOAD = 300  # valid handoffs per measured run
CONCURRENCY = 32  # handoffs open at once (the load generator's default)
DEADLINE_MS = 10_000  # some 20 times the latency this load sees without a flood
FLOOD = 5_000
FLOOD_AFTER = LOAD // 10  # completions before the flood starts: it hits a load in full swing
ATTEMPTS = 3  # a noisy shared machine may slow one measurement; a starved worker fails all
REPO = Path(__file__).resolve().parents[2]
ENGINE_TYPES = [EngineType.VLLM, EngineType.SGLANG, EngineType.TRTLLM]


@pytest.fixture
async def probe(nats_server: EmbeddedNats) -> AsyncIterator[BusProbe]:
    observer = BusProbe(nats_server.url)
    await observer.start(rejections=False)
    yield observer
    await observer.close()


@dataclass(frozen=True)
class Run:
    latencies_s: list[float]
    elapsed_s: float

    @property
    def median_s(self) -> float:
        return statistics.median(self.latencies_s)

    def __str__(self) -> str:
        p90 = statistics.quantiles(self.latencies_s, n=10)[-1]
        return (
            f"{len(self.latencies_s)} handoffs in {self.elapsed_s:.2f}s, median"
            f" {self.median_s * 1000:.0f}ms, p90 {p90 * 1000:.0f}ms"
        )


async def run_load(
    engines: ScriptedEngines, probe: BusProbe, count: int, started: asyncio.Event | None = None
) -> Run:
    """`count` handoffs, `CONCURRENCY` at a time; each one's latency runs from its start
    command's publication to the frontend's receipt of its Complete. `started` is set once
    `FLOOD_AFTER` handoffs have completed."""
    starts = [
        StartHandoff(
            uuid.uuid4(), ENGINE_TYPES[i % 3], f"prefill-{i % 2}", f"decode-{i % 2}", DEADLINE_MS
        )
        for i in range(count)
    ]
    pending = iter(starts)
    latencies: list[float] = []

    async def lane() -> None:
        for start in pending:
            began = time.monotonic()
            await engines.start_handoff(start)
            complete = await probe.wait_completion(start.handoff_id, within=DEADLINE_MS / 1000 * 3)
            assert complete.completion is HandoffCompletion.SUCCESS, (
                f"{start.handoff_id} ended {complete.completion.value}: it missed its deadline"
            )
            latencies.append(probe.completed_at[start.handoff_id] - began)
            if started is not None and len(latencies) >= FLOOD_AFTER:
                started.set()

    began = time.monotonic()
    await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))
    return Run(latencies, time.monotonic() - began)


class Flooder:
    """`tests.worker.flooder` in a process of its own, connected and waiting for `go()`."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def ready(cls, url: str, ids_file: Path) -> Flooder:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.worker.flooder",
            url,
            str(ids_file),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=REPO,
        )
        flooder = cls(process)
        assert await flooder._line() == "ready"
        return flooder

    async def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        await self.process.stdin.drain()

    async def sent(self) -> float:
        """Seconds the flood took to publish, once it is all in the stream."""
        elapsed = float(await self._line())
        assert await self.process.wait() == 0
        return elapsed

    async def _line(self) -> str:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), 60)
        return line.decode().strip()

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


def all_rejected(db: Path, ids: set[uuid.UUID]) -> bool:
    return ids <= rejected_ids(db)


async def test_a_flood_of_facts_for_unknown_handoffs_does_not_starve_valid_ones(
    worker: WorkerProcess, engines: ScriptedEngines, probe: BusProbe, tmp_path: Path
) -> None:
    assert worker.process is not None
    pid = worker.process.pid
    await run_load(engines, probe, 50)  # warm-up: imports, page cache, connections
    measured: list[str] = []
    for attempt in range(ATTEMPTS):
        await probe.wait_settled(worker, within=120)
        baseline = await run_load(engines, probe, LOAD)

        ghosts = [uuid.uuid4() for _ in range(FLOOD)]
        ids_file = tmp_path / f"flood-{attempt}.txt"
        ids_file.write_text("\n".join(map(str, ghosts)))
        flooder = await Flooder.ready(probe.url, ids_file)
        try:
            in_swing = asyncio.Event()
            load = asyncio.create_task(run_load(engines, probe, LOAD, in_swing))
            swinging = asyncio.create_task(in_swing.wait())
            await asyncio.wait([load, swinging], return_when=asyncio.FIRST_COMPLETED)
            swinging.cancel()
            if load.done():
                load.result()  # it failed before the flood could start
            await flooder.go()
            # A starved worker takes minutes; a healthy one barely notices the flood.
            bound = max(20.0, 10 * baseline.elapsed_s)
            try:
                flooded = await asyncio.wait_for(load, bound)
            except TimeoutError:
                raise AssertionError(
                    f"the flooded load did not finish in {bound:.0f}s (baseline: {baseline})"
                ) from None
            sent_in = await flooder.sent()
        finally:
            await flooder.stop()
        measured.append(
            f"baseline {baseline}; flooded {flooded}; {FLOOD} facts sent in {sent_in:.2f}s"
        )

        # Every fact of the flood ends rejected, and nothing is left in the stream.
        await probe.wait_settled(worker, within=120)
        # In the log too: a tier worker's file may trail what it settled by its last commits.
        await until(
            partial(all_rejected, worker.db, set(ghosts)),
            "every fact of the flood rejected in the log",
            guard=running(worker),
        )
        assert_alive(worker, pid)
        if flooded.median_s <= 2 * baseline.median_s:
            return
    raise AssertionError("the flood at least doubled the median latency: " + " | ".join(measured))
