"""`kvhandoff run` with snapshots, as real processes on the real three-node cluster:

- at one partition, the owner snapshots every few entries and is killed with SIGKILL mid-load;
  a new worker's claim reads one snapshot and the entries after it (asserted on what it read,
  not on a time), every handoff completes once, and each handoff's history is whole in the
  file of the worker that completed it, which `kvhandoff verify` passes;
- a handoff that completed and was snapshotted away is known to the next owner, whose file
  never held it, by its tombstone: a frontend's retried start is a duplicate (nothing is
  published again), a start of the same id with other contents is rejected;
- a handoff whose deadline is longer than half the log's old retention completes across a
  failover: the snapshot, not the retention, keeps what a new owner rebuilds it from.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import uuid
from pathlib import Path

from kvhandoff.events.messages import Action, EngineType, Input, StartHandoff
from kvhandoff.worker.config import partition_path
from kvhandoff.worker.engines.healthy import success_script
from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.log.schema import HandoffState
from tests.cluster.conftest import WITHIN_S, TierWorker, until
from tests.cluster.test_partitioned_run import (
    HANDOFFS,
    SUCCESS_EVENTS,
    check_each_completed_once,
    start,
    verify,
)
from tests.worker.scripted_engine import ScriptedEngines

SNAPSHOT_EVERY = 10  # entries: several snapshots in one run of the load
# "claimed as epoch E by OWNER (after PREVIOUS; read N entries, a snapshot first, of its log"
CLAIM = re.compile(
    r"claimed as epoch \d+ by \S+ \(after (\S+); read (\d+) entries(, a snapshot first)?"
)


def claims(worker: TierWorker) -> list[tuple[str, int, bool]]:
    """Its claims: after whom, how many entries of the log it read, and whether a snapshot
    came first."""
    return [(after, int(n), bool(s)) for after, n, s in CLAIM.findall(worker.whole_log())]


def histories(workers: list[TierWorker]) -> dict[uuid.UUID, list[tuple[str, int]]]:
    """Each handoff's ended states over the workers' files, with how many events each holds."""
    found: dict[uuid.UUID, list[tuple[str, int]]] = {}
    for worker in workers:
        path = partition_path(worker.data_dir, 0)
        if not path.exists():
            continue
        with open_log(path) as log:
            for row in log.handoffs():
                if row.state is not HandoffState.OPEN:
                    found.setdefault(row.handoff_id, []).append(
                        (row.state_name, len(log.load(row.handoff_id).events))
                    )
    return found


class Holding:
    """A script that answers nothing until released, then the success path: a handoff that
    stays open across a failover."""

    def __init__(self) -> None:
        self.held: list[Action] = []
        self.released = False

    def __call__(self, action: Action) -> list[Input]:
        if not self.released:
            self.held.append(action)
            return []
        return success_script(action)

    def release(self, engines: ScriptedEngines) -> None:
        """Answer from now on; a held action delivered again counts as its first delivery."""
        self.released = True
        for action in self.held:
            key = (action.handoff_id, action.action_id)
            del engines.first[key], engines.replies[key], engines.effects[key]


async def an_owner(url: str, workers: list[TierWorker], tmp_path: Path, *extra: str) -> TierWorker:
    """w1, once it claimed the one partition."""
    w1 = TierWorker(url, "w1", tmp_path, *extra, partitions=1)
    workers.append(w1)
    w1.start(timeout_s=2 * WITHIN_S)
    await until(lambda: bool(claims(w1)), "w1 claims the partition")
    return w1


def a_successor(url: str, workers: list[TierWorker], tmp_path: Path, *extra: str) -> TierWorker:
    """w2, started on a data directory of its own, empty."""
    w2 = TierWorker(url, "w2", tmp_path, *extra, partitions=1)
    workers.append(w2)
    w2.start(timeout_s=2 * WITHIN_S)
    return w2


async def test_a_new_owner_claims_from_the_last_snapshot_and_its_tail_after_a_kill(
    nats_cluster: NatsCluster, workers: list[TierWorker], tmp_path: Path
) -> None:
    url = nats_cluster.url
    every = ("--snapshot-every", str(SNAPSHOT_EVERY))
    w1 = await an_owner(url, workers, tmp_path, *every)
    engines = ScriptedEngines(url.split(",")[0])
    await engines.start()
    starts = [start(n) for n in range(HANDOFFS)]
    try:
        for s in starts[: HANDOFFS // 2]:
            await engines.start_handoff(s)
        # The claim's snapshot and one more: the log rolled up more entries than it keeps.
        await engines.until(
            lambda: (
                len(engines.completions) >= HANDOFFS // 4
                and w1.whole_log().count("snapshot at") >= 2
            ),
            "a quarter of the handoffs to complete, and two snapshots",
            within=4 * WITHIN_S,
        )
        w1.kill()
        w2 = a_successor(url, workers, tmp_path, *every)
        for s in starts[HANDOFFS // 2 :]:
            await engines.start_handoff(s)
        await engines.wait_complete({s.handoff_id for s in starts}, 4 * WITHIN_S)
        assert await asyncio.to_thread(w2.terminate, 2 * WITHIN_S) == 0, w2.logs()
    finally:
        await engines.close()

    check_each_completed_once(engines)
    assert set(engines.effects.values()) == {1}
    taken_over = [c for c in claims(w2) if c[0] != "nobody"]
    assert taken_over, w2.whole_log()
    # One snapshot (one message, or the parts of one) and at most an interval of entries after
    # it, with the claims and hand-overs between: never the history.
    for _, read, snapshot_first in taken_over:
        assert snapshot_first
        assert read <= SNAPSHOT_EVERY + 8, taken_over
    ended = histories([w1, w2])
    assert ended.keys() == {s.handoff_id for s in starts}
    for handoff, states in ended.items():
        # Whole in the file of the worker that completed it; another file may know its end
        # from a tombstone, by the state alone.
        assert ("succeeded", SUCCESS_EVENTS) in states, (handoff, states)
    verify(w1.data_dir)
    verify(w2.data_dir)


async def test_a_late_input_for_a_handoff_snapshotted_away_is_answered_by_its_tombstone(
    nats_cluster: NatsCluster, workers: list[TierWorker], tmp_path: Path
) -> None:
    url = nats_cluster.url
    engines = ScriptedEngines(url.split(",")[0])
    await engines.start()
    try:
        w1 = TierWorker(url, "w1", tmp_path, partitions=1)
        workers.append(w1)
        w1.start(timeout_s=2 * WITHIN_S)
        done = start(0)
        await engines.start_handoff(done)
        await engines.wait_complete({done.handoff_id}, 2 * WITHIN_S)
        assert await asyncio.to_thread(w1.terminate, 2 * WITHIN_S) == 0, w1.logs()

        w2 = TierWorker(url, "w2", tmp_path, partitions=1)  # a file that never held it
        workers.append(w2)
        w2.start(timeout_s=2 * WITHIN_S)
        sent = len(engines.actions_of(done.handoff_id))
        await engines.start_handoff(done)  # a frontend's retry: the very same start
        other = StartHandoff(done.handoff_id, EngineType.SGLANG, "prefill-1", "decode-1", 60_000)
        await engines.start_handoff(other)
        rejection = await engines.wait_rejection(done.handoff_id)
        assert "ended (succeeded)" in rejection.reason, rejection
        # The partition applies its inputs in order: once this one completed, the retry was
        # seen, and it published nothing.
        after = start(1)
        await engines.start_handoff(after)
        await engines.wait_complete({after.handoff_id}, 2 * WITHIN_S)
        assert len(engines.actions_of(done.handoff_id)) == sent
        assert w2.metric("kvhandoff_duplicate_inputs_total") >= 1
        assert await asyncio.to_thread(w2.terminate, 2 * WITHIN_S) == 0, w2.logs()
    finally:
        await engines.close()

    claimed = claims(w2)
    assert claimed and claimed[0][2], claimed  # w2 read w1's hand-over snapshot
    path = partition_path(w2.data_dir, 0)
    with open_log(path) as log:
        assert done.handoff_id not in {row.handoff_id for row in log.handoffs()}
    with sqlite3.connect(path) as db:
        tombstones = db.execute("SELECT handoff_id, state FROM tombstones").fetchall()
    assert tombstones == [(str(done.handoff_id), "succeeded")]
    verify(w2.data_dir)


async def test_a_handoff_with_a_deadline_past_the_old_retention_rule_completes_across_a_failover(
    nats_cluster: NatsCluster, workers: list[TierWorker], tmp_path: Path
) -> None:
    url = nats_cluster.url
    w1 = await an_owner(url, workers, tmp_path, "--retention", "2h")
    holding = Holding()
    engines = ScriptedEngines(url.split(",")[0], holding)
    await engines.start()
    try:
        # Three hours: more than half of --retention, which the log's retention once capped.
        long = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 3 * 3_600_000)
        await engines.start_handoff(long)
        await engines.until(lambda: bool(holding.held), "its first action to reach an engine")
        w1.kill()
        w2 = a_successor(url, workers, tmp_path, "--retention", "2h")
        await until(lambda: len(claims(w2)) >= 1, "w2 takes the partition over")
        holding.release(engines)  # the new owner publishes it again, and it is answered now
        await engines.wait_complete({long.handoff_id}, 4 * WITHIN_S)
        assert await asyncio.to_thread(w2.terminate, 2 * WITHIN_S) == 0, w2.logs()
    finally:
        await engines.close()
    check_each_completed_once(engines)
    verify(w2.data_dir)
