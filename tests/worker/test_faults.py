"""The worker under faults: SIGKILL at random points under load, a NATS restart, and a crash
between commit and publish. After each, every handoff completes, action ids are stable, each
action takes effect once, and the log replays to exactly what was published."""

from __future__ import annotations

import random
import sqlite3
import uuid
from functools import partial
from pathlib import Path

import pytest

from kvhandoff.events.coordinator import HandoffCoordinator
from kvhandoff.events.messages import Complete, EngineType, ReserveDestination, StartHandoff
from kvhandoff.events.records import ActionRecord, InputRecord
from kvhandoff.events.replay import find_divergence
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.log.rows import Batch, HandoffRow
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.log.store import EventLog
from tests.eventually import until
from tests.worker.conftest import WorkerProcess, logged, logged_actions
from tests.worker.scripted_engine import ScriptedEngines

ENGINE_TYPES = [EngineType.VLLM, EngineType.SGLANG, EngineType.TRTLLM]


def make_starts(count: int, rng: random.Random) -> list[StartHandoff]:
    return [
        StartHandoff(
            uuid.UUID(int=rng.getrandbits(128), version=4),
            rng.choice(ENGINE_TYPES),
            f"prefill-{rng.randrange(4)}",
            f"decode-{rng.randrange(4)}",
            deadline_ms=600_000,
        )
        for _ in range(count)
    ]


def seen_at_least(engines: ScriptedEngines, count: int) -> bool:
    return len(engines.first) >= count


def assert_consistent(db: Path, engines: ScriptedEngines, starts: list[StartHandoff]) -> None:
    assert not engines.mismatched, "an action id was reused for a different action"
    assert set(engines.effects.values()) == {1}
    for start in starts:
        h = start.handoff_id
        completions = engines.completions[h]
        assert len(set(completions)) == 1, f"{h}: different completions {completions}"
        published = engines.actions_of(h)
        assert [a.action_id for a in published] == list(range(len(published)))
        assert logged_actions(db, h) == published, f"{h}: the log differs from what was published"
        assert find_divergence(logged(db, h).records()) is None


@pytest.mark.slow
def exit_status(worker: WorkerProcess, timeout_s: float) -> int:
    """Launch the worker and wait for it to exit on its own; a worker that did not is not left
    running."""
    worker.launch()
    assert worker.process is not None
    try:
        return worker.process.wait(timeout=timeout_s)
    finally:
        worker.stop()


