"""Contracts of a partition consumer's pinned priority group (ADR-42), as worker.tier.streams
makes it and worker.bus.pull pulls it.

    contract                                        tier code that relies on it
    nobody is pinned before a delivery, whoever     tier.owner._claim_if_vacant (`pinned`)
      pulls; the first puller delivered to is
      pinned, and the pin id rides on its messages
    a pull with another pin id is refused (423,     tier.owner (`PinMismatch`: another
      `PinMismatch`); one without waits, unserved,    worker holds the partition)
      while the pin holds
    `unpin` lets the next puller be pinned at once; tier.owner._hand_over
      the old pin's open request is refused
    the pin lapses `priority_timeout` after its     tier.membership (a dead worker's
      holder's last pull, not before; the holder's    partitions move), tier.owner "Order"
      unacknowledged messages come to the next        (ack wait < priority timeout)
      holder first
    a holder that keeps pulling keeps its pin       tier.owner (a pull's expiry is shorter
                                                      than the priority timeout)
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import pytest

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Pull
from kvhandoff.worker.bus.streams import pinned, unpin
from kvhandoff.worker.errors import PinMismatch
from kvhandoff.worker.tier.streams import (
    PRIORITY_GROUP,
    open_partition_consumer,
    open_partitions,
)
from tests.eventually import until
from tests.sim.contract.backend import Backend, contract, now
from tests.sim.contract.observe import WITHIN_S, consumer_info, seqs, take

HOLDS_S = 600.0  # a priority timeout that no contract outlives


@dataclass(frozen=True)
class Partition:
    """A partitioned input stream of one partition and that partition's pinned consumer."""

    stream: str
    consumer: str
    prefix: str

    async def publish(self, bus: Bus, count: int) -> None:
        handoff = uuid.UUID(int=1)
        for _ in range(count):
            await bus.publish_durable(f"{self.prefix}.in.{handoff}", b"input")

    def pull(
        self,
        bus: Bus,
        *,
        pin_id: str | None = None,
        expires_s: float = 30.0,
        heartbeat_s: float = 5.0,
    ) -> Pull:
        """A Pull as an owner makes one: in the priority group, asking one message ahead."""
        return Pull(
            bus,
            self.stream,
            self.consumer,
            max_ahead=1,
            expires_s=expires_s,
            heartbeat_s=heartbeat_s,
            group=PRIORITY_GROUP,
            pin_id=pin_id,
        )

    async def is_pinned(self, bus: Bus) -> bool:
        return await pinned(bus, self.stream, self.consumer, PRIORITY_GROUP)

    async def until_waiting(self, bus: Bus, requests: int) -> None:
        async def holds() -> bool:
            info = await consumer_info(bus, self.stream, self.consumer)
            return bool(info["num_waiting"] == requests)

        await until(holds, f"{requests} pull requests wait on the server", within=WITHIN_S)


async def _partition(
    backend: Backend, bus: Bus, *, priority_timeout_s: float, ack_wait_s: float = 30.0
) -> Partition:
    prefix, stream = backend.fresh("p"), backend.fresh("IN")
    await open_partitions(bus, stream, prefix, 1)
    consumer = await open_partition_consumer(
        bus,
        stream,
        prefix,
        "worker",
        0,
        ack_wait_s=ack_wait_s,
        max_pending=64,
        priority_timeout_s=priority_timeout_s,
        partitions=1,
    )
    return Partition(stream, consumer, prefix)


@contract
async def test_the_first_puller_delivered_to_is_pinned_and_another_pin_is_refused(
    backend: Backend,
) -> None:
    bus, other = await backend.connect("holder"), await backend.connect("other")
    partition = await _partition(backend, bus, priority_timeout_s=HOLDS_S)
    async with partition.pull(bus) as holder:
        asking = asyncio.ensure_future(holder.fetch(1, timeout_s=WITHIN_S))
        await partition.until_waiting(bus, 1)
        assert not await partition.is_pinned(bus)  # pulled, but nothing delivered yet
        await partition.publish(bus, 2)
        [first] = await asking
        pin = holder.pin_id
        assert pin and seqs([first]) == [(1, 1)]
        assert await partition.is_pinned(bus)

        async with partition.pull(other, pin_id="not-the-pin") as intruder:
            with pytest.raises(PinMismatch, match="423"):
                await intruder.fetch(1, timeout_s=WITHIN_S)
            assert intruder.pin_id is None
            # Without an id it asks to be pinned, and waits unserved while the pin holds.
            waiting = asyncio.ensure_future(intruder.fetch(1, timeout_s=WITHIN_S))
            [second] = await take(holder, 1)  # asked for as the holder took the first
            assert seqs([second]) == [(2, 1)] and holder.pin_id == pin
            await partition.publish(bus, 1)
            [third] = await take(holder, 1)
            assert seqs([third]) == [(3, 1)]
            intruder.wake()
            assert await waiting == []


