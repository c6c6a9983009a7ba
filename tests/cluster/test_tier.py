"""The tier (worker.tier.membership) with real worker processes on the real three-node cluster:
workers share the partitions by the balance rule; a worker killed with SIGKILL mid-load has its
partitions taken over by the others; a worker that joins mid-load takes its share by clean
hand-overs. The checks are on the replicated log: every input the stream acknowledged is
applied exactly once, and each handoff's inputs in stream order; the failover and the join are
timed and printed for the report, not asserted.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.tier.balance import partition_of
from kvhandoff.worker.tier.entries import Appended, Claimed, Entry
from kvhandoff.worker.tier.ownership import read_entries
from tests.cluster.conftest import WITHIN_S, Acted, StatusChild, publish, until
from tests.cluster.tier_process import KILL_BEFORE_ACTING, PARTITIONS, SETTINGS


class WorkerProcess(StatusChild):
    """`tests.cluster.tier_process` in a child process."""

    def __init__(self, url: str, name: str, tmp: Path, *, kill_before_acting: int = 0) -> None:
        env = {KILL_BEFORE_ACTING: str(kill_before_acting)} if kill_before_acting else {}
        super().__init__("tests.cluster.tier_process", name, tmp, [url, name], env)


@pytest.fixture
def workers(nats_cluster: NatsCluster) -> Iterator[dict[str, WorkerProcess]]:
    started: dict[str, WorkerProcess] = {}
    yield started
    for worker in started.values():
        worker.stop()


class Load:
    """Inputs of four handoffs per partition, published in turn; their stream sequences."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self.handoffs: list[uuid.UUID] = []
        for partition in range(PARTITIONS):
            found = 0
            while found < 4:
                handoff = uuid.uuid4()
                if partition_of(handoff, PARTITIONS) == partition:
                    self.handoffs.append(handoff)
                    found += 1
        self.published: list[int] = []
        self.partition_of_seq: dict[int, int] = {}

    async def publish(self, count: int, pace_s: float = 0.0) -> None:
        """Publish `count` inputs, one every `pace_s` at most (a load generator's pace)."""
        for n in range(count):
            if pace_s:
                await asyncio.sleep(pace_s)
            handoff = self.handoffs[len(self.published) % len(self.handoffs)]
            seq = await publish(self._js, f"{SETTINGS.prefix}.in.{handoff}", b"%d" % n)
            self.published.append(seq)
            self.partition_of_seq[seq] = partition_of(handoff, PARTITIONS)


