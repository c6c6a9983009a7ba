"""The timers of `kvhandoff run --partitions` (worker.tier.partition, worker.tier.timers), as real
processes on the real three-node cluster with the scripted engines: a deadline whose engine
never answers times the handoff out (a second `TimedOut`, as a fenced owner's late timer would
publish it, is dropped as a duplicate); an action without an outcome is published again with
the same action id, after the retry interval and then twice as long; a worker that hands a
partition over stops retrying its actions, and the next owner, claiming it vacant, takes them
up; and after its owner's SIGKILL, the new owner times out a handoff whose deadline passes
afterwards, no input coming to the partition.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from pathlib import Path
from uuid import UUID

from nats.aio.msg import Msg

from kvhandoff.events import codec
from kvhandoff.events.messages import (
    Action,
    EngineType,
    HandoffCompletion,
    Input,
    StartHandoff,
    SubmitPrefill,
    TimedOut,
)
from kvhandoff.worker.config import partition_path
from kvhandoff.worker.engines.healthy import success_script
from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.tier.balance import partition_of
from tests import eventually
from tests.cluster.conftest import PARTITIONS, WITHIN_S, TierWorker, until
from tests.worker.conftest import logged_inputs
from tests.worker.scripted_engine import Script, ScriptedEngines

RETRY_INTERVAL_S = 0.5
# Republished at 1 and then 2 intervals after the last publication; a publication is observed
# up to this much earlier or later than it was made.
JITTER_S = 0.2


def start(deadline_ms: int, partition: int | None = None) -> StartHandoff:
    """A vLLM handoff (its first action is the source's `SubmitPrefill`), in `partition` if
    given."""
    while True:
        handoff_id = uuid.uuid4()
        if partition is None or partition_of(handoff_id, PARTITIONS) == partition:
            return StartHandoff(handoff_id, EngineType.VLLM, "prefill-0", "decode-0", deadline_ms)


def silent_prefill(*silent: UUID) -> Script:
    """The success path, except that the source never answers these handoffs' `SubmitPrefill`."""

    def script(action: Action) -> list[Input]:
        if isinstance(action, SubmitPrefill) and action.handoff_id in silent:
            return []
        return success_script(action)

    return script


def timeouts_logged(worker: TierWorker, handoff_id: UUID) -> int:
    path = partition_path(worker.data_dir, partition_of(handoff_id, PARTITIONS))
    return sum(isinstance(i, TimedOut) for i in logged_inputs(path, handoff_id))


async def test_a_deadline_times_the_handoff_out_and_a_second_timed_out_is_a_duplicate(
    nats_cluster: NatsCluster, workers: list[TierWorker], tmp_path: Path
) -> None:
    w1 = TierWorker(nats_cluster.url, "w1", tmp_path)
    workers.append(w1)
    w1.start(timeout_s=2 * WITHIN_S)
    command = start(deadline_ms=2000)
    h = command.handoff_id
    engines = ScriptedEngines(nats_cluster.url.split(",")[0], silent_prefill(h))
    await engines.start()
    try:
        await engines.start_handoff(command)
        await engines.wait_complete({h}, within=2 * WITHIN_S)
        assert engines.completions[h][0].completion is HandoffCompletion.CANCELED
        kinds = [type(a).__name__ for a in engines.actions_of(h)]
        assert kinds == ["SubmitPrefill", "CancelSource", "Complete"]
        # An input like any other: appended and logged (the file commits behind the publishes).
        await until(lambda: timeouts_logged(w1, h) == 1, "the TimedOut is in the file")

        # What an owner that was fenced publishes when its timer fires before it learns so:
        # the same input, so the same digest, acknowledged without a second effect.
        before = w1.metric("kvhandoff_duplicate_inputs_total")
        await engines.send(TimedOut(h))
        await until(
            lambda: w1.metric("kvhandoff_duplicate_inputs_total") > before,
            "the second TimedOut is dropped as a duplicate",
        )
        assert timeouts_logged(w1, h) == 1
        assert not [r for r in engines.rejections if r.handoff_id == h], engines.rejections
        assert len(engines.completions[h]) == 1
    finally:
        await engines.close()


async def test_an_action_without_an_outcome_is_republished_with_its_id_and_backoff(
    nats_cluster: NatsCluster, workers: list[TierWorker], tmp_path: Path
) -> None:
    w1 = TierWorker(nats_cluster.url, "w1", tmp_path, "--retry-interval", f"{RETRY_INTERVAL_S}s")
    workers.append(w1)
    w1.start(timeout_s=2 * WITHIN_S)
    command = start(deadline_ms=600_000)
    h = command.handoff_id
    engines = ScriptedEngines(nats_cluster.url.split(",")[0], silent_prefill(h))
    await engines.start()
    published: list[tuple[float, Action]] = []  # each publication of action 0, when seen

    async def on_action(msg: Msg) -> None:
        action = codec.decode_action(msg.data)
        if action.handoff_id == h and action.action_id == 0:
            published.append((time.monotonic(), action))

    try:
        await engines.nc.subscribe(f"{engines.subjects.prefix}.engine.*.actions", cb=on_action)
        await engines.start_handoff(command)
        await until(lambda: len(published) >= 3, "action 0 is published twice more")
        (t0, first), (t1, second), (t2, third) = published[:3]
        assert isinstance(first, SubmitPrefill) and first == second == third
        assert t1 - t0 >= RETRY_INTERVAL_S - JITTER_S, published
        assert t2 - t1 >= 2 * RETRY_INTERVAL_S - JITTER_S, published  # the backoff grows
        assert w1.metric("kvhandoff_actions_republished_total") >= 2

        # Answered at last: the handoff goes on from where it was.
        for reply in success_script(first):
            await engines.send(reply)
        await engines.wait_complete({h}, within=2 * WITHIN_S)
        assert engines.completions[h][0].completion is HandoffCompletion.SUCCESS
        assert not engines.mismatched, engines.mismatched
    finally:
        await engines.close()


async def test_a_handed_over_partitions_retries_move_to_its_new_owner(
    nats_cluster: NatsCluster, workers: list[TierWorker], tmp_path: Path
) -> None:
    """w1 retries the unanswered first action of one handoff per partition; w2 joins, and w1
    hands half the partitions over. No input comes for those: w1 stops retrying their actions
    at once, while it goes on retrying those it kept, and w2 claims them once they have been
    vacant for the priority timeout, and takes the retries up."""
    url = nats_cluster.url
    fast = ("--retry-interval", f"{RETRY_INTERVAL_S / 2}s")
    w1, w2 = TierWorker(url, "w1", tmp_path, *fast), TierWorker(url, "w2", tmp_path, *fast)
    workers += [w1, w2]
    w1.start(timeout_s=2 * WITHIN_S)
    starts = [start(600_000, partition=p) for p in range(PARTITIONS)]
    first = [(s.handoff_id, 0) for s in starts]  # each partition's unanswered action
    engines = ScriptedEngines(url.split(",")[0], silent_prefill(*(h for h, _ in first)))
    await engines.start()

    def claimed_by_w2() -> set[int]:
        found = re.findall(r"partition (\d+): nobody pinned to it", w2.log_path.read_text())
        return {int(p) for p in found}

    try:
        for command in starts:
            await engines.start_handoff(command)
        await until(
            lambda: all(engines.deliveries[key] >= 2 for key in first),
            "w1 republishes the first action of every handoff",
        )
        await asyncio.to_thread(w2.start, 2 * WITHIN_S)
        handing = r"handing over \[(\d[\d, ]*)\]"
        logs = w1.log_path.read_text
        await until(lambda: re.search(handing, logs()) is not None, "w1 hands partitions over")
        match = re.search(handing, logs())
        assert match is not None
        handed = {int(p) for p in match[1].split(",")}
        await until(
            lambda: all(f"partition {p}: released" in logs() for p in handed),
            f"w1 releases partitions {sorted(handed)}",
        )
        seen = {key: engines.deliveries[key] for key in first}
        kept = [key for p, key in enumerate(first) if p not in handed]
        assert kept, handed

        def w1_stopped_retrying() -> None:
            deliveries = dict(engines.deliveries)  # before reading w2's log: see below
            for p in handed - claimed_by_w2():
                # Not claimed by w2 when its log was read, so not republished by it when the
                # deliveries were counted: at most one that w1 was publishing as it released.
                assert deliveries[first[p]] <= seen[first[p]] + 1, (p, seen, deliveries)
            assert w2.running(), w2.logs()

        await eventually.until(
            lambda: handed <= claimed_by_w2(),
            "w2 claimed the partitions handed to it",
            within=2 * WITHIN_S,
            guard=w1_stopped_retrying,
            context=lambda: f"w2 claimed {claimed_by_w2()} of {handed}",
        )
        await until(
            lambda: all(engines.deliveries[key] >= seen[key] + 3 for key in kept),
            "w1 goes on retrying the actions of the partitions it kept",
        )
        await until(
            lambda: all(engines.deliveries[first[p]] >= seen[first[p]] + 3 for p in handed),
            "w2 retries the actions of the partitions it claimed",
        )
    finally:
        await engines.close()


async def test_the_new_owner_times_out_a_handoff_of_a_killed_owner(
    nats_cluster: NatsCluster, workers: list[TierWorker], tmp_path: Path
) -> None:
    """w1 starts a handoff whose source never answers and is killed (SIGKILL) before its
    deadline; w2, started afterwards, takes the partition over although no input comes to it
    (a vacant partition is claimed once nobody was pinned to it for the priority timeout),
    rebuilds the handoff from the replicated log, and times it out."""
    url = nats_cluster.url
    w1, w2 = TierWorker(url, "w1", tmp_path), TierWorker(url, "w2", tmp_path)
    workers += [w1, w2]
    w1.start(timeout_s=2 * WITHIN_S)
    deadline_s = 8.0
    command = start(deadline_ms=int(deadline_s * 1000))
    h = command.handoff_id
    partition = partition_of(h, PARTITIONS)
    engines = ScriptedEngines(url.split(",")[0], silent_prefill(h))
    await engines.start()
    try:
        started_at = time.monotonic()
        await engines.start_handoff(command)
        await engines.wait_for_action(h, SubmitPrefill)  # w1 owns the partition and applied it
        w1.kill()
        killed_after_s = time.monotonic() - started_at
        assert killed_after_s < deadline_s, f"w1 was killed only {killed_after_s:.1f}s after"
        await asyncio.to_thread(w2.start, 2 * WITHIN_S)
        await engines.wait_complete({h}, within=4 * WITHIN_S)
        assert engines.completions[h][0].completion is HandoffCompletion.CANCELED
        assert await asyncio.to_thread(w2.terminate, 2 * WITHIN_S) == 0, w2.logs()
    finally:
        await engines.close()

    # Only w2 can have timed it out: w1 was dead before the deadline.
    w2_log = w2.log_path.read_text()
    assert f"partition {partition}: nobody pinned to it" in w2_log
    assert f"handoff {h}: deadline passed, timed out" in w2_log
    assert timeouts_logged(w2, h) == 1
