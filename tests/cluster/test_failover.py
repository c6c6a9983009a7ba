"""Failover of a partition's owner (worker.tier.owner, worker.tier.ownership), with real
processes on the real three-node cluster.

A crashed owner. Owner A applies and appends a batch, and dies (SIGKILL) before acknowledging
it. Owner B is pinned once A has not pulled for the priority timeout, claims the partition, gets
A's unacknowledged inputs first, skips them (the log says they were applied) and applies the
rest: every input applied exactly once.

A paused owner. Owner A applies a partition's inputs. It is SIGSTOPped with inputs on their way
to it, and a second owner B starts: B is pinned once A has not pulled for the priority timeout,
claims the partition, and applies the inputs that A was given and never acknowledged, then newer
ones.
A is SIGCONTed: it wakes with inputs in hand and the pin it lost, appends, is refused, and stops
at once (exit 3) without acting or acknowledging. The check is on the log and on what each owner
published, not on timing: every input is applied exactly once, by one owner, and each owner
acted on exactly the inputs it appended. The failover time is printed for the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.js import JetStreamContext

from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.tier.balance import partition_of
from kvhandoff.worker.tier.entries import Appended, Claimed, Entry
from tests.cluster.conftest import WITHIN_S, Acted, StatusChild, publish, until
from tests.cluster.owner_process import (
    FENCED_EXIT,
    LOG_STREAM,
    PARTITIONS,
    PREFIX,
    PRIORITY_TIMEOUT_S,
    STREAM,
)
from tests.subscribed import registered

PARTITION = 0


class Owner(StatusChild):
    """`tests.cluster.owner_process` in a child process."""

    def __init__(
        self, url: str, name: str, tmp: Path, hang_after: int = 0, priority_timeout_s: float = 0
    ) -> None:
        env = {"KVHANDOFF_HANG_AFTER": str(hang_after)}
        if priority_timeout_s:
            env["KVHANDOFF_PRIORITY_TIMEOUT"] = str(priority_timeout_s)
        super().__init__("tests.cluster.owner_process", name, tmp, [url, name, str(PARTITION)], env)


@pytest.fixture
def owners(nats_cluster: NatsCluster, tmp_path: Path) -> Iterator[dict[str, Owner]]:
    started: dict[str, Owner] = {}
    yield started
    for owner in started.values():
        if owner.process.poll() is None:
            owner.signal(signal.SIGCONT)  # a stopped process cannot take SIGKILL's exit
        owner.stop()


@contextlib.asynccontextmanager
async def watching_acts(urls: list[str]) -> AsyncIterator[Acted]:
    """What the owners act on, as seen through a connection to these nodes only."""
    watcher = await nats.connect(urls, max_reconnect_attempts=-1)
    try:
        acted = Acted()
        await watcher.subscribe(f"{PREFIX}.acted.*", cb=acted.on)
        await registered(watcher)  # every act counts: the first ones after the kill too
        yield acted
    finally:
        await watcher.close()


async def log_entries(js: JetStreamContext) -> list[Entry]:
    decoder = msgspec.msgpack.Decoder(Entry)
    info = await js.stream_info(LOG_STREAM)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        data = (await js.get_msg(LOG_STREAM, seq)).data
        assert data is not None
        found.append(decoder.decode(data))
    return found


def handoffs_in_partition(count: int) -> list[uuid.UUID]:
    found: list[uuid.UUID] = []
    while len(found) < count:
        handoff = uuid.uuid4()
        if partition_of(handoff, PARTITIONS) == PARTITION:
            found.append(handoff)
    return found


class Inputs:
    """Inputs of a few handoffs of the partition, published in turn; their stream sequences."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._handoffs = handoffs_in_partition(8)
        self.published: list[int] = []

    async def publish(self, count: int) -> None:
        for n in range(count):
            handoff = self._handoffs[len(self.published) % len(self._handoffs)]
            self.published.append(await publish(self._js, f"{PREFIX}.in.{handoff}", b"%d" % n))

    def out_of_order(self, applied: list[int]) -> int:
        """How many of these inputs (in the order applied) came after a later input of their
        handoff. JetStream redelivers a dead owner's many unacknowledged inputs in the order
        their ack waits ran out, not in stream order, among newer ones: without the owner's
        `InputOrder` this was some 20 (see worker.tier.owner, "Order"). An input acted on
        again (an owner publishes again, at its claim, acts that NATS did not confirm) is judged
        by its first act: publishing again is at least once, not a change of order."""
        handoff_of = {seq: n % len(self._handoffs) for n, seq in enumerate(self.published)}
        latest: dict[int, int] = {}
        late = 0
        for seq in dict.fromkeys(applied):
            handoff = handoff_of[seq]
            if seq < latest.get(handoff, 0):
                late += 1
            latest[handoff] = max(seq, latest.get(handoff, 0))
        return late


