"""`kvhandoff run --partitions 4 --data-dir DIR` (worker.tier.service) as real processes on the
real three-node cluster, with the scripted engines answering, under the faults of issue 11:

- two workers share the load; one is killed with SIGKILL mid-load, and still every handoff
  completes;
- the node that leads the input stream and the replicated log is killed with SIGKILL mid-load:
  nothing the stream acknowledged is lost, every handoff completes;
- the one node a worker is connected to is killed with SIGKILL mid-load and restarted: the
  actions it had written to that connection are published again, every handoff completes
  (`Complete`, which no timer retries, included);
- a worker paused with SIGSTOP past the priority timeout (a zombie) loses its partitions to the
  other, which completes their handoffs; resumed, its appends are refused (`Fenced`, in its log)
  and it acts on nothing it lost: the replicated log holds no entry of its old tenure after the
  new owner's claim;
- a worker that joins mid-load takes its share by clean hand-overs, no owner fenced;
- the partition files' disk fills mid-load: the owners stop until there is room, then catch
  their files up from the replicated log, and every handoff completes.

The checks are on what happened: every input appended to the replicated log once, every action
the engines were sent the same each time it was sent, one completion per handoff, and each
partition file, including those a worker built from the replicated log alone, a log that
`kvhandoff verify` passes; the last owner's file of each partition holds every handoff of the
partition, succeeded, each transition once (15 events: 9 inputs, 6 actions).

Those checks read the replicated log's whole history, which snapshots replace: the workers
here take none (`--snapshot-every 0`). tests/cluster/test_snapshot_run.py runs the faults with
snapshots, and checks what a snapshot leaves to check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path

import nats
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

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
from kvhandoff.events.subjects import DEFAULT_STREAM
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.config import partition_path
from kvhandoff.worker.engines.healthy import success_script
from kvhandoff.worker.harness.natsserver import EmbeddedNats, NatsCluster
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.tier.balance import assign, partition_of
from kvhandoff.worker.tier.entries import Appended, Claimed, Entry, Snapshot
from kvhandoff.worker.tier.members import MEMBER_TTL_S, members
from kvhandoff.worker.tier.membership import TierSettings
from tests.cluster.conftest import PARTITIONS, WITHIN_S, TierWorker, until
from tests.cluster.test_tier import the_log
from tests.worker.conftest import logged_inputs
from tests.worker.scripted_engine import ScriptedEngines
from tests.worker.tmpfs import fill, small_filesystem

HANDOFFS = 200
SETTINGS = TierSettings(partitions=PARTITIONS)  # what `kvhandoff run` gives its tier
LOG_STREAM = SETTINGS.log_stream
EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
SUCCESS_EVENTS = 15  # a success handoff's log: 9 inputs and the 6 actions they issue


def whole_history_worker(
    url: str,
    name: str,
    tmp: Path,
    *extra: str,
    partitions: int = PARTITIONS,
    data_dir: Path | None = None,
) -> TierWorker:
    """A `TierWorker` that keeps the replicated log's whole history: it takes no snapshots."""
    return TierWorker(
        url,
        name,
        tmp,
        "--snapshot-every",
        "0",
        *extra,
        partitions=partitions,
        data_dir=data_dir,
    )


def start(n: int) -> StartHandoff:
    return StartHandoff(
        uuid.uuid4(), EngineType.VLLM, f"prefill-{n % 2}", f"decode-{n % 2}", 600_000
    )


def owners_by_label(*workers: TierWorker) -> dict[str, TierWorker]:
    """The workers by the label their claims carry (`kvhandoff run`'s: host and pid)."""
    return {f"{socket.gethostname()}:{w.pid}": w for w in workers}


