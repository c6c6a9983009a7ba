"""The local file trails the replicated log by a bounded amount (worker.tier.partition): with its
commits slowed to a crawl, the worker decides no batch while more than `COMMITS_AHEAD` local
commits of the partition are queued, so it holds a bounded number of batches' rows in memory
rather than queueing without end (unbounded, a drain faster than the file grew the worker by
3.7 KB a handoff until it stalled), and every handoff still completes.

The worker runs in this process (to read its queue), on a real nats-server and SQLite file; the
slow disk is a pause in the file's own writer thread.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Inbound
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.config import TierConfig, WorkerConfig
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.log import store
from kvhandoff.worker.log.rows import Batch
from kvhandoff.worker.tier import service
from kvhandoff.worker.tier.metrics import Metrics
from kvhandoff.worker.tier.owner import Decided
from kvhandoff.worker.tier.partition import COMMITS_AHEAD, Partition
from tests.eventually import until
from tests.worker.scripted_engine import ScriptedEngines
from tests.worker.test_faults import make_starts

_SLOW_WRITE_S = 0.02  # per batch, in the writer's thread: far slower than deciding one


async def test_a_slow_file_holds_the_worker_back_instead_of_queueing_without_bound(
    nats_server: EmbeddedNats,
    engines: ScriptedEngines,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    write = store._write_batch

    def slow_write(db: sqlite3.Connection, batch: Batch) -> None:
        time.sleep(_SLOW_WRITE_S)  # a slow disk, on the writer's thread (not the event loop)
        write(db, batch)

    monkeypatch.setattr(store, "_write_batch", slow_write)
    # How many local commits were queued each time a batch was decided.
    queued: list[int] = []
    decide = Partition.decide

    async def watched_decide(self: Partition, batch: Sequence[Inbound]) -> Decided:
        decided = await decide(self, batch)
        queued.append(len(self.committing))
        return decided

    monkeypatch.setattr(Partition, "decide", watched_decide)
    config = WorkerConfig(
        nats=NatsSettings(url=nats_server.url),
        db_path=tmp_path / "kvhandoff.db",
        tier=TierConfig(batch_size=16),
    )
    bus = await Bus.connect(config.nats, "test-backlog")
    worker = service.Worker(config, service.tier_settings(config), bus, Metrics(), label="test")
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        await until(lambda: worker.healthy, "the worker to claim its partition")
        starts = make_starts(300, random.Random(5))
        for start in starts:
            await engines.start_handoff(start)
        await engines.wait_complete({s.handoff_id for s in starts}, within=120)
    finally:
        stop.set()
        await asyncio.wait_for(running, timeout=60)
        await bus.close()
    # The bound was reached (the file was the slower side), and never passed: at most one
    # more than the bound, the commit that the batch just acted on queued.
    assert max(queued) >= COMMITS_AHEAD, queued
    assert max(queued) <= COMMITS_AHEAD + 1, queued
