"""The partitioned input stream (`open_partitions`, see "Partitions" in worker.tier.streams): the
stream's subject transform puts every input of a handoff in one partition, in order, and spreads
handoffs over all of them; the partition count is stored with the stream and a worker with
another count refuses, the single-worker worker included (exit 2); R3 in a cluster, R1 alone.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from kvhandoff.events.subjects import partition_subject
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Inbound, Pull
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.bus.streams import unacknowledged
from kvhandoff.worker.errors import ConfigError, PartitionsMismatch
from kvhandoff.worker.harness.natsserver import EmbeddedNats, NatsCluster
from kvhandoff.worker.tier.streams import (
    CONSUMER_METADATA,
    PARTITIONS_METADATA,
    PRIORITY_GROUP,
    open_partition_consumer,
    open_partitions,
)
from tests.cluster.conftest import WITHIN_S, publish
from tests.worker.conftest import WorkerProcess

PREFIX = "kvhandoff"
STREAM = "KVHANDOFF_IN"
PARTITIONS = 4


async def test_every_input_of_a_handoff_lands_in_one_partition_in_order(
    bus: Bus, js: JetStreamContext
) -> None:
    await open_partitions(bus, STREAM, PREFIX, PARTITIONS)
    handoffs = [uuid.uuid4() for _ in range(40)]
    for step in range(3):
        for handoff in handoffs:
            await publish(js, f"{PREFIX}.in.{handoff}", f"{handoff} {step}".encode())

    seen: dict[str, list[tuple[int, int]]] = defaultdict(list)  # handoff -> (partition, step)
    info = await js.stream_info(STREAM)
    assert info.state.messages == 3 * len(handoffs)
    for seq in range(1, info.state.last_seq + 1):
        message = await js.get_msg(STREAM, seq)
        assert message.subject is not None and message.data is not None
        head, inp, partition, named = message.subject.split(".")
        assert (head, inp) == (PREFIX, "inp")
        sent, sent_step = message.data.decode().split()
        assert named == sent  # the id survives the transform, as the last token
        seen[named].append((int(partition), int(sent_step)))

    for named, places in seen.items():
        assert len({p for p, _ in places}) == 1, f"{named} spread over {places}"
        assert [s for _, s in places] == [0, 1, 2], f"{named} out of order"
    used = {places[0][0] for places in seen.values()}
    assert used == set(range(PARTITIONS))  # 40 ids over 4 partitions: all are used
    # The partition filter a consumer uses takes exactly its partition's inputs.
    for index in range(PARTITIONS):
        last = await js.get_last_msg(STREAM, partition_subject(PREFIX, index))
        assert last.subject is not None and last.subject.split(".")[2] == str(index)


async def test_the_stream_is_replicated_and_keeps_its_partition_count(
    bus: Bus, js: JetStreamContext
) -> None:
    assert bus.clustered and bus.replicas == 3
    await open_partitions(bus, STREAM, PREFIX, PARTITIONS)
    await open_partitions(bus, STREAM, PREFIX, PARTITIONS)  # a second worker: the same stream

    info = await js.stream_info(STREAM)
    assert info.config.num_replicas == 3
    metadata = info.config.metadata or {}
    assert (metadata[PARTITIONS_METADATA], metadata[CONSUMER_METADATA]) == ("4", "tier")
    with pytest.raises(PartitionsMismatch, match=rf"{STREAM} has 4 partition\(s\).* with 8"):
        await open_partitions(bus, STREAM, PREFIX, 8)
    with pytest.raises(PartitionsMismatch, match=r"has 4 partition.* started with 1"):
        await open_partitions(bus, STREAM, PREFIX, 1)
    with pytest.raises(ConfigError, match="0 partitions; at least one"):
        await open_partitions(bus, "OTHER", PREFIX, 0)


async def test_an_input_outside_the_partitioned_subjects_is_not_stored(
    bus: Bus, js: JetStreamContext
) -> None:
    await open_partitions(bus, STREAM, PREFIX, PARTITIONS)
    await publish(js, f"{PREFIX}.in.{uuid.uuid4()}", b"x")  # the stream answers by now
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        # It would sit in no partition, unconsumed, for ever: no stream takes it.
        await js.publish(f"{PREFIX}.in.{uuid.uuid4()}.extra", b"x", timeout=5)


async def test_alone_the_stream_is_r1_and_a_single_worker_stream_of_old_is_refused(
    tmp_path: Path,
) -> None:
    with EmbeddedNats(store_dir=tmp_path) as server:
        bus = await Bus.connect(NatsSettings(url=server.url), "test-alone")
        try:
            assert not bus.clustered and bus.replicas == 1
            await open_partitions(bus, STREAM, PREFIX, PARTITIONS)
            nc = await nats.connect(server.url)
            try:
                info = await nc.jetstream().stream_info(STREAM)
                assert info.config.num_replicas == 1
                # Streams that earlier versions made for their single worker: marked, and from
                # before the mark existed. Its history is in its file, in no replicated log.
                for name, metadata in [
                    ("SINGLE", {PARTITIONS_METADATA: "1", CONSUMER_METADATA: "single"}),
                    ("OLD", None),
                ]:
                    config = StreamConfig(name=name, subjects=[f"{name.lower()}.in.>"])
                    config.metadata = metadata
                    await nc.jetstream().add_stream(config)
                    for partitions in (1, 2):
                        with pytest.raises(
                            PartitionsMismatch,
                            match=rf"{name} was made for 'single', the single worker of an "
                            r"earlier kvhandoff.*then delete the stream",
                        ):
                            await open_partitions(bus, name, name.lower(), partitions)
            finally:
                await nc.close()
        finally:
            await bus.close()


@pytest.mark.parametrize(
    ("made_by", "started_as", "refusal"),
    [
        (4, None, "has 4 partition(s) and this worker was started with 1"),
        (1, 2, "has 1 partition(s) and this worker was started with 2"),
        (None, None, "was made for 'single', the single worker of an earlier kvhandoff"),
    ],
    ids=["4-then-default", "1-then-2", "old-single-then-default"],
)
def test_a_worker_started_on_a_stream_of_another_count_or_kind_exits_2(
    tmp_path: Path, made_by: int | None, started_as: int | None, refusal: str
) -> None:
    """`made_by`: the tier's partition count, or None for an earlier version's single worker;
    `started_as`: the worker's `--partitions`, or None for the default."""

    async def make() -> None:
        if made_by is None:
            nc = await nats.connect(server.url)
            try:
                await nc.jetstream().add_stream(name=STREAM, subjects=[f"{PREFIX}.in.>"])
            finally:
                await nc.close()
            return
        bus = await Bus.connect(NatsSettings(url=server.url), "test-partition")
        try:
            await open_partitions(bus, STREAM, PREFIX, made_by)
        finally:
            await bus.close()

    store = tmp_path / "nats"
    store.mkdir()
    tier = (
        [] if started_as is None else ["--partitions", str(started_as), "--data-dir", str(tmp_path)]
    )
    with EmbeddedNats(store_dir=store) as server:
        asyncio.run(make())
        worker = WorkerProcess(server.url, tmp_path / "kvhandoff.db", *tier)
        worker.launch()
        assert worker.process is not None
        try:
            assert worker.process.wait(timeout=60) == 2, worker.logs()
        finally:
            worker.stop()
        assert refusal in worker.logs()