def twice_applied(log: dict[int, list[Entry]]) -> str:
    """The entries of every partition's log that apply an input applied more than once, with
    their place in the log (an empty string if there are none): what a failure shows."""
    counts = Counter(
        seq
        for entries in log.values()
        for e in entries
        if isinstance(e, Appended)
        for seq in e.inputs
    )
    twice = {seq for seq, n in counts.items() if n > 1}
    lines = []
    for partition, entries in log.items():
        for index, entry in enumerate(entries):
            if isinstance(entry, Claimed):
                lines.append(f"p{partition}#{index} claimed e{entry.epoch} by {entry.owner}")
            elif isinstance(entry, Appended) and twice & set(entry.inputs):
                lines.append(
                    f"p{partition}#{index} e{entry.epoch} {sorted(twice & set(entry.inputs))}"
                )
    return "\n".join(lines) if twice else ""


async def applied_inputs(js: JetStreamContext) -> dict[str, Counter[int]]:
    """How often each input stream sequence was appended, over every partition's log, by
    each worker (by the label in the claim before the appends)."""
    applied: dict[str, Counter[int]] = defaultdict(Counter)
    for entries in (await the_log(js)).values():
        owner = "nobody"
        for entry in entries:
            if isinstance(entry, Claimed):
                owner = entry.owner.split("/")[0]
            elif isinstance(entry, Appended):
                applied[owner].update(entry.inputs)
    return applied


async def check_each_stored_input_applied_once(
    js: JetStreamContext, engines: ScriptedEngines
) -> None:
    """Every input the stream acknowledged is appended to a partition's log, and every input
    once."""
    applied = sum((await applied_inputs(js)).values(), Counter[int]())
    assert set(engines.stored) <= set(applied), sorted(set(engines.stored) - set(applied))[:10]
    assert set(applied.values()) == {1}, twice_applied(await the_log(js))


def check_appends_follow_their_claim(log: dict[int, list[Entry]]) -> None:
    """Every append of a partition's log is by the owner of its latest claim: no owner appended
    after another claimed the partition (the fence). A snapshot that begins the log sums up
    the claims before it, its writer's last."""
    for partition, entries in log.items():
        epoch = 0
        for index, entry in enumerate(entries):
            if isinstance(entry, Claimed):
                assert entry.epoch == epoch + 1, f"partition {partition}: {entry}"
                epoch = entry.epoch
            elif isinstance(entry, Snapshot) and index == 0:
                epoch = entry.epoch
            else:
                assert entry.epoch == epoch, f"partition {partition}: append of {entry.epoch}"


async def check_last_owners_files(
    js: JetStreamContext,
    workers: dict[str, TierWorker],
    starts: list[StartHandoff],
    partitions: int = PARTITIONS,
) -> None:
    """The file of each partition's last owner (by its last claim; `workers` by label) holds
    every handoff of the partition, succeeded, each transition once; `verify` passes on every
    data directory."""
    for partition, entries in (await the_log(js)).items():
        last = [e for e in entries if isinstance(e, Claimed)][-1]
        owner = workers[last.owner.split("/")[0]]
        expected = {
            s.handoff_id for s in starts if partition_of(s.handoff_id, partitions) == partition
        }
        with open_log(partition_path(owner.data_dir, partition)) as log:
            rows = {row.handoff_id: row.state for row in log.handoffs()}
            events = {handoff: len(log.load(handoff).events) for handoff in rows}
        where = f"partition {partition}, {owner.name}'s file"
        assert rows == dict.fromkeys(expected, HandoffState.SUCCEEDED), where
        assert set(events.values()) == {SUCCESS_EVENTS}, f"{where}: {Counter(events.values())}"
    for worker in workers.values():
        verify(worker.data_dir)


def partition_files(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("w*/partition-*.db"))


def verify(path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvhandoff.worker.cli", "verify", str(path)],
        capture_output=True,
        text=True,
        timeout=2 * WITHIN_S,
        check=False,
    )
    assert done.returncode == 0, f"verify {path}: {done.stdout}{done.stderr}"


def check_each_completed_once(engines: ScriptedEngines) -> None:
    """The engines were sent only actions they expected, and one completion per handoff."""
    assert not engines.mismatched, engines.mismatched[:3]
    assert all(len(set(c)) == 1 for c in engines.completions.values()), "one completion each"


