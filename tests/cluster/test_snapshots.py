"""Snapshots of a partition's fenced log (worker.tier.ownership) on the real cluster: a snapshot
replaces the entries before it in one compare-and-set roll-up, so the next claim reads it and
the tail after it, never more; a snapshot over one message goes as one atomic batch and is read
back whole; a zombie's snapshot, alone or as a batch, is refused whole and drops nothing; a
writer killed (SIGKILL) in the middle of a batch leaves the previous snapshot and its tail, and
one killed as it sends a one-message snapshot leaves the new one or the old one and its tail.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from nats.js import JetStreamContext

from kvhandoff.events.subjects import partition_log_subject
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.errors import Fenced
from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.tier.entries import Appended, Claimed, Snapshot
from tests.cluster.test_ownership import (
    LOG_STREAM,
    PARTITION,
    PREFIX,
    entries,
    log_of,
)

SUBJECT = partition_log_subject(PREFIX, PARTITION)
BIG = 3 * 1024 * 1024  # three of the bus's largest messages, and more


async def on_subject(js: JetStreamContext) -> int:
    """How many messages the stream keeps on the partition's subject."""
    info = await js.stream_info(LOG_STREAM, subjects_filter=SUBJECT)
    return (info.state.subjects or {}).get(SUBJECT, 0)


async def test_a_snapshot_replaces_the_log_before_it_and_a_claim_reads_it_and_the_tail(
    bus: Bus, other: Bus, js: JetStreamContext
) -> None:
    first = log_of(bus, "first")
    await first.claim()
    for n in range(50):
        await first.append([n], b"history %d" % n)
    assert await on_subject(js) == 51
    await first.snapshot([47, 48, 49], b"the live state")
    await first.append([50], b"tail 50")
    await first.append([51], b"tail 51")
    assert await on_subject(js) == 3  # the snapshot and the tail: the history is gone

    second = log_of(other, "second")
    caught = await second.claim()
    assert caught.entries == 3  # what it read: one snapshot and the tail, nothing more
    assert caught.snapshot == b"the live state"
    assert caught.records == [b"tail 50", b"tail 51"]
    assert caught.applied == {47, 48, 49, 50, 51}
    assert (caught.epoch, caught.previous_owner) == (2, "first")
    assert [c.owner for c in caught.claims] == ["first"]


async def test_a_zombies_snapshot_is_refused_and_drops_nothing(
    bus: Bus, other: Bus, js: JetStreamContext
) -> None:
    zombie = log_of(bus, "zombie")
    await zombie.claim()
    await zombie.append([1], b"r1")
    owner = log_of(other, "owner")
    await owner.claim()
    await owner.append([2], b"r2")
    before = await entries(js)

    with pytest.raises(Fenced, match="another writer appended first"):
        await zombie.snapshot([1], b"a zombie's state")
    with pytest.raises(Fenced, match="fenced already"):
        await zombie.append([3], b"r3")
    assert await entries(js) == before
    # The owner's own snapshot is taken, and the zombie's view of the log ends there.
    await owner.snapshot([2], b"state")
    with pytest.raises(Fenced):
        await zombie.snapshot([1], b"again")
    assert [type(e) for e in await entries(js)] == [Snapshot]


async def test_a_snapshot_over_a_message_goes_as_one_atomic_batch_and_is_read_back_whole(
    bus: Bus, other: Bus, js: JetStreamContext
) -> None:
    state = os.urandom(BIG)
    owner = log_of(bus, "owner")
    await owner.claim()
    await owner.append([1], b"r1")
    await owner.snapshot([1], state)
    assert await on_subject(js) > 1  # its parts, which replaced the claim and the append
    await owner.append([2], b"r2")
    await owner.hand_over()

    caught = await log_of(other, "next").claim()
    assert caught.snapshot == state
    assert caught.records == [b"r2"]
    assert caught.applied == {1, 2}
    assert caught.handed_over  # the log it read ends with the hand-over
    assert caught.previous_owner == "owner"