async def test_the_only_partitions_consumer_is_unfiltered_and_an_earlier_filtered_one_updated(
    nats_cluster: NatsCluster, bus: Bus, js: JetStreamContext
) -> None:
    # A wildcard filter costs the server more per delivery over a backlog of many handoffs,
    # and the only partition's would select every message anyway (see "Pins" in
    # worker.tier.streams).
    await open_partitions(bus, STREAM, PREFIX, 1)
    name = "kvhandoff-worker-p0"
    earlier = {  # the config an earlier version made it with: filtered by the partition
        "stream_name": STREAM,
        "config": {
            "name": name,
            "durable_name": name,
            "filter_subject": partition_subject(PREFIX, 0),
            "ack_policy": "explicit",
            "deliver_policy": "all",
            "ack_wait": 1_000_000_000,
            "max_ack_pending": 64,
            "max_deliver": -1,
            "priority_groups": [PRIORITY_GROUP],
            "priority_policy": "pinned_client",
            "priority_timeout": 5_000_000_000,
        },
    }
    nc = await nats.connect(nats_cluster.url.split(","))
    try:
        reply = await nc.request(
            f"$JS.API.CONSUMER.CREATE.{STREAM}.{name}", json.dumps(earlier).encode(), timeout=5
        )
        assert b'"error"' not in reply.data, reply.data
    finally:
        await nc.close()
    assert (await js.consumer_info(STREAM, name)).config.filter_subject

    made = await open_partition_consumer(
        bus,
        STREAM,
        PREFIX,
        "kvhandoff-worker",
        0,
        ack_wait_s=1.0,
        max_pending=64,
        priority_timeout_s=5.0,
        partitions=1,
    )
    assert made == name
    assert not (await js.consumer_info(STREAM, name)).config.filter_subject
    sent = [await publish(js, f"{PREFIX}.in.{uuid.uuid4()}", b"%d" % n) for n in range(3)]
    async with Pull(bus, STREAM, name, max_ahead=8, group=PRIORITY_GROUP) as pull:
        got = await pull_all(pull, len(sent))
        assert [inbound.stream_seq for inbound in got] == sent
        # What a new owner reads first, unfiltered too.
        left = await unacknowledged(bus, STREAM, name)
        assert left == [(inbound.stream_seq, inbound.subject) for inbound in got]
        for inbound in got:
            await inbound.ack()