async def a_quarter_complete(engines: ScriptedEngines) -> None:
    """Mid-load: wait until a quarter of the handoffs completed."""
    await engines.until(
        lambda: len(engines.completions) >= HANDOFFS // 4,
        "a quarter of the handoffs to complete",
        within=2 * WITHIN_S,
    )


async def w1_owning_all(
    url: str, workers: list[TierWorker], tmp_path: Path, partitions: int = PARTITIONS
) -> tuple[TierWorker, TierWorker]:
    """w1, up and owning every partition, and w2, made but not started yet."""
    w1, w2 = (
        whole_history_worker(url, name, tmp_path, partitions=partitions) for name in ("w1", "w2")
    )
    workers += [w1, w2]
    w1.start(timeout_s=2 * WITHIN_S)
    await until(w1.took_a_share, "w1 takes the partitions")
    return w1, w2


async def two_sharing(
    url: str, workers: list[TierWorker], tmp_path: Path, *, handed_over: bool = False
) -> tuple[TierWorker, TierWorker]:
    """w1, which takes every partition, then w2, once w2 took its share (w1 hands it over at
    its next round; the pins move at the first pulls), or, with `handed_over`, once w1 logged
    that it handed it over."""
    w1, w2 = await w1_owning_all(url, workers, tmp_path)
    w2.start(timeout_s=2 * WITHIN_S)
    if handed_over:
        await until(w1.handed_over_a_share, "w1 hands w2 its share")
    else:
        await until(w2.took_a_share, "w2 takes its share")
    return w1, w2


async def test_two_workers_share_the_load_and_a_killed_ones_handoffs_all_complete(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    workers: list[TierWorker],
    tmp_path: Path,
) -> None:
    url = nats_cluster.url
    w1, w2 = await two_sharing(url, workers, tmp_path)
    # A data directory is one worker's: a second worker on it is refused before it connects.
    second = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "kvhandoff.worker.cli",
            "run",
            "--nats-url",
            url,
            "--partitions",
            str(PARTITIONS),
            "--data-dir",
            str(w2.data_dir),
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=2 * WITHIN_S,
        check=False,
    )
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
        await engines.wait_complete({s.handoff_id for s in starts}, 4 * WITHIN_S)
        all_done_s = time.monotonic() - killed_at
        await asyncio.wait_for(asyncio.to_thread(w2.terminate, 2 * WITHIN_S), 3 * WITHIN_S)
        assert w2.process is not None and w2.process.returncode == 0, w2.logs()
    finally:
        await engines.close()

    # An action sent again (a new owner republishes what the log does not mark published)
    # was the same action each time, its completion included.
    check_each_completed_once(engines)
    repeated = sum(len(c) - 1 for c in engines.completions.values())
    # The logs name the workers by host and pid (`kvhandoff run`'s label).
    names = owners_by_label(w1, w2)
    by_worker = {names[label].name: inputs for label, inputs in (await applied_inputs(js)).items()}
    applied = sum(by_worker.values(), Counter[int]())
    assert applied and set(applied.values()) == {1}, twice_applied(await the_log(js))
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
    w1, w2 = await w1_owning_all(url, workers, tmp_path)
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
        while " up with " not in w2.logs():  # w2 claims at a first input, or vacant
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