async def the_log(js: JetStreamContext) -> dict[int, list[Entry]]:
    """Each partition's log entries, in order (a snapshot's parts joined)."""
    info = await js.stream_info(SETTINGS.log_stream)
    raw: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
    if not info.state.messages:
        return {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            message = await js.get_msg(SETTINGS.log_stream, seq)
        except NotFoundError:
            continue  # rolled up by a snapshot
        assert message.subject is not None and message.data is not None
        raw[message.subject].append((seq, message.data))
    return {
        int(subject.rpartition(".")[2]): read_entries(0, subject, messages)
        for subject, messages in raw.items()
    }


def check_applied_once_in_order(log: dict[int, list[Entry]], load: Load) -> dict[str, Counter[int]]:
    """Assert every published input is applied exactly once, each handoff's in stream order
    (the order of its partition's log); the inputs each worker (by name) applied."""
    by_worker: dict[str, Counter[int]] = defaultdict(Counter)
    total: Counter[int] = Counter()
    handoff_of = {seq: n % len(load.handoffs) for n, seq in enumerate(load.published)}
    for entries in log.values():
        owner = "nobody"
        latest: dict[int, int] = {}
        for entry in entries:
            if isinstance(entry, Claimed):
                owner = entry.owner.split("/")[0]
            elif isinstance(entry, Appended):
                by_worker[owner].update(entry.inputs)
                total.update(entry.inputs)
                for seq in entry.inputs:
                    handoff = handoff_of[seq]
                    assert seq > latest.get(handoff, 0), f"input {seq} after a later one"
                    latest[handoff] = seq
    assert set(total) == set(load.published) and set(total.values()) == {1}
    return by_worker


def everything_applied(acted: Acted, load: Load) -> bool:
    done = set().union(*(set(seqs) for seqs in acted.by.values())) if acted.by else set()
    return done >= set(load.published)


async def test_a_killed_workers_partitions_are_taken_over_with_every_input_applied_once(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    workers: dict[str, WorkerProcess],
    acted: Acted,
    tmp_path: Path,
) -> None:
    load = Load(js)
    for name in ("w1", "w2"):
        workers[name] = WorkerProcess(nats_cluster.url, name, tmp_path)
    w1, w2 = workers["w1"], workers["w2"]
    await until(lambda: "serving" in w1.logs() and "serving" in w2.logs(), "both serve", w1, w2)
    # The first to serve takes every partition, and hands the second its share at a round.
    deadline = time.monotonic() + 2 * WITHIN_S
    while set(acted.by) != {"w1", "w2"}:
        assert time.monotonic() < deadline, "the two workers did not come to share the load"
        for worker in (w1, w2):
            assert worker.process.poll() is None, f"{worker.name} died: {worker.logs()}"
        await load.publish(20)
    await until(lambda: everything_applied(acted, load), "what was published is applied", w1, w2)
    already = len(acted.by["w1"])
    await load.publish(100)
    await until(lambda: everything_applied(acted, load), "100 more applied", w1, w2)
    w1_partitions = {load.partition_of_seq[s] for s in acted.by["w1"][already:]}
    assert 0 < len(w1_partitions) < PARTITIONS, "each works on a share"

    loading = asyncio.create_task(load.publish(400, pace_s=0.01))
    try:
        await until(lambda: len(acted.by["w1"]) >= already + 100 or loading.done(), "mid-load")
        w1.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        w1.process.wait(timeout=WITHIN_S)
        await loading
    finally:
        loading.cancel()
    try:
        await until(lambda: everything_applied(acted, load), "everything applied", w2)
    except AssertionError:
        w2.process.send_signal(signal.SIGTERM)  # for its owners' counts
        w2.process.wait(timeout=2 * WITHIN_S)
        missing = set(load.published).difference(*acted.by.values())
        # Applied but never acted on (in the log), or never applied: two different faults.
        logged = {
            seq
            for entries in (await the_log(js)).values()
            for entry in entries
            if isinstance(entry, Appended)
            for seq in entry.inputs
        }
        raise AssertionError(
            f"not acted on: {sorted(missing)}, of which in the log: {sorted(missing & logged)}; "
            f"w2: {w2.status()}"
        ) from None
    all_applied_s = time.monotonic() - killed_at
    w2.process.send_signal(signal.SIGTERM)
    assert w2.process.wait(timeout=2 * WITHIN_S) == 0, w2.logs()

    by_worker = check_applied_once_in_order(await the_log(js), load)
    taken_over = {load.partition_of_seq[s] for s in by_worker["w2"]} & w1_partitions
    assert taken_over == w1_partitions, "w2 took every partition w1 had"
    status = w2.status()
    print(
        f"tier failover: all inputs applied {all_applied_s:.1f}s after w1 was killed "
        f"(member TTL 5 s, priority timeout {SETTINGS.priority_timeout_s} s); w2={status}"
    )


async def test_inputs_a_killed_worker_appended_and_did_not_act_on_are_acted_on_by_the_next_owner(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    workers: dict[str, WorkerProcess],
    acted: Acted,
    tmp_path: Path,
) -> None:
    """w1 dies (SIGKILL) between an append and its publishes; w2 takes its partitions over,
    skips those inputs (the log says they were applied) and acts on them at its claim."""
    load = Load(js)
    workers["w1"] = w1 = WorkerProcess(nats_cluster.url, "w1", tmp_path, kill_before_acting=20)
    await until(lambda: "serving" in w1.logs(), "w1 serves", w1)
    await load.publish(40)
    await until(lambda: w1.process.poll() is not None, "w1 kills itself before acting")
    workers["w2"] = w2 = WorkerProcess(nats_cluster.url, "w2", tmp_path)
    await until(lambda: everything_applied(acted, load), "everything acted on", w2)
    w2.process.send_signal(signal.SIGTERM)
    assert w2.process.wait(timeout=2 * WITHIN_S) == 0, w2.logs()
    by_worker = check_applied_once_in_order(await the_log(js), load)
    # Counted at the end, when whatever w1 published has long arrived.
    not_acted = set(by_worker["w1"]).difference(acted.by["w1"])
    assert not_acted, "w1 died having acted on everything it appended"
    assert not_acted <= set(acted.by["w2"]), "w2 acted on what w1 applied and did not act on"


async def test_a_worker_that_joins_mid_load_takes_its_share_by_clean_hand_overs(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    workers: dict[str, WorkerProcess],
    acted: Acted,
    tmp_path: Path,
) -> None:
    load = Load(js)
    workers["w1"] = w1 = WorkerProcess(nats_cluster.url, "w1", tmp_path)
    await until(lambda: "serving" in w1.logs(), "w1 serves", w1)
    loading = asyncio.create_task(load.publish(600, pace_s=0.01))
    try:
        await until(lambda: len(acted.by["w1"]) >= 50, "w1 under load", w1)
        workers["w2"] = w2 = WorkerProcess(nats_cluster.url, "w2", tmp_path)
        await loading
    finally:
        loading.cancel()
    deadline = time.monotonic() + 2 * WITHIN_S
    while "w2" not in acted.by:  # the load goes on until w2 has its share
        assert time.monotonic() < deadline, "w2 took no share"
        for worker in (w1, w2):
            assert worker.process.poll() is None, f"{worker.name} died: {worker.logs()}"
        await load.publish(20)
    await until(lambda: everything_applied(acted, load), "everything applied", w1, w2)
    for worker in (w1, w2):
        worker.process.send_signal(signal.SIGTERM)
    for worker in (w1, w2):
        assert worker.process.wait(timeout=2 * WITHIN_S) == 0, worker.logs()

    by_worker = check_applied_once_in_order(await the_log(js), load)
    assert by_worker["w2"], "w2 took a share"
    owners = w1.status()["owners"]
    assert isinstance(owners, list)
    # w1 handed over what it gave w2 (and, stopped, the rest), and no owner was fenced: no
    # partition changed hands behind its owner's back.
    assert not any(o["fenced"] for o in owners), owners
    assert all(o["handed_over"] for o in owners), owners
    gap_s = acted.longest_gap_s()
    print(
        f"tier join: longest pause between two applied inputs {gap_s:.2f}s; "
        f"w1 owners {owners}; w2 applied {sum(by_worker['w2'].values())}"
    )