async def appended_by_owner(js: JetStreamContext) -> tuple[list[Claimed], dict[str, Counter[int]]]:
    """The claims in the log, and the inputs each owner (by name) appended, with counts."""
    entries = await log_entries(js)
    claims = [e for e in entries if isinstance(e, Claimed)]
    appended: dict[str, Counter[int]] = defaultdict(Counter)
    for entry in entries:
        if isinstance(entry, Appended):
            appended[claims[entry.epoch - 1].owner.split("/")[0]].update(entry.inputs)
    return claims, appended


async def appended_once_by_a_then_b(
    js: JetStreamContext, inputs: Inputs
) -> tuple[list[Claimed], dict[str, Counter[int]]]:
    """`appended_by_owner`, once it shows that A claimed the partition, then B, and that every
    input was applied exactly once, by one owner, and nothing the stream does not hold."""
    claims, appended = await appended_by_owner(js)
    assert [c.owner.split("/")[0] for c in claims] == ["a", "b"]
    total = appended["a"] + appended["b"]
    assert set(total) == set(inputs.published) and set(total.values()) == {1}
    return claims, appended


def stop_cleanly(owner: Owner) -> None:
    """SIGTERM, and the owner exits 0 in time."""
    owner.signal(signal.SIGTERM)
    assert owner.process.wait(timeout=2 * WITHIN_S) == 0, owner.logs()


def metrics_of(status: dict[str, object]) -> dict[str, Any]:
    """The owner process's TierMetrics, from its status (tests/cluster/owner_process.py)."""
    found = status["metrics"]
    assert isinstance(found, dict), status
    return found


async def test_a_crashed_owners_appended_inputs_are_not_applied_again(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    owners: dict[str, Owner],
    acted: Acted,
    tmp_path: Path,
) -> None:
    inputs = Inputs(js)
    owners["a"] = a = Owner(nats_cluster.url, "a", tmp_path, hang_after=60)
    await until(lambda: "owner a pulling" in a.logs(), "a pulls", a)
    await inputs.publish(100)
    await until(lambda: "hanging" in a.logs(), "a appended 60 and did not acknowledge", a)
    a.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    a.process.wait(timeout=WITHIN_S)

    owners["b"] = b = Owner(nats_cluster.url, "b", tmp_path)
    await until(lambda: "b" in acted.first_at, "b took the partition over", b)
    failover_s = acted.first_at["b"] - killed_at
    await inputs.publish(50)
    await until(lambda: len(set(acted.by["a"]) | set(acted.by["b"])) == 150, "all applied", b)
    stop_cleanly(b)

    _, appended = await appended_once_by_a_then_b(js, inputs)
    status_b = b.status()
    hung = re.search(r"hanging after (\d+) applied, (\d+) acked", a.logs())
    assert hung is not None
    applied_by_a, acked_by_a = int(hung[1]), int(hung[2])
    assert applied_by_a == sum(appended["a"].values()) and acked_by_a < applied_by_a
    # A's last batch was appended and never acknowledged: B got it again, and skipped it.
    assert status_b["skipped"] == applied_by_a - acked_by_a
    assert status_b["applied"] == sum(appended["b"].values())
    assert inputs.out_of_order(acted.by["b"]) == 0, acted.by["b"]
    assert status_b["orphans"] == 100 - applied_by_a  # A was given all 100 before it hung
    print(f"failover after SIGKILL: B acted {failover_s:.2f}s later; B={status_b}")


async def test_a_paused_owner_is_fenced_and_every_input_is_applied_once(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    owners: dict[str, Owner],
    acted: Acted,
    tmp_path: Path,
) -> None:
    inputs = Inputs(js)
    owners["a"] = a = Owner(nats_cluster.url, "a", tmp_path)
    await until(lambda: "owner a pulling" in a.logs(), "a pulls", a)
    await inputs.publish(100)
    await until(lambda: len(acted.by["a"]) == 100, "a applied the first 100", a)

    a.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    await inputs.publish(50)  # on their way to A, which holds the pin for a while yet
    owners["b"] = b = Owner(nats_cluster.url, "b", tmp_path)
    await until(lambda: "b" in acted.first_at, "b took the partition over", b)
    failover_s = acted.first_at["b"] - stopped_at
    await inputs.publish(100)
    await until(lambda: len(set(acted.by["a"]) | set(acted.by["b"])) == 250, "all applied", b)

    a.signal(signal.SIGCONT)
    assert a.process.wait(timeout=2 * WITHIN_S) == FENCED_EXIT, a.logs()
    stop_cleanly(b)

    claims, appended = await appended_once_by_a_then_b(js, inputs)
    assert [c.epoch for c in claims] == [1, 2]
    # Each acted on exactly what it appended: nothing after A was fenced.
    assert Counter(acted.by["a"]) == Counter(appended["a"])
    assert Counter(acted.by["b"]) == Counter(appended["b"])
    # A's inputs in hand came back to B among newer ones; B applied each handoff's in order.
    assert inputs.out_of_order(acted.by["b"]) == 0, acted.by["b"]
    status_a, status_b = a.status(), b.status()
    assert status_a["fenced"] is True and status_b["fenced"] is False
    # And so say their metrics: A, paused, never handed over, so B took the partition over.
    assert metrics_of(status_a)["fenced"] == 1 and metrics_of(status_b)["fenced"] == 0
    assert metrics_of(status_a)["claims"]["nothing"] == 1
    assert metrics_of(status_b)["claims"]["takeover"] == 1
    # A acknowledged only what it applied; B skipped A's applied-but-unacknowledged inputs.
    assert status_a["acked"] == status_a["applied"] == sum(appended["a"].values()) == 100
    assert status_b["applied"] == sum(appended["b"].values()) == 150
    print(
        f"failover: B acted {failover_s:.2f}s after A stopped (priority timeout "
        f"{PRIORITY_TIMEOUT_S}s); A={status_a} B={status_b}"
    )