async def test_a_log_stream_of_the_previous_version_is_updated_for_snapshots(
    nats_cluster: NatsCluster, js: JetStreamContext, workers: list[TierWorker], tmp_path: Path
) -> None:
    """The replicated log made by the previous version (an age limit of `--retention`, no
    rollups, no atomic batches) is updated in place by a worker that starts on it: no age
    limit, a snapshot's rollup appended by compare-and-set is stored and replaces its
    subject's entries, and a start whose deadline is longer than the retention completes."""
    await js.add_stream(
        StreamConfig(
            name=LOG_STREAM,
            subjects=[f"{SETTINGS.prefix}.log.*"],
            max_age=2 * 3600,
            duplicate_window=120.0,
            num_replicas=3,
        )
    )
    url = nats_cluster.url
    w1 = whole_history_worker(url, "w1", tmp_path, "--retention", "2h")
    workers.append(w1)
    w1.start(timeout_s=2 * WITHIN_S)
    await until(w1.took_a_share, "w1 takes the partitions")
    config = (await js.stream_info(LOG_STREAM)).config
    assert (config.max_age, config.allow_rollup_hdrs, config.allow_atomic) == (0, True, True)
    # A subject the stream captures that no partition uses, so the tier's logs stay as they are.
    probe = f"{SETTINGS.prefix}.log.probe"
    first = await js.publish(probe, b"entry", headers={EXPECTED_LAST: "0"})
    rollup = {"Nats-Rollup": "sub", EXPECTED_LAST: str(first.seq)}
    snapshot = await js.publish(probe, b"snapshot", headers=rollup)
    held = await js.stream_info(LOG_STREAM, subjects_filter=probe)
    assert held.state.subjects == {probe: 1} and snapshot.seq > first.seq
    engines = ScriptedEngines(url.split(",")[0])
    await engines.start()
    try:
        long = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 3 * 3_600_000)
        await engines.start_handoff(long)
        await engines.wait_complete({long.handoff_id}, within=2 * WITHIN_S)
    finally:
        await engines.close()


async def test_an_early_fact_is_deferred_until_its_precondition_holds(
    nats_cluster: NatsCluster, workers: list[TierWorker], tmp_path: Path
) -> None:
    """As the single worker does (tests/worker/test_handoffs.py): a fact that comes before the
    action it answers is given back, comes again, and is applied once it may be."""
    w1 = whole_history_worker(nats_cluster.url, "w1", tmp_path)
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


async def lead_both_streams(cluster: NatsCluster) -> EmbeddedNats:
    """The node that leads the input stream, once it leads the replicated log too: the log's
    leader is asked to step down in its favour until it has."""
    nc = await nats.connect(cluster.url.split(","), max_reconnect_attempts=-1)
    try:
        deadline = time.monotonic() + 2 * WITHIN_S
        while True:
            leaders = [
                await asyncio.to_thread(cluster.stream_leader, stream)
                for stream in (DEFAULT_STREAM, LOG_STREAM)
            ]
            if leaders[0] is not None and leaders[0] is leaders[1]:
                return leaders[0]
            assert time.monotonic() < deadline, f"the streams' leaders stay apart: {leaders}"
            if leaders[0] is not None and leaders[0].seat is not None:
                request = {"placement": {"preferred": leaders[0].seat.name}}
                # Unanswered: asked again on the next turn, once the nodes say who leads.
                with contextlib.suppress(nats.errors.TimeoutError):
                    await nc.request(
                        f"$JS.API.STREAM.LEADER.STEPDOWN.{LOG_STREAM}",
                        json.dumps(request).encode(),
                        timeout=5,
                    )
            await asyncio.sleep(0.2)  # a bounded poll of the election
    finally:
        await nc.close()


