"""The outbox must not lie, and a frontend can always learn how its handoff ended.

Reproduced before the fix: NATS SIGKILLed under load, the worker SIGKILLed during the outage,
both restarted, and 4 frontends never got their `Complete`, while the log showed those handoffs
finished and their `Complete` published. During the outage `recover()` had marked its backlog
published without the publish barrier: the actions sat in the client's buffer, and died with it.

This test runs that exact sequence. Afterwards no action may be marked published at a moment
when NATS was down, every handoff ends in the log (which replays to what was issued), and every
frontend can read its handoff's last `Complete` from the `KVHANDOFF_DONE` stream after the fact.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from uuid import UUID

import pytest

from kvhandoff.events.messages import Complete, EngineType, StartHandoff
from kvhandoff.events.replay import find_divergence
from kvhandoff.events.subjects import DEFAULT_DONE_STREAM
from kvhandoff.worker.ambient import now_ms
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.eventually import until
from tests.worker.bus_probe import BusProbe, assert_running, running
from tests.worker.conftest import WorkerProcess, logged, logged_actions
from tests.worker.scripted_engine import ScriptedEngines

HANDOFFS = 1000
PACE_S = 0.002  # between start commands: some 500/s, more than the worker keeps up with
KILL_AFTER = HANDOFFS // 4  # completions before NATS dies: the load is in full swing
# Longer than the worker's 5 s publish barrier, so the worker goes through its outage handling
# (a flush that fails, a recovery attempt) before it is killed.
OUTAGE_S = 8.0
# A mark this long after NATS died cannot be a publish that reached NATS before it died.
MARK_SLACK_MS = 1_000
ENGINE_TYPES = [EngineType.VLLM, EngineType.SGLANG, EngineType.TRTLLM]


@pytest.fixture
async def probe(nats_server: EmbeddedNats) -> AsyncIterator[BusProbe]:
    observer = BusProbe(nats_server.url)
    await observer.start()
    yield observer
    await observer.close()


def marked_between(db: Path, since_ms: int, until_ms: int) -> list[tuple[str, int, str]]:
    """Actions the log says were published in that window: (handoff, seq, type). The log keeps
    one mark per handoff (its actions up to a seq were published by a time), so these are the
    actions of the handoffs whose mark last moved in that window."""
    with closing(sqlite3.connect(db, timeout=30)) as connection:
        rows = connection.execute(
            "SELECT h.handoff_id, e.seq, t.tag FROM handoffs h JOIN events e USING (handoff_key)"
            " JOIN record_types t USING (type) WHERE t.kind = 'action' AND e.seq <= h.published_seq"
            " AND h.published_at_ms >= ? AND h.published_at_ms < ? ORDER BY h.published_at_ms",
            (since_ms, until_ms),
        ).fetchall()
    return [(str(h), int(seq), str(kind)) for h, seq, kind in rows]


def open_count(db: Path) -> int:
    with closing(sqlite3.connect(db, timeout=30)) as connection:
        (count,) = connection.execute(
            "SELECT count(*) FROM handoffs WHERE state = 'open'"
        ).fetchone()
    return int(count)


async def stored_completions(
    probe: BusProbe, handoff_ids: list[UUID], within: float
) -> dict[UUID, Complete | None]:
    """Each handoff's Complete as KVHANDOFF_DONE keeps it, polling (bounded) for those that a
    restarted worker may still be publishing."""
    stored: dict[UUID, Complete | None] = dict.fromkeys(handoff_ids)
    deadline = time.monotonic() + within
    while True:
        for handoff_id in [h for h, c in stored.items() if c is None]:
            stored[handoff_id] = await probe.stored_completion(handoff_id)
        if all(stored.values()) or time.monotonic() > deadline:
            return stored
        await asyncio.sleep(0.2)  # a bounded poll of the server's stream


async def test_frontends_learn_every_completion_after_nats_and_the_worker_die(
    nats_server: EmbeddedNats, worker: WorkerProcess, engines: ScriptedEngines, probe: BusProbe
) -> None:
    rng = random.Random(20261201)
    starts = [
        StartHandoff(
            uuid.UUID(int=rng.getrandbits(128), version=4),
            rng.choice(ENGINE_TYPES),
            f"prefill-{rng.randrange(2)}",
            f"decode-{rng.randrange(2)}",
            600_000,
        )
        for _ in range(HANDOFFS)
    ]
    ids = [s.handoff_id for s in starts]

    async def frontends() -> None:
        # Start commands keep coming through the outage (each retries until NATS is back).
        for start in starts:
            await engines.start_handoff(start)
            await asyncio.sleep(PACE_S)  # the load's pace, not a wait for anything

    load = asyncio.create_task(frontends())
    await until(
        lambda: len(probe.completed_at) >= KILL_AFTER,
        "the load to get going",
        within=60,
        guard=running(worker),
    )
    assert not load.done(), "the load ended before NATS died: nothing was in flight"

    # NATS dies mid-load; the worker rides out the outage, and is killed during it.
    nats_killed_ms = now_ms()
    nats_server.stop(kill=True)
    outage_ends = time.monotonic() + OUTAGE_S
    while time.monotonic() < outage_ends:
        assert_running(worker)  # an outage is no reason to exit
        await asyncio.sleep(0.1)  # watching another process through the outage
    worker.kill()
    nats_server.start()
    nats_back_ms = now_ms()
    await until(
        lambda: probe.nc.is_connected and engines.nc.is_connected, "reconnection", within=60
    )
    worker.start()
    await asyncio.wait_for(load, 120)

    await until(
        lambda: not open_count(worker.db),
        "every handoff ended in the log",
        within=120,
        every=0.1,
        guard=running(worker),
        context=lambda: f"{open_count(worker.db)} still open",
    )

    # The outbox told the truth: nothing can have reached NATS while it was down.
    lies = marked_between(worker.db, nats_killed_ms + MARK_SLACK_MS, nats_back_ms)
    unheard = [h for h in ids if h not in probe.completions]
    assert not lies, (
        f"{len(lies)} actions marked published while NATS was down, e.g. {lies[:3]};"
        f" {len(unheard)} frontends never got a Complete live"
    )
    # Every frontend can learn how its handoff ended, after the fact.
    assert await probe.has_stream(DEFAULT_DONE_STREAM), (
        f"no {DEFAULT_DONE_STREAM} stream; {len(unheard)} frontends never got a Complete live"
    )
    stored = await stored_completions(probe, ids, within=60)
    for handoff_id in ids:
        last = logged_actions(worker.db, handoff_id)[-1]
        assert isinstance(last, Complete), f"{handoff_id} ended without a Complete: {last!r}"
        assert stored[handoff_id] == last, f"{handoff_id}: stored {stored[handoff_id]!r}"
        assert find_divergence(logged(worker.db, handoff_id).records()) is None
    assert not engines.mismatched, "an action id was reused for a different action"