@contract
async def test_unpin_lets_the_next_puller_be_pinned_and_refuses_the_old_pin(
    backend: Backend,
) -> None:
    bus, other = await backend.connect("holder"), await backend.connect("successor")
    partition = await _partition(backend, bus, priority_timeout_s=HOLDS_S)
    await partition.publish(bus, 1)
    async with partition.pull(bus) as holder, partition.pull(other) as successor:
        [first] = await take(holder, 1)
        await first.ack()  # and the holder asked for the next one with its pin
        old_pin = holder.pin_id
        # The server serves its waiting requests in turn: the holder's first.
        await partition.until_waiting(bus, 1)
        waiting = asyncio.ensure_future(successor.fetch(1, timeout_s=WITHIN_S))
        await partition.until_waiting(bus, 2)
        await unpin(bus, partition.stream, partition.consumer, PRIORITY_GROUP)
        assert not await partition.is_pinned(bus)
        await partition.publish(bus, 1)
        assert seqs(await waiting) == [(2, 1)]
        assert successor.pin_id not in (None, old_pin)
        with pytest.raises(PinMismatch, match="423"):  # the old pin's request, still open
            await holder.fetch(1, timeout_s=WITHIN_S)


@contract
async def test_a_pin_lapses_after_the_priority_timeout_and_the_next_holder_gets_the_orphans_first(
    backend: Backend,
) -> None:
    priority_timeout_s, ack_wait_s = 1.0, 0.5
    bus, doomed = await backend.connect("successor"), await backend.connect("doomed")
    partition = await _partition(
        backend, bus, priority_timeout_s=priority_timeout_s, ack_wait_s=ack_wait_s
    )
    await partition.publish(bus, 1)
    async with partition.pull(doomed) as holder:
        [orphan] = await take(holder, 1)  # never acknowledged
        old_pin = holder.pin_id
    # Its inbox is gone once the server has read what the connection sent before this
    # barrier; without it, a message published next could still go to its open request
    # (delivered, so redelivered later), which the model's network delays show.
    await doomed.flush()
    stopped_at = now()  # its last pull request was sent before this
    async with partition.pull(bus) as successor:
        waiting = asyncio.ensure_future(take(successor, 1))
        await partition.publish(bus, 1)
        [redelivered] = await waiting
        assert now() - stopped_at >= priority_timeout_s
        [new] = await take(successor, 1)
        assert seqs([orphan, redelivered, new]) == [(1, 1), (1, 2), (2, 1)]
        assert successor.pin_id not in (None, old_pin)


@contract
async def test_a_holder_that_keeps_pulling_keeps_its_pin(backend: Backend) -> None:
    priority_timeout_s = 1.0
    bus, other = await backend.connect("holder"), await backend.connect("other")
    partition = await _partition(backend, bus, priority_timeout_s=priority_timeout_s)
    await partition.publish(bus, 1)
    # Each request expires well within the priority timeout, and the holder asks again.
    async with (
        partition.pull(bus, expires_s=0.4, heartbeat_s=0.1) as holder,
        partition.pull(other) as rival,
    ):
        [first] = await take(holder, 1)
        await first.ack()
        pin = holder.pin_id
        holding = asyncio.ensure_future(holder.fetch(1, timeout_s=WITHIN_S))
        rivalling = asyncio.ensure_future(rival.fetch(1, timeout_s=WITHIN_S))
        await backend.advance(2 * priority_timeout_s)
        assert await partition.is_pinned(bus)
        await partition.publish(bus, 1)
        assert seqs(await holding) == [(2, 1)]
        assert holder.pin_id == pin
        rival.wake()
        assert await rivalling == []
