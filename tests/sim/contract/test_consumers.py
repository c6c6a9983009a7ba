"""Contracts of durable pull consumers on a work-queue stream: delivery, acks, naks, ack waits
and what a consumer tells of its state, through worker.bus.pull and worker.bus.streams.

    contract                                        tier code that relies on it
    a pull delivers its filter's messages in        tier.owner (a partition's inputs, in
      stream order; an acked message leaves the       order); the input stream's work-queue
      work-queue stream; the ack floor follows        retention; owner._forget (`ack_floor`)
    `unacknowledged` lists what was delivered and   tier.owner._claim (a new owner's orphans)
      never acknowledged, in stream order
    a nak redelivers at once, a nak with a delay    tier.owner (early inputs given back with
      not before the delay; deliveries count up       a delay; a hand-over's naks)
    an unacknowledged message is redelivered after  tier.owner "The fence"/"Order": a dead or
      the ack wait, its delivery count grown          fenced owner's inputs come back
    redeliveries come in the order their ack waits  tier.owner "Order", tier.input_order
      ran out, not in stream order
    a consumer delivers at most `max_pending`       tier.membership (max_pending bounds what
      unacknowledged                                  an owner holds)
    a fetch waits for a message published after     tier.owner's fetch loop; read_subject's
      it asked; a no-wait fetch of nothing returns    no-wait reads (404)
      [] at once
    creating a consumer again keeps its state       tier.membership: every worker opens every
                                                      partition's consumer
    a pull from a missing or deleted consumer is    tier.owner (a BusError: pull again later)
      a BusError
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Pull
from kvhandoff.worker.bus.streams import (
    StreamSpec,
    ack_floor,
    create_pull_consumer,
    create_stream,
    js_api,
    unacknowledged,
)
from kvhandoff.worker.errors import BusError
from tests.eventually import until
from tests.sim.contract.backend import Backend, contract, now
from tests.sim.contract.observe import WITHIN_S, consumer_info, seqs, stream_state, take


@dataclass(frozen=True)
class Queue:
    """A work-queue stream capturing `<prefix>.inp.>`, and a consumer of its partition 0."""

    bus: Bus
    stream: str
    consumer: str
    prefix: str

    def subject(self, handoff: str, partition: int = 0) -> str:
        return f"{self.prefix}.inp.{partition}.{handoff}"

    async def publish(self, count: int, handoff: str = "h", partition: int = 0) -> None:
        for _ in range(count):
            await self.bus.publish_durable(self.subject(handoff, partition), b"input")

    def pull(self, max_ahead: int, *, no_wait: bool = False) -> Pull:
        return Pull(self.bus, self.stream, self.consumer, max_ahead=max_ahead, no_wait=no_wait)

    async def until_stored(self, count: int) -> None:
        async def holds() -> bool:
            return bool((await stream_state(self.bus, self.stream))["messages"] == count)

        await until(holds, f"{self.stream} holds {count} messages", within=WITHIN_S)

    async def until_floor(self, floor: int) -> None:
        async def holds() -> bool:
            return await ack_floor(self.bus, self.stream, self.consumer) == floor

        await until(holds, f"the ack floor of {self.consumer} is {floor}", within=WITHIN_S)


async def _queue(backend: Backend, *, ack_wait_s: float = 30.0, max_pending: int = 64) -> Queue:
    bus = await backend.connect("owner")
    prefix, stream = backend.fresh("p"), backend.fresh("IN")
    spec = StreamSpec(name=stream, subjects=(f"{prefix}.inp.>",), retention="workqueue")
    assert await create_stream(bus, spec)
    await create_pull_consumer(
        bus,
        stream,
        "p0",
        filter_subject=f"{prefix}.inp.0.*",
        ack_wait_s=ack_wait_s,
        max_pending=max_pending,
    )
    return Queue(bus, stream, "p0", prefix)


@contract
async def test_a_pull_delivers_in_stream_order_and_an_acked_message_leaves_the_work_queue(
    backend: Backend,
) -> None:
    queue = await _queue(backend)
    await queue.publish(2, "a")
    await queue.publish(1, "x", partition=1)  # seq 3: not this consumer's
    await queue.publish(2, "b")
    await queue.publish(2, "a")
    async with queue.pull(max_ahead=8) as pull:
        got = await take(pull, 6)
        assert seqs(got) == [(1, 1), (2, 1), (4, 1), (5, 1), (6, 1), (7, 1)]
        assert [m.subject for m in got] == [queue.subject(h) for h in "aabbaa"]
        assert {m.data for m in got} == {b"input"}
        for inbound in got[:3]:
            await inbound.ack()
        await queue.until_stored(4)  # 3 (the other partition's) and 5, 6, 7
        await queue.until_floor(4)
        assert await unacknowledged(queue.bus, queue.stream, queue.consumer) == [
            (m.stream_seq, m.subject) for m in got[3:]
        ]


@contract
async def test_unacknowledged_lists_what_was_delivered_and_never_acknowledged_in_order(
    backend: Backend,
) -> None:
    queue = await _queue(backend)
    await queue.publish(6)
    async with queue.pull(max_ahead=6) as pull:
        got = await take(pull, 6)
        for index in (0, 2, 3):
            await got[index].ack()
        await queue.until_floor(1)
        left = [(m.stream_seq, m.subject) for m in (got[1], got[4], got[5])]
        bus, stream, consumer = queue.bus, queue.stream, queue.consumer
        assert await unacknowledged(bus, stream, consumer) == left

        # What the caller holds is taken from it, not read again: the answer is the same.
        def held() -> dict[int, str]:
            return {5: got[4].subject}

        assert await unacknowledged(bus, stream, consumer, held) == left
        await got[1].ack()
        await queue.until_floor(4)
        assert await unacknowledged(bus, stream, consumer) == left[1:]


@contract
async def test_a_nak_redelivers_at_once_and_a_nak_with_a_delay_not_before_it(
    backend: Backend,
) -> None:
    queue = await _queue(backend)
    await queue.publish(1)
    delay_s = 1.0
    async with queue.pull(max_ahead=1) as pull:
        [first] = await take(pull, 1)
        assert seqs([first]) == [(1, 1)]
        await first.nak()
        [again] = await take(pull, 1)
        assert seqs([again]) == [(1, 2)]
        naked_at = now()
        await again.nak(delay_s)
        [third] = await take(pull, 1)
        assert now() - naked_at >= delay_s
        assert seqs([third]) == [(1, 3)]
        await queue.until_stored(1)  # a nak is no ack: it stays
        await third.ack()
        await queue.until_stored(0)


@contract
async def test_an_unacknowledged_message_is_redelivered_after_the_ack_wait(
    backend: Backend,
) -> None:
    ack_wait_s = 1.0
    queue = await _queue(backend, ack_wait_s=ack_wait_s)
    await queue.publish(1)
    async with queue.pull(max_ahead=1) as pull:
        asked_at = now()  # the ack wait starts later, as the server delivers
        [first] = await take(pull, 1)
        [again] = await take(pull, 1)
        assert now() - asked_at >= ack_wait_s
        assert seqs([first, again]) == [(1, 1), (1, 2)]
        await again.ack()
        await queue.until_stored(0)
    info = await consumer_info(queue.bus, queue.stream, queue.consumer)
    assert (info["num_ack_pending"], info["num_redelivered"]) == (0, 0)


@contract
async def test_redeliveries_come_in_the_order_their_ack_waits_ran_out(backend: Backend) -> None:
    """Message 1 is given back and redelivered half an ack wait after both were delivered, so
    its ack wait runs out after message 2's: 2 is redelivered first. (The server collects the
    expired at each check, and sorts only those of one check by stream sequence.)"""
    ack_wait_s = 1.0
    queue = await _queue(backend, ack_wait_s=ack_wait_s)
    await queue.publish(2)
    async with queue.pull(max_ahead=2) as pull:
        delivered_at = now()
        first, second = await take(pull, 2)
        assert seqs([first, second]) == [(1, 1), (2, 1)]
        await backend.advance(ack_wait_s / 2)
        await first.nak()
        [renewed] = await take(pull, 1)
        assert seqs([renewed]) == [(1, 2)]
        [expired] = await take(pull, 1)
        assert now() - delivered_at >= ack_wait_s
        assert seqs([expired]) == [(2, 2)]
        [last] = await take(pull, 1)
        assert seqs([last]) == [(1, 3)]


@contract
async def test_a_consumer_delivers_at_most_max_pending_unacknowledged(backend: Backend) -> None:
    queue = await _queue(backend, max_pending=2)
    await queue.publish(4)
    async with queue.pull(max_ahead=8) as pull:
        delivered = await take(pull, 2)
        assert seqs(delivered) == [(1, 1), (2, 1)]
        await backend.advance(0.3)  # time enough for the server to deliver more, if it would
        assert pull.ready == []
        info = await consumer_info(queue.bus, queue.stream, queue.consumer)
        assert (info["num_ack_pending"], info["num_pending"]) == (2, 2)
        await delivered[0].ack()
        [third] = await take(pull, 1)
        assert seqs([third]) == [(3, 1)]


@contract
async def test_a_fetch_waits_for_a_message_published_after_it_asked(backend: Backend) -> None:
    queue = await _queue(backend)
    async with queue.pull(max_ahead=1, no_wait=True) as reader:
        asked_at = now()
        assert await reader.fetch(1, timeout_s=WITHIN_S) == []  # 404: at once, not at the timeout
        assert now() - asked_at < WITHIN_S / 2
    async with queue.pull(max_ahead=1) as pull:
        waiting = asyncio.ensure_future(pull.fetch(1, timeout_s=WITHIN_S))

        async def asked() -> bool:
            info = await consumer_info(queue.bus, queue.stream, queue.consumer)
            return bool(info["num_waiting"] == 1)

        await until(asked, "the pull request waits on the server", within=WITHIN_S)
        await queue.publish(1)
        assert seqs(await waiting) == [(1, 1)]


@contract
async def test_creating_a_consumer_again_keeps_its_state(backend: Backend) -> None:
    queue = await _queue(backend)
    await queue.publish(3)
    async with queue.pull(max_ahead=1) as pull:
        [first] = await take(pull, 1)
        await first.ack()
        await queue.until_floor(1)
    await create_pull_consumer(
        queue.bus,
        queue.stream,
        queue.consumer,
        filter_subject=f"{queue.prefix}.inp.0.*",
        ack_wait_s=30.0,
        max_pending=64,
    )
    assert await ack_floor(queue.bus, queue.stream, queue.consumer) == 1
    # The Pull before asked ahead as it returned message 1, and was delivered message 2: the
    # consumer still holds it delivered, unacknowledged until its ack wait runs out.
    assert await unacknowledged(queue.bus, queue.stream, queue.consumer) == [
        (2, queue.subject("h"))
    ]
    async with queue.pull(max_ahead=1) as pull:
        assert seqs(await take(pull, 1)) == [(3, 1)]


@contract
async def test_a_pull_from_a_missing_or_deleted_consumer_is_a_bus_error(backend: Backend) -> None:
    queue = await _queue(backend)
    async with Pull(queue.bus, queue.stream, "no-such-consumer", max_ahead=1) as pull:
        with pytest.raises(BusError, match="no-such-consumer"):
            await pull.fetch(1, timeout_s=WITHIN_S)
    async with queue.pull(max_ahead=1) as pull:
        waiting = asyncio.ensure_future(pull.fetch(1, timeout_s=WITHIN_S))

        async def asked() -> bool:
            info = await consumer_info(queue.bus, queue.stream, queue.consumer)
            return bool(info["num_waiting"] == 1)

        await until(asked, "the pull request waits on the server", within=WITHIN_S)
        await js_api(
            queue.bus,
            f"$JS.API.CONSUMER.DELETE.{queue.stream}.{queue.consumer}",
            {},
            "delete the consumer",
        )
        with pytest.raises(BusError, match="409 Consumer Deleted: the consumer is gone"):
            await waiting
