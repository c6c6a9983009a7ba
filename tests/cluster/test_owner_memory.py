"""A partition owner (worker.tier.owner) does not remember every input it ever applied:
once the consumer's ack floor has passed them, it forgets them (they are never delivered
again), so a long-running owner's memory stays flat; but not past a floor that a new leader of
the consumer may report lower, and so deliver again what is above it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Inbound
from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.tier import owner as owner_module
from kvhandoff.worker.tier.balance import partition_of
from kvhandoff.worker.tier.owner import Decided, PartitionOwner
from kvhandoff.worker.tier.ownership import PartitionLog
from kvhandoff.worker.tier.streams import (
    open_partition_consumer,
    open_partition_log,
    open_partitions,
)
from tests.cluster.conftest import WITHIN_S
from tests.cluster.stand_in import StandIn
from tests.eventually import still_running, until

PREFIX, STREAM, LOG_STREAM, PARTITIONS = "kvhandoff", "KVHANDOFF_IN", "KVHANDOFF_LOG", 2
INPUTS = 60


@contextlib.asynccontextmanager
async def _owner_of(
    bus: Bus, applied: list[int]
) -> AsyncIterator[tuple[PartitionOwner, asyncio.Task[None]]]:
    """An owner of partition 0 that forgets every 0.2 s, and its running task, with INPUTS
    inputs sent to it; `applied` gets the stream sequence of each input it applies."""
    await open_partitions(bus, STREAM, PREFIX, PARTITIONS)
    await open_partition_log(bus, LOG_STREAM, PREFIX)
    consumer = await open_partition_consumer(
        bus,
        STREAM,
        PREFIX,
        "c",
        0,
        ack_wait_s=1.0,
        max_pending=1024,
        priority_timeout_s=3.0,
        partitions=PARTITIONS,
    )
    log = PartitionLog(bus, LOG_STREAM, PREFIX, 0, "test/owner")

    async def decide(batch: Sequence[Inbound]) -> Decided:
        return Decided(b"records")

    async def act(batch: Sequence[Inbound]) -> None:
        applied.extend(inbound.stream_seq for inbound in batch)

    owner = PartitionOwner(
        bus, STREAM, consumer, log, StandIn(decide, act), expires_s=1.0, forget_every_s=0.2
    )
    stop = asyncio.Event()
    running = asyncio.create_task(owner.run(stop))
    try:
        handoff = next(h for h in iter(uuid.uuid4, None) if partition_of(h, PARTITIONS) == 0)
        for n in range(INPUTS):
            await bus.publish_durable(f"{PREFIX}.in.{handoff}", b"%d" % n)
        yield owner, running
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, WITHIN_S)


async def test_an_owner_forgets_the_inputs_below_the_ack_floor(
    nats_cluster: NatsCluster, bus: Bus
) -> None:
    applied: list[int] = []
    async with _owner_of(bus, applied) as (owner, running):
        await until(
            lambda: len(applied) >= INPUTS and not owner.remembered,
            "every input applied, and forgotten",
            within=2 * WITHIN_S,
            guard=still_running(running),
        )
    assert owner.applied == INPUTS and len(set(applied)) == INPUTS


async def test_an_owner_keeps_what_a_new_consumer_leader_may_deliver_again(
    nats_cluster: NatsCluster, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ack floor a leader reports may count acks its replicas do not have, and its
    successor's floor is then lower: the owner cuts only up to the floor of the previous read
    (or a lower one now), so it still recognises what the successor delivers again. The floor
    reads are scripted: once every input is applied, the leader's floor is past all of them,
    then a new leader's is halfway."""
    applied: list[int] = []
    reads: list[int] = []  # the floors read once every input was applied

    async def ack_floor(_bus: Bus, stream: str, consumer: str) -> int:
        if len(applied) < INPUTS:
            return 0
        # The old leader's floor, then its successor's.
        reads.append(sorted(applied)[-1 if not reads else INPUTS // 2 - 1])
        return reads[-1]

    monkeypatch.setattr(owner_module, "ack_floor", ack_floor)  # the owner's floor reads
    async with _owner_of(bus, applied) as (owner, running):
        # Until two reads of the successor's floor (the cut after the second is its own), or
        # until the owner remembers nothing: it would read no floor any more.
        await until(
            lambda: len(applied) >= INPUTS and (not owner.remembered or len(reads) >= 3),
            "every input applied, and the successor's floor read twice",
            within=2 * WITHIN_S,
            guard=still_running(running),
        )
    assert owner.applied == INPUTS
    assert owner.remembered == INPUTS - INPUTS // 2