async def test_a_zombies_batch_is_refused_whole(bus: Bus, other: Bus, js: JetStreamContext) -> None:
    zombie = log_of(bus, "zombie")
    await zombie.claim()
    owner = log_of(other, "owner")
    await owner.claim()
    before = await entries(js)
    with pytest.raises(Fenced):
        await zombie.snapshot([], os.urandom(BIG))
    assert await entries(js) == before


# A child that claims the partition, snapshots a large state (the batch commits), appends a
# tail, then starts a second snapshot's batch and kills itself (SIGKILL) before its commit.
_KILLED_MID_BATCH = """
import asyncio, os, signal, sys
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.tier.ownership import PartitionLog

async def main(url):
    bus = await Bus.connect(NatsSettings(url=url), "dies-mid-batch")
    log = PartitionLog(bus, %(stream)r, %(prefix)r, %(partition)d, "dies")
    await log.claim()
    await log.snapshot([7], b"s" * %(big)d)
    await log.append([8], b"tail 8")
    real = bus._nc.request
    sent = []

    async def dying(subject, payload, **kwargs):
        if sent:  # the batch's first message is in: die before the rest and the commit
            await bus._nc.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        sent.append(subject)
        return await real(subject, payload, **kwargs)

    bus._nc.request = dying
    await log.snapshot([7, 8], b"t" * %(big)d)

asyncio.run(main(sys.argv[1]))
"""


async def run_until_killed(script: str, url: str) -> None:
    """Run a writer script as a child process, given the cluster's URL; it must end by killing
    itself with SIGKILL."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, url, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode == -9, stderr.decode()


async def test_a_writer_killed_in_the_middle_of_a_snapshots_batch_leaves_the_last_snapshot(
    nats_cluster: NatsCluster, bus: Bus, other: Bus, js: JetStreamContext
) -> None:
    script = _KILLED_MID_BATCH % {
        "stream": LOG_STREAM,
        "prefix": PREFIX,
        "partition": PARTITION,
        "big": BIG,
    }
    await run_until_killed(script, nats_cluster.url)

    caught = await log_of(other, "next").claim()
    assert caught.snapshot == b"s" * BIG  # the first snapshot, whole; nothing of the second
    assert caught.records == [b"tail 8"]
    assert caught.applied == {7, 8}
    assert caught.previous_owner == "dies"
    assert [type(e) for e in await entries(js)] == [Snapshot, Appended, Claimed]


# A child that claims, snapshots, appends a tail, then sends a second snapshot as one message
# and kills itself (SIGKILL) once it is on the wire, before any answer.
_KILLED_AFTER_SENDING = """
import asyncio, os, signal, sys
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.tier.ownership import PartitionLog

async def main(url):
    bus = await Bus.connect(NatsSettings(url=url), "dies-after-sending")
    log = PartitionLog(bus, %(stream)r, %(prefix)r, %(partition)d, "dies")
    await log.claim()
    await log.snapshot([7], b"first")
    await log.append([8], b"tail 8")

    async def dying(subject, payload, timeout=None, headers=None):
        await bus._nc.publish(subject, payload, headers=headers)
        await bus._nc.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    bus._js.publish = dying
    await log.snapshot([7, 8], b"second")

asyncio.run(main(sys.argv[1]))
"""


async def test_a_writer_killed_as_it_sends_a_one_message_snapshot_leaves_one_or_the_other(
    nats_cluster: NatsCluster, bus: Bus, other: Bus
) -> None:
    script = _KILLED_AFTER_SENDING % {
        "stream": LOG_STREAM,
        "prefix": PREFIX,
        "partition": PARTITION,
    }
    await run_until_killed(script, nats_cluster.url)

    caught = await log_of(other, "next").claim()
    # The roll-up is one message: it landed whole and replaced the first snapshot and its tail,
    # or it did not, and those are there; never a mix.
    assert (caught.snapshot, caught.records, caught.applied) in [
        (b"second", [], {7, 8}),
        (b"first", [b"tail 8"], {7, 8}),
    ]