async def test_killing_the_input_streams_leader_node_mid_load_loses_nothing(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    owners: dict[str, Owner],
    tmp_path: Path,
) -> None:
    inputs = Inputs(js)
    owners["a"] = a = Owner(nats_cluster.url, "a", tmp_path)
    await until(lambda: "owner a pulling" in a.logs(), "a pulls", a)
    info = await js.stream_info(STREAM)
    assert info.cluster is not None and info.cluster.leader
    leader = nats_cluster.node(info.cluster.leader)
    # Core NATS delivers only to a subscriber that is connected: watched from the node about to
    # be killed, the acts published while the watcher reconnects would be missed (the `acted`
    # fixture may land there). The owner's own connection may be there: that is under test.
    async with watching_acts([n.url for n in nats_cluster.nodes if n is not leader]) as acted:
        await inputs.publish(100)
        leader.stop(kill=True)
        killed_at = time.monotonic()
        await inputs.publish(100)  # acknowledged by the two nodes left, once they elect a leader
        republished_s = time.monotonic() - killed_at
        nats_cluster.restart(leader)
        await inputs.publish(100)
        try:
            await until(lambda: set(acted.by["a"]) >= set(inputs.published), "all applied", a)
        except AssertionError as exc:
            # An input appended and never acted on is an act that NATS lost and no claim redid.
            _, appended = await appended_by_owner(js)
            missing = {
                seq: appended["a"][seq] for seq in set(inputs.published) - set(acted.by["a"])
            }
            raise AssertionError(
                f"{exc}: not acted on {{seq: appends}} {missing}; {a.logs()}"
            ) from exc
        stop_cleanly(a)

        claims, appended = await appended_by_owner(js)
        assert {c.owner.split("/")[0] for c in claims} == {"a"}  # it may have claimed anew: itself
        total = appended["a"]
        # Every input the stream acknowledged is applied, once; nothing else is.
        assert set(total) == set(inputs.published) and set(total.values()) == {1}
        assert inputs.out_of_order(acted.by["a"]) == 0
        status = a.status()
        assert status["fenced"] is False
        print(
            f"stream leader killed: 100 inputs published in {republished_s:.2f}s after; A={status}"
        )


async def test_a_stopped_owner_hands_over_at_once_with_nothing_lost_or_reordered(
    nats_cluster: NatsCluster,
    js: JetStreamContext,
    owners: dict[str, Owner],
    acted: Acted,
    tmp_path: Path,
) -> None:
    forever_s = 3600.0  # a pin that cannot time out: only the hand-over can move it
    inputs = Inputs(js)
    owners["a"] = a = Owner(nats_cluster.url, "a", tmp_path, priority_timeout_s=forever_s)
    await until(lambda: "owner a pulling" in a.logs(), "a pulls", a)
    owners["b"] = b = Owner(nats_cluster.url, "b", tmp_path, priority_timeout_s=forever_s)
    await until(lambda: "owner b pulling" in b.logs(), "b pulls (kept waiting)", b)
    load = asyncio.create_task(inputs.publish(300))
    try:
        await until(lambda: len(acted.by["a"]) >= 50, "a applied some", a, b)
        a.signal(signal.SIGTERM)  # mid-load, with inputs in hand
        stopped_at = time.monotonic()
        assert a.process.wait(timeout=2 * WITHIN_S) == 0, a.logs()
        await until(lambda: "b" in acted.first_at, "b took over", b)
        took_over_s = acted.first_at["b"] - stopped_at
        await load
    finally:
        load.cancel()
    await until(lambda: len(set(acted.by["a"]) | set(acted.by["b"])) == 300, "all applied", b)
    stop_cleanly(b)

    await appended_once_by_a_then_b(js, inputs)
    assert inputs.out_of_order(acted.by["a"] + acted.by["b"]) == 0
    status_a = a.status()
    assert status_a["handed_over"] is True and status_a["fenced"] is False
    # A logged its hand-over: B's claim counts as one, not as a takeover.
    status_b = b.status()
    assert metrics_of(status_a)["handovers"] == 1
    assert metrics_of(status_b)["claims"]["handover"] == 1
    assert metrics_of(status_b)["claims"]["takeover"] == 0
    print(f"hand-over: B acted {took_over_s:.2f}s after A was told to stop; A={status_a}")