async def test_sigkill_at_random_points_loses_nothing(
    worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    rng = random.Random(20261130)
    starts = make_starts(2000, rng)
    expected_actions = 6 * len(starts)  # every success path issues six actions
    kill_points = sorted(rng.sample(range(expected_actions // 10, expected_actions * 9 // 10), 4))

    for start in starts:
        await engines.start_handoff(start)
    for point in kill_points:
        # Kill when the engines have seen this many distinct actions: a random point in
        # whatever the worker was doing (fetching, committing, publishing or acking).
        await engines.until(partial(seen_at_least, engines, point), f"{point} actions")
        worker.kill()
        worker.start()
    await engines.wait_complete({s.handoff_id for s in starts}, within=180)
    assert "recovered" in worker.logs()
    # Stopped first: a tier worker's local file may trail what it published (its log is the
    # replicated one), and a drained stop commits it all.
    assert worker.terminate() == 0
    assert_consistent(worker.db, engines, starts)


@pytest.mark.slow
async def test_nats_restart_mid_load(
    nats_server: EmbeddedNats, worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    rng = random.Random(7)
    starts = make_starts(500, rng)
    for start in starts:
        await engines.start_handoff(start)
    await engines.until(lambda: len(engines.first) >= 1000, "a third of the load")
    nats_server.stop()
    nats_server.start()
    # Completes published while the frontend was cut off are gone (core NATS), so the log
    # is the judge of completion; every handoff must still end with the same guarantees.
    await wait_closed(worker.db, len(starts))
    assert not engines.mismatched
    assert set(engines.effects.values()) == {1}
    for start in starts:
        assert find_divergence(logged(worker.db, start.handoff_id).records()) is None
        assert isinstance(logged_actions(worker.db, start.handoff_id)[-1], Complete)


async def wait_closed(db: Path, count: int, within: float = 180.0) -> None:
    """Poll the worker's log until `count` handoffs are closed (the worker is another process)."""
    closed = [0]

    def all_closed() -> bool:
        with sqlite3.connect(db) as connection:
            (closed[0],) = connection.execute(
                "SELECT count(*) FROM handoffs WHERE state != 'open'"
            ).fetchone()
        return closed[0] == count

    await until(
        all_closed,
        f"{count} handoffs closed",
        within=within,
        every=0.1,
        context=lambda: f"{closed[0]} closed",
    )


async def test_actions_committed_but_never_published_are_published_on_start(
    nats_server: EmbeddedNats, engines: ScriptedEngines, tmp_path: Path
) -> None:
    """A crash between commit and publish, made exactly: commit without publishing."""
    db = tmp_path / "crashed.db"
    log = await EventLog.open(db)
    open_one = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 600_000)
    batch = Batch()
    for start in [open_one]:
        coordinator = HandoffCoordinator.for_start(start)
        actions = coordinator.handle(start)
        batch.append_input(0, InputRecord(1, start))
        for seq, action in enumerate(actions, start=1):
            batch.append_action(seq, ActionRecord(1, action))
        batch.upsert_handoff(
            HandoffRow(
                start.handoff_id,
                start.engine_type.value,
                start.source,
                start.destination,
                1,
                600_001,
                HandoffState.OPEN,
                None,
                len(actions),
                1,
            )
        )
    await log.commit(batch)
    await log.close()

    worker = WorkerProcess(nats_server.url, db)
    worker.start()
    try:
        await engines.wait_complete({open_one.handoff_id})
        assert engines.actions_of(open_one.handoff_id)[0].action_id == 0
        assert worker.terminate() == 0, worker.logs()  # the file committed in full
        assert_consistent(db, engines, [open_one])
        with sqlite3.connect(db) as connection:
            (unpublished,) = connection.execute(
                "SELECT count(*) FROM events e JOIN handoffs h USING (handoff_key)"
                " JOIN record_types t USING (type)"
                " WHERE t.kind = 'action' AND e.seq > h.published_seq"
            ).fetchone()
        assert unpublished == 0
    finally:
        worker.stop()


async def test_a_crash_after_an_append_before_anything_of_it_is_done_loses_nothing(
    nats_server: EmbeddedNats, engines: ScriptedEngines, tmp_path: Path
) -> None:
    """Killed after batch k's rows reached the replicated log, before its local commit, its
    publishes and its acks, with batch k+1 decided behind it and later inputs delivered: the
    restart catches the file up from the replicated log, k's actions come from it (the
    outbox), its inputs come back as duplicates, and k+1's and the later inputs, never
    appended, are applied then."""
    db = tmp_path / "kvhandoff.db"
    worker = WorkerProcess(nats_server.url, db)
    worker.start()  # creates the stream; stopped again so the inputs queue up in full batches
    assert worker.terminate() == 0
    starts = make_starts(400, random.Random(3))
    for start in starts:
        await engines.start_handoff(start)
    crashing = WorkerProcess(
        nats_server.url, db, "--batch-size", "64", module="tests.worker.crashing_worker"
    )
    assert exit_status(crashing, timeout_s=60) == 137, crashing.logs()
    assert "acted on none of it, batch" in crashing.logs()

    worker.start()
    try:
        await engines.wait_complete({s.handoff_id for s in starts}, within=120)
        assert worker.terminate() == 0  # the file committed in full
        assert_consistent(db, engines, starts)
    finally:
        worker.stop()


async def test_an_open_handoff_whose_log_this_build_rederives_differently_stops_the_start(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """A coordinator change that no longer matches the log is refused at start, naming the
    handoff and the step, rather than adopted and acted on differently from the log. A tier
    worker finds it at its claim of the partition, and stops alike."""
    worker = WorkerProcess(nats_server.url, tmp_path / "diverging.db")
    log = await EventLog.open(worker.db)
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 600_000)
    batch = Batch()
    batch.append_input(0, InputRecord(1, start))
    # What an older coordinator might have issued first; this one submits the prefill.
    batch.append_action(1, ActionRecord(1, ReserveDestination(start.handoff_id, 0)))
    batch.upsert_handoff(
        HandoffRow(
            start.handoff_id,
            start.engine_type.value,
            start.source,
            start.destination,
            1,
            600_001,
            HandoffState.OPEN,
            None,
            1,
            1,
        )
    )
    await log.commit(batch)
    await log.close()

    assert exit_status(worker, timeout_s=30) == 2, worker.logs()
    assert f"handoff {start.handoff_id} diverges at step 0" in worker.logs()
    assert "kvhandoff verify" in worker.logs()