async def test_killing_the_streams_leader_node_mid_load_loses_nothing_acknowledged(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    workers: list[TierWorker],
    tmp_path: Path,
) -> None:
    url = nats_cluster.url
    w1, w2 = await two_sharing(url, workers, tmp_path, handed_over=True)
    leader = await lead_both_streams(nats_cluster)
    # Actions are core NATS: an engine connected to the node that dies would miss those sent
    # while it reconnects and get them only after the retry interval (5 s), which would only
    # slow the test. The workers' own connections may be to that node: that is under test.
    survivor = next(node for node in nats_cluster.nodes if node is not leader)
    engines = ScriptedEngines(survivor.url)
    await engines.start()
    starts = [start(n) for n in range(HANDOFFS)]
    try:
        for s in starts[: HANDOFFS // 2]:
            await engines.start_handoff(s)
        await a_quarter_complete(engines)
        leader.stop(kill=True)
        killed_at = time.monotonic()
        for s in starts[HANDOFFS // 2 :]:  # stored by the two nodes left, once they elect
            await engines.start_handoff(s)
        await engines.wait_complete({s.handoff_id for s in starts}, 4 * WITHIN_S)
        all_done_s = time.monotonic() - killed_at
        await asyncio.to_thread(nats_cluster.restart, leader)
        for w in (w1, w2):
            assert await asyncio.to_thread(w.terminate, 2 * WITHIN_S) == 0, w.logs()
    finally:
        await engines.close()

    check_each_completed_once(engines)
    await check_each_stored_input_applied_once(js, engines)
    check_appends_follow_their_claim(await the_log(js))
    await check_last_owners_files(js, owners_by_label(w1, w2), starts)
    print(
        f"stream leader {leader.seat.name if leader.seat else leader.url} killed mid-load: "
        f"{HANDOFFS} handoffs completed, the last {all_done_s:.1f}s after"
    )


async def test_a_full_disk_stops_a_partitions_owner_until_there_is_room_and_loses_nothing(
    nats_cluster: NatsCluster, js: JetStreamContext, workers: list[TierWorker], tmp_path: Path
) -> None:
    """The partition files' disk fills mid-load. A local commit that fails leaves the file
    behind the replicated log (the authority), so its owner stops, and every claim after it
    fails too while there is no room, with the worker's health red; once there is room, a claim
    catches the file up, the health turns green, and every handoff completes, every input
    applied once, the files whole."""
    url = nats_cluster.url
    # Room for SQLite's WAL to reach its checkpoint (1,000 pages) once the filler is gone.
    with small_filesystem(tmp_path, size_kib=16384) as disk:
        w1 = whole_history_worker(url, "w1", tmp_path, data_dir=disk / "w1")
        workers.append(w1)
        w1.start(timeout_s=2 * WITHIN_S)
        await until(w1.took_a_share, "w1 takes the partitions")
        engines = ScriptedEngines(url.split(",")[0])
        await engines.start()
        starts = [start(n) for n in range(HANDOFFS)]
        try:
            warm = starts[:10]
            for s in warm:
                await engines.start_handoff(s)
            await engines.wait_complete({s.handoff_id for s in warm}, within=2 * WITHIN_S)
            filler = fill(disk)
            for s in starts[10:]:
                await engines.start_handoff(s)
            await until(partial(w1.logged, "database or disk is full"), "the cause")

            def failed_twice() -> bool:  # an owner, and the next claim of its partition
                assert w1.running(), w1.logs()
                failed = re.findall(r"partition (\d+): its owner failed", w1.whole_log())
                return max(Counter(failed).values(), default=0) >= 2

            await until(failed_twice, "a partition's owner to fail twice")
            assert w1.metric("kvhandoff_commit_failures_total") >= 1
            # Its owner failed a second time: a partition of its share is not served.
            assert not w1.healthy(), w1.logs()
            filler.unlink()
            await engines.wait_complete({s.handoff_id for s in starts}, within=4 * WITHIN_S)
            await until(w1.healthy, "the health to turn green again")
            assert await asyncio.to_thread(w1.terminate, 2 * WITHIN_S) == 0, w1.logs()
        finally:
            await engines.close()

        check_each_completed_once(engines)
        await check_each_stored_input_applied_once(js, engines)
        await check_last_owners_files(js, owners_by_label(w1), starts)


async def test_at_one_partition_a_second_worker_stands_by_and_takes_over_a_killed_owner(
    nats_cluster: NatsCluster,
    bus: Bus,
    js: JetStreamContext,
    workers: list[TierWorker],
    tmp_path: Path,
) -> None:
    """`--partitions 1`: the tier is one owner at a time, and the other worker a standby."""
    url = nats_cluster.url
    w1, w2 = await w1_owning_all(url, workers, tmp_path, partitions=1)
    w2.start(timeout_s=2 * WITHIN_S)
    # Settled: the owner is the worker the balance rule picks among the two, by its claim.
    instances: dict[int, str] = {}

    async def both_announced() -> bool:
        instances.update((m.pid, m.instance) for m in await members(bus, DEFAULT_STREAM))
        return {w1.pid, w2.pid} <= instances.keys()

    await until(both_announced, "both workers announce themselves")
    chosen = assign(1, [instances[w1.pid], instances[w2.pid]])[0]
    owner, standby = (w1, w2) if chosen == instances[w1.pid] else (w2, w1)

    async def claimed_by(worker: TierWorker) -> bool:
        claims = [e for e in (await the_log(js))[0] if isinstance(e, Claimed)]
        return bool(claims) and claims[-1].instance == instances[worker.pid]

    await until(partial(claimed_by, owner), f"{owner.name} claims the partition")
    engines = ScriptedEngines(url.split(",")[0])
    await engines.start()
    starts = [start(n) for n in range(HANDOFFS)]
    try:
        for s in starts[: HANDOFFS // 2]:
            await engines.start_handoff(s)
        await a_quarter_complete(engines)
        assert not await claimed_by(standby)
        owner.kill()
        killed_at = time.monotonic()
        for s in starts[HANDOFFS // 2 :]:
            await engines.start_handoff(s)
        await engines.wait_complete({s.handoff_id for s in starts}, 4 * WITHIN_S)
        all_done_s = time.monotonic() - killed_at
        assert await asyncio.to_thread(standby.terminate, 2 * WITHIN_S) == 0, standby.logs()
    finally:
        await engines.close()

    check_each_completed_once(engines)
    assert await claimed_by(standby)
    applied = sum((await applied_inputs(js)).values(), Counter[int]())
    assert applied and set(applied.values()) == {1}, twice_applied(await the_log(js))
    check_appends_follow_their_claim(await the_log(js))
    await check_last_owners_files(js, owners_by_label(w1, w2), starts, partitions=1)
    print(
        f"one partition: {owner.name} killed mid-load, {standby.name} took over; {HANDOFFS} "
        f"handoffs completed, the last {all_done_s:.1f}s after"
    )


RESENT_LINE = "published on a connection that NATS lost"  # worker.tier.partition's warning


async def test_actions_written_to_a_connection_that_dies_are_published_again(
    nats_cluster: NatsCluster, workers: list[TierWorker], tmp_path: Path
) -> None:
    # The worker's one node: what the worker wrote to it and it did not read dies with it, and
    # the worker waits for it to come back. The engines are elsewhere, so lose nothing.
    node, elsewhere = nats_cluster.nodes[0], nats_cluster.nodes[1]
    w1 = whole_history_worker(node.url, "w1", tmp_path)
    workers.append(w1)
    w1.start(timeout_s=2 * WITHIN_S)
    await until(w1.took_a_share, "w1 takes the partitions")
    engines = ScriptedEngines(elsewhere.url)
    await engines.start()
    starts = [start(n) for n in range(HANDOFFS)]
    try:
        for s in starts:
            await engines.start_handoff(s)
        await a_quarter_complete(engines)
        node.stop(kill=True)
        killed_at = time.monotonic()
        await asyncio.to_thread(nats_cluster.restart, node)
        await engines.wait_complete({s.handoff_id for s in starts}, 4 * WITHIN_S)
        all_done_s = time.monotonic() - killed_at
        assert await asyncio.to_thread(w1.terminate, 2 * WITHIN_S) == 0, w1.logs()
    finally:
        await engines.close()

    check_each_completed_once(engines)
    for path in partition_files(tmp_path):
        verify(path)
    print(
        f"the worker's node killed mid-load: {HANDOFFS} handoffs completed, the last "
        f"{all_done_s:.1f}s after; lots of actions published again: "
        f"{w1.whole_log().count(RESENT_LINE)}"
    )


# "partition <p>: <Fenced>; another worker owns it now, <owner> stops acting for it (applied
# <n> inputs, acknowledged <m>)": worker.tier.owner's line when its append is refused.
FENCED_LINE = re.compile(
    r"partition (\d+): .*another worker owns it now, .* stops acting for it "
    r"\(applied (\d+) inputs, acknowledged (\d+)\)"
)


async def test_a_paused_worker_is_fenced_and_acts_on_nothing_it_lost(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    workers: list[TierWorker],
    tmp_path: Path,
) -> None:
    url = nats_cluster.url
    w1, w2 = await two_sharing(url, workers, tmp_path, handed_over=True)
    engines = ScriptedEngines(url.split(",")[0])
    await engines.start()
    starts = [start(n) for n in range(HANDOFFS)]
    paused = False
    try:
        for s in starts[: HANDOFFS // 2]:
            await engines.start_handoff(s)
        await a_quarter_complete(engines)
        # Mid-load, its pulls open: the inputs sent next are delivered to it too, and wait in
        # its socket for it to wake, with the pin it is about to lose.
        os.kill(w1.pid, signal.SIGSTOP)
        paused, stopped_at = True, time.monotonic()
        for s in starts[HANDOFFS // 2 :]:
            await engines.start_handoff(s)
        # w2 takes w1's partitions (its member key expires, then its pins time out), and
        # completes every handoff, those w1 had in flight included.
        await engines.wait_complete({s.handoff_id for s in starts}, 4 * WITHIN_S)
        paused_s = time.monotonic() - stopped_at
        assert paused_s > SETTINGS.priority_timeout_s
        os.kill(w1.pid, signal.SIGCONT)
        paused = False
        await until(lambda: FENCED_LINE.search(w1.whole_log()) is not None, "w1 is fenced")
        woke = len(w1.whole_log())

        def took_back() -> bool:
            since = w1.whole_log()[woke:]
            return all(
                f"partition {p}: claimed as epoch" in since
                for p, _, _ in FENCED_LINE.findall(w1.whole_log())
            )

        # The tier goes on: w1, live again, takes its share back by a clean hand-over and
        # claims it at its next input, catching its file up with what w2 appended meanwhile.
        deadline = time.monotonic() + 2 * WITHIN_S
        while not took_back():
            assert time.monotonic() < deadline, f"w1 claimed nothing again: {w1.logs()}"
            more = [start(len(starts) + n) for n in range(10)]
            starts += more
            for s in more:
                await engines.start_handoff(s)
            await engines.wait_complete({s.handoff_id for s in more}, 4 * WITHIN_S)
        for w in (w1, w2):
            assert await asyncio.to_thread(w.terminate, 2 * WITHIN_S) == 0, w.logs()
    finally:
        if paused:
            os.kill(w1.pid, signal.SIGCONT)
        await engines.close()

    check_each_completed_once(engines)
    labels = owners_by_label(w1, w2)
    log = await the_log(js)
    await check_each_stored_input_applied_once(js, engines)
    check_appends_follow_their_claim(log)
    fenced = {int(p): (int(n), int(m)) for p, n, m in FENCED_LINE.findall(w1.whole_log())}
    for partition, (applied_by_zombie, acked_by_zombie) in fenced.items():
        claims = [e for e in log[partition] if isinstance(e, Claimed)]
        owners = [labels[c.owner.split("/")[0]].name for c in claims]
        # w1's tenure, then w2's claim while w1 slept: the claim that fenced it.
        taken = owners.index("w2", owners.index("w1"))
        tenure = claims[taken - 1].epoch
        assert owners[taken - 1] == "w1", owners
        # The zombie applied (and so acted on) exactly what its tenure appended, all before
        # w2's claim (check_appends_follow_their_claim): nothing after it woke.
        appended = sum(
            len(e.inputs) for e in log[partition] if isinstance(e, Appended) and e.epoch == tenure
        )
        assert applied_by_zombie == appended and acked_by_zombie <= applied_by_zombie
        assert owners[-1] == "w1", f"w1 took partition {partition} back: {owners}"
    # Fenced on its share, which w2 took while it slept (the inputs in its socket when it
    # woke were all of those partitions).
    assert fenced and len(fenced) < PARTITIONS, w1.whole_log()
    await check_last_owners_files(js, labels, starts)
    print(
        f"zombie: w1 paused {paused_s:.1f}s (member TTL {MEMBER_TTL_S:g}s, priority timeout "
        f"{SETTINGS.priority_timeout_s:g}s); resumed, fenced on partitions {sorted(fenced)}; "
        f"{len(starts)} handoffs completed"
    )


async def closed_loop(
    engines: ScriptedEngines, starts: list[StartHandoff], enough: asyncio.Event, in_flight: int
) -> None:
    """Start handoffs (appended to `starts`), `in_flight` at a time, until `enough` is set."""
    while not enough.is_set():
        await engines.until(
            lambda: len(starts) - len(engines.completions) < in_flight or enough.is_set(),
            "room for another handoff",
            within=4 * WITHIN_S,
        )
        starts.append(start(len(starts)))
        await engines.start_handoff(starts[-1])


async def test_a_worker_that_joins_mid_load_takes_its_share_by_clean_hand_overs(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    workers: list[TierWorker],
    tmp_path: Path,
) -> None:
    url = nats_cluster.url
    w1, w2 = await w1_owning_all(url, workers, tmp_path)
    engines = ScriptedEngines(url.split(",")[0])
    await engines.start()
    starts: list[StartHandoff] = []
    enough = asyncio.Event()
    loading = asyncio.create_task(closed_loop(engines, starts, enough, in_flight=32))
    try:
        await engines.until(lambda: len(engines.completions) >= HANDOFFS // 4, "w1 under load")
        await asyncio.to_thread(w2.start, 2 * WITHIN_S)
        joined_at = time.monotonic()
        await until(lambda: "claimed as epoch" in w2.whole_log(), "w2 claims its share")
        took_s = time.monotonic() - joined_at
        more = len(engines.completions) + HANDOFFS // 2
        await engines.until(lambda: len(engines.completions) >= more, "the load goes on")
        enough.set()
        await loading
        await engines.wait_complete({s.handoff_id for s in starts}, 4 * WITHIN_S)
        running = w1.whole_log()  # what w1 did before it was stopped (and handed over the rest)
        for w in (w1, w2):
            assert await asyncio.to_thread(w.terminate, 2 * WITHIN_S) == 0, w.logs()
    finally:
        loading.cancel()
        await engines.close()

    check_each_completed_once(engines)
    await check_each_stored_input_applied_once(js, engines)
    log = await the_log(js)
    check_appends_follow_their_claim(log)
    # Clean: no owner was fenced, and w2 claimed exactly what w1 handed over while running.
    for w in (w1, w2):
        assert FENCED_LINE.search(w.whole_log()) is None, w.name
    labels = owners_by_label(w1, w2)
    claimed_by_w2 = {
        partition
        for partition, entries in log.items()
        if any(isinstance(e, Claimed) and labels[e.owner.split("/")[0]] is w2 for e in entries)
    }
    # w1's round gave w2 its share, and each of those partitions was handed over (finish the
    # batch, give back, unpin) before w2 claimed it.
    given = re.findall(r"handing over \[([\d, ]+)\]", running)
    assert len(given) == 1, given
    handed_over = {int(p) for p in given[0].split(", ")}
    assert handed_over == claimed_by_w2 and 0 < len(handed_over) < PARTITIONS
    for partition in handed_over:
        assert f"partition {partition}: handed over by" in running, partition
    await check_last_owners_files(js, labels, starts)
    print(
        f"join: w2 claimed partitions {sorted(claimed_by_w2)} {took_s:.1f}s after it was up; "
        f"{len(starts)} handoffs completed, none lost"
    )