async def pull_all(pull: Pull, count: int) -> list[Inbound]:
    """Fetch until `count` inputs came, none acknowledged."""
    got: list[Inbound] = []
    while len(got) < count:
        batch = await pull.fetch(8, timeout_s=WITHIN_S)
        assert batch, f"{len(got)} of {count} inputs within {WITHIN_S}s"
        got += batch
    return got


class Gets:
    """The message gets that reach the server, as another subscriber to their subject sees
    them."""

    def __init__(self) -> None:
        self.count = 0

    async def on_get(self, _: object) -> None:
        self.count += 1


async def test_what_a_new_owner_holds_of_the_unacknowledged_messages_is_not_read_again(
    nats_cluster: NatsCluster, bus: Bus, js: JetStreamContext
) -> None:
    """A new owner's first batch over a backlog holds most of what a claim reads: those are
    not read again (one message get each), in whatever order they came, and what comes while
    the walk goes on counts too; only the rest is read."""
    await open_partitions(bus, STREAM, PREFIX, 1)
    name = await open_partition_consumer(
        bus,
        STREAM,
        PREFIX,
        "kvhandoff-worker",
        0,
        ack_wait_s=30.0,
        max_pending=64,
        priority_timeout_s=5.0,
        partitions=1,
    )
    sent = [await publish(js, f"{PREFIX}.in.{uuid.uuid4()}", b"%d" % n) for n in range(5)]
    watcher = await Bus.connect(NatsSettings(url=nats_cluster.url), "test-gets-watcher")
    gets = Gets()
    await watcher.subscribe(f"$JS.API.STREAM.MSG.GET.{STREAM}", gets.on_get)
    await watcher.flush()

    async def read_with(held: Callable[[], Mapping[int, str]] | None) -> int:
        """Read what is unacknowledged, given what is held; the message gets it took."""
        before = gets.count
        assert await unacknowledged(bus, STREAM, name, held) == every
        await watcher.flush()  # the server routed each get to it before answering the get
        return gets.count - before

    try:
        async with Pull(bus, STREAM, name, max_ahead=8, group=PRIORITY_GROUP) as pull:
            got = await pull_all(pull, len(sent))
            every = [(inbound.stream_seq, inbound.subject) for inbound in got]
            assert [seq for seq, _ in every] == sent

            assert await read_with(None) == len(sent)
            assert await read_with(lambda: {}) == len(sent)
            assert await read_with(lambda: dict(every)) == 0
            assert await read_with(lambda: dict(reversed(every))) == 0
            assert await read_with(lambda: dict(every[1:])) == 1
            assert await read_with(lambda: dict(every[:-1])) == 1
            # Delivered while the walk goes on: asked again once the walk passes what was held.
            arriving = iter([dict(every[:2]), dict(every)])
            assert await read_with(lambda: next(arriving)) == 0
    finally:
        await watcher.close()
