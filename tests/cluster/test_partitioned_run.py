"""`kvhandoff run --partitions 4 --data-dir DIR` (worker.partitioned) as real processes on the
real three-node cluster, with the scripted engines answering: two workers share the load; one
is killed with SIGKILL mid-load, and still every handoff completes. The checks are on what
happened: every input appended to the replicated log once, every action the engines were sent
the same each time it was sent, and each partition file, including those the survivor built
from the replicated log alone, a log that `kvhandoff verify` passes, holding every handoff of
its partition as succeeded.
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import msgspec
from nats.js import JetStreamContext

from kvhandoff.events.messages import (
    ACCEPTED,
    Action,
    ActionOutcome,
    DestinationReserved,
    EngineType,
    Input,
    ReserveDestination,
    StartHandoff,
    SubmitPrefill,
)
from kvhandoff.worker.healthy import success_script
from kvhandoff.worker.logreader import open_log
from kvhandoff.worker.natsserver import NatsCluster
from kvhandoff.worker.ownership import Appended, Claimed, Entry
from kvhandoff.worker.partitioned import partition_path
from kvhandoff.worker.partitions import partition_of
from kvhandoff.worker.schema import HandoffState
from tests.cluster.conftest import PARTITIONS, WITHIN_S, TierWorker, until
from tests.worker.conftest import logged_inputs
from tests.worker.scripted_engine import ScriptedEngines

HANDOFFS = 200
LOG_STREAM = "KVHANDOFF_LOG"  # worker.tier.TierSettings' default


def start(n: int) -> StartHandoff:
    return StartHandoff(
        uuid.uuid4(), EngineType.VLLM, f"prefill-{n % 2}", f"decode-{n % 2}", 600_000
    )


async def applied_inputs(js: JetStreamContext) -> dict[str, Counter[int]]:
    """How often each input stream sequence was appended, over every partition's log, by
    each worker (by the label in the claims before the appends)."""
    decoder = msgspec.msgpack.Decoder(Entry)
    info = await js.stream_info(LOG_STREAM)
    applied: dict[str, Counter[int]] = defaultdict(Counter)
    owners: dict[str, str] = {}  # log subject -> the worker that claimed it last
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        message = await js.get_msg(LOG_STREAM, seq)
        assert message.data is not None and message.subject is not None
        entry = decoder.decode(message.data)
        if isinstance(entry, Claimed):
            owners[message.subject] = entry.owner.split("/")[0]
        elif isinstance(entry, Appended):
            applied[owners[message.subject]].update(entry.inputs)
    return applied


def partition_files(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("w*/partition-*.db"))


def verify(path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvhandoff.worker.cli", "verify", str(path)],
        capture_output=True, text=True, timeout=2 * WITHIN_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"verify {path}: {done.stdout}{done.stderr}"


async def test_two_workers_share_the_load_and_a_killed_ones_handoffs_all_complete(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    workers: list[TierWorker],
    tmp_path: Path,
) -> None:
    url = nats_cluster.url
    w1, w2 = TierWorker(url, "w1", tmp_path), TierWorker(url, "w2", tmp_path)
    workers += [w1, w2]
    w1.start(timeout_s=2 * WITHIN_S)
    await until(w1.took_a_share, "w1 takes the partitions")
    w2.start(timeout_s=2 * WITHIN_S)
    # w1 hands w2 its share at w1's next round; the pins then move at the first pulls.
    await until(w2.took_a_share, "w2 takes its share")
    # A data directory is one worker's: a second worker on it is refused before it connects.
    second = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "kvhandoff.worker.cli", "run", "--nats-url", url,
         "--partitions", str(PARTITIONS), "--data-dir", str(w2.data_dir), "--metrics-port", "0"],
        capture_output=True, text=True, timeout=2 * WITHIN_S, check=False,
    )  # fmt: skip
    assert second.returncode == 2 and "in use by another worker" in second.stderr, second

    engines = ScriptedEngines(url.split(",")[0])
    await engines.start()
    try:
        starts = [start(n) for n in range(HANDOFFS)]
        for s in starts[: HANDOFFS // 2]:
            await engines.start_handoff(s)
        first_half = {s.handoff_id for s in starts[: HANDOFFS // 2]}
        await engines.until(
            lambda: len(first_half & engines.completions.keys()) >= HANDOFFS // 4,
            "a quarter of the handoffs to complete",
            within=2 * WITHIN_S,
        )
        # Mid-load: the first half still in flight, the second half not yet sent.
        w1.kill()
        killed_at = time.monotonic()
        for s in starts[HANDOFFS // 2 :]:
            await engines.start_handoff(s)
        await engines.wait_complete({s.handoff_id for s in starts}, within=4 * WITHIN_S)
        all_done_s = time.monotonic() - killed_at
        await asyncio.wait_for(asyncio.to_thread(w2.terminate, 2 * WITHIN_S), 3 * WITHIN_S)
        assert w2.process is not None and w2.process.returncode == 0, w2.logs()
    finally:
        await engines.close()

    # An action sent again (a new owner republishes what the log does not mark published)
    # was the same action each time, its completion included.
    assert not engines.mismatched, engines.mismatched[:3]
    assert all(len(set(c)) == 1 for c in engines.completions.values()), "one completion each"
    repeated = sum(len(c) - 1 for c in engines.completions.values())
    # The logs name the workers by host and pid (`kvhandoff run`'s label).
    names = {f"{socket.gethostname()}:{w.pid}": w.name for w in (w1, w2)}
    by_worker = {names[label]: inputs for label, inputs in (await applied_inputs(js)).items()}
    applied = sum(by_worker.values(), Counter[int]())
    assert applied and set(applied.values()) == {1}, "every input appended once"
    # The survivor's files below hold what w1 appended, from the replicated log alone.
    assert by_worker["w1"] and by_worker["w2"], {w: len(c) for w, c in by_worker.items()}

    # w2 owns every partition at the end: its files, caught up from the replicated log for
    # those w1 had, hold every handoff of their partition, succeeded.
    for partition in range(PARTITIONS):
        expected = {
            s.handoff_id for s in starts if partition_of(s.handoff_id, PARTITIONS) == partition
        }
        log = open_log(partition_path(w2.data_dir, partition))
        try:
            rows = {row.handoff_id: row for row in log.handoffs()}
        finally:
            log.close()
        assert set(rows) == expected, f"partition {partition}"
        assert {row.state for row in rows.values()} == {HandoffState.SUCCEEDED}
    files = partition_files(tmp_path)
    for path in files:
        verify(path)
    print(
        f"partitioned run: {HANDOFFS} handoffs completed, the last {all_done_s:.1f}s after "
        f"w1's SIGKILL; {repeated} completions published again; {len(files)} partition "
        f"files verified"
    )


async def test_a_worker_that_owns_a_partition_again_catches_its_file_up_from_its_mark(
    nats_cluster: NatsCluster, workers: list[TierWorker], tmp_path: Path
) -> None:
    """w1 owns everything, w2 joins and takes a share, then leaves: w1's files for that share
    lack what w2 appended meanwhile, and w1 commits exactly that (the entries after its mark)
    when it claims them again."""
    url = nats_cluster.url
    w1, w2 = TierWorker(url, "w1", tmp_path), TierWorker(url, "w2", tmp_path)
    workers += [w1, w2]
    w1.start(timeout_s=2 * WITHIN_S)
    await until(w1.took_a_share, "w1 takes the partitions")
    engines = ScriptedEngines(url.split(",")[0])
    await engines.start()
    starts: list[StartHandoff] = []
    try:

        async def complete(count: int) -> None:
            handoffs = [start(len(starts) + n) for n in range(count)]
            starts.extend(handoffs)
            for s in handoffs:
                await engines.start_handoff(s)
            await engines.wait_complete({s.handoff_id for s in handoffs}, within=4 * WITHIN_S)

        await complete(HANDOFFS // 4)
        w2.start(timeout_s=2 * WITHIN_S)
        await until(w2.took_a_share, "w2 takes its share")
        deadline = time.monotonic() + 2 * WITHIN_S
        while " up with " not in w2.logs():  # w2 claims a partition at its first input
            assert time.monotonic() < deadline, f"w2 claimed nothing: {w2.logs()}"
            await complete(10)
        await complete(HANDOFFS // 4)
        assert await asyncio.to_thread(w2.terminate, 2 * WITHIN_S) == 0, w2.logs()
        await complete(HANDOFFS // 4)
        assert await asyncio.to_thread(w1.terminate, 2 * WITHIN_S) == 0, w1.logs()
    finally:
        await engines.close()

    # "caught <file> up with <missing> of <entries> entries (mark <mark>)"
    catch_ups = re.findall(r"up with (\d+) of (\d+) entries \(mark (\w+)\)", w1.logs())
    again = [(int(n), int(m)) for n, m, mark in catch_ups if mark != "None"]
    assert any(0 < n < m for n, m in again), catch_ups
    for partition in range(PARTITIONS):
        expected = {
            s.handoff_id for s in starts if partition_of(s.handoff_id, PARTITIONS) == partition
        }
        log = open_log(partition_path(w1.data_dir, partition))
        try:
            rows = {row.handoff_id: row.state for row in log.handoffs()}
        finally:
            log.close()
        assert rows == dict.fromkeys(expected, HandoffState.SUCCEEDED), f"partition {partition}"
    for path in partition_files(tmp_path):
        verify(path)


async def test_the_retention_bounds_the_replicated_log_and_refuses_deadlines_past_half_of_it(
    nats_cluster: NatsCluster, js: JetStreamContext, workers: list[TierWorker], tmp_path: Path
) -> None:
    """`--retention` is the replicated log's `max_age` (the latest worker started sets it), and
    a start whose deadline is longer than half of it is rejected, while one within it
    completes."""
    url = nats_cluster.url
    w1 = TierWorker(url, "w1", tmp_path, "--retention", "2h")
    workers.append(w1)
    w1.start(timeout_s=2 * WITHIN_S)
    await until(w1.took_a_share, "w1 takes the partitions")
    assert (await js.stream_info(LOG_STREAM)).config.max_age == 2 * 3600
    engines = ScriptedEngines(url.split(",")[0])
    await engines.start()
    try:
        within = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 3_600_000)
        beyond = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 3_600_001)
        await engines.start_handoff(beyond)
        await engines.start_handoff(within)
        rejection = await engines.wait_rejection(beyond.handoff_id)
        assert "half its --retention" in rejection.reason, rejection
        await engines.wait_complete({within.handoff_id}, within=2 * WITHIN_S)
    finally:
        await engines.close()
    await asyncio.wait_for(asyncio.to_thread(w1.terminate, 2 * WITHIN_S), 3 * WITHIN_S)
    w2 = TierWorker(url, "w2", tmp_path, "--retention", "3h")
    workers.append(w2)
    w2.start(timeout_s=2 * WITHIN_S)
    await until(w2.took_a_share, "w2 takes the partitions")
    assert (await js.stream_info(LOG_STREAM)).config.max_age == 3 * 3600


async def test_an_early_fact_is_deferred_until_its_precondition_holds(
    nats_cluster: NatsCluster, workers: list[TierWorker], tmp_path: Path
) -> None:
    """As the single worker does (tests/worker/test_handoffs.py): a fact that comes before the
    action it answers is given back, comes again, and is applied once it may be."""
    w1 = TierWorker(nats_cluster.url, "w1", tmp_path)
    workers.append(w1)
    w1.start(timeout_s=2 * WITHIN_S)
    await until(w1.took_a_share, "w1 takes the partitions")
    command = start(0)
    h = command.handoff_id
    reserved = DestinationReserved(h, 64)

    def destination_only_accepts(action: Action) -> list[Input]:
        # The destination's fact overtakes its own outcome: the test sent it early.
        if isinstance(action, ReserveDestination):
            return [ActionOutcome(h, action.action_id, ACCEPTED)]
        return success_script(action)

    engines = ScriptedEngines(nats_cluster.url.split(",")[0], destination_only_accepts)
    await engines.start()
    try:
        await engines.start_handoff(command)
        await engines.wait_for_action(h, SubmitPrefill)
        await engines.send(reserved)  # before ReserveDestination was even issued
        await engines.wait_complete({h}, within=2 * WITHIN_S)
        assert not engines.rejections, engines.rejections
    finally:
        await engines.close()
    inputs = logged_inputs(partition_path(w1.data_dir, partition_of(h, PARTITIONS)), h)
    assert inputs.index(reserved) > inputs.index(ActionOutcome(h, 1, ACCEPTED))
    assert inputs.count(reserved) == 1
    deferred = re.search(r"^kvhandoff_deferred_inputs_total (\S+)$", w1.metrics(), re.MULTILINE)
    assert deferred is not None and float(deferred[1]) >= 1, w1.metrics()
