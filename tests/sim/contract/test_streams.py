"""Contracts of stream and consumer administration: what worker.tier.streams builds the tier's
streams with, through worker.bus.streams.

    contract                                        tier code that relies on it
    a stream is created as specified, read back     tier.streams.open_* (`stream_spec`, then
      as specified, absent as None                    `create_stream` if None)
    creating it again with its config is accepted;  two workers opening the tier at once;
      with another config, refused                    `create_stream`'s BusError
    a stream whose subjects another captures is     tier.streams._create (StreamMismatch
      not created; `stream_capturing` names it        naming the other stream)
    an update changes what it names, keeps the      tier.streams.open_partition_log (relaxes
      rest and the messages                           an earlier version's log stream)
    the partition transform stores a handoff's      tier.streams.open_partitions, balance.
      input at `inp.<FNV-1a(id) % P>.<id>`; the       partition_of, events.subjects; the
      stream captures `in.*` only; metadata kept      metadata's partition count
    a work-queue stream takes a consumer per        tier.streams.open_partition_consumer
      partition, refuses an overlapping one;          (every worker opens every partition's
      creating again keeps, a changed config          consumer; a new ack wait updates it)
      updates
"""

from __future__ import annotations

import uuid

import msgspec
import pytest

from kvhandoff.events.subjects import partition_transform
from kvhandoff.worker.bus.streams import (
    StreamSpec,
    create_pull_consumer,
    create_stream,
    last_message,
    stream_capturing,
    stream_spec,
)
from kvhandoff.worker.errors import BusError, PartitionsMismatch
from kvhandoff.worker.tier.balance import partition_of
from kvhandoff.worker.tier.streams import (
    open_partition_consumer,
    open_partition_log,
    open_partitions,
)
from tests.sim.contract.backend import Backend, contract
from tests.sim.contract.observe import consumer_info, stored_subjects

_NS = 1_000_000_000


@contract
async def test_a_stream_is_created_as_specified_and_read_back(backend: Backend) -> None:
    bus = await backend.connect("admin")
    prefix = backend.fresh("p")
    spec = StreamSpec(
        name=backend.fresh("S"),
        subjects=(f"{prefix}.in.*",),
        retention="workqueue",
        transform=partition_transform(prefix, 3),
        duplicate_window_s=30.0,
        metadata={"kvhandoff.partitions": "3"},
    )
    assert await stream_spec(bus, spec.name) is None
    assert await create_stream(bus, spec)
    held = await stream_spec(bus, spec.name)
    assert held is not None
    assert (held.name, held.subjects, held.retention, held.transform) == (
        spec.name,
        spec.subjects,
        "workqueue",
        spec.transform,
    )
    assert held.duplicate_window_s == 30.0
    # The server may add metadata of its own (its version); ours is kept as given.
    assert (held.metadata or {}).items() >= {"kvhandoff.partitions": "3"}.items()
    assert (held.allow_rollup, held.max_age_s, held.max_msgs_per_subject) == (False, None, -1)

    log = StreamSpec(
        name=backend.fresh("L"),
        subjects=(f"{prefix}.log.*",),
        max_msgs_per_subject=1,
        max_age_s=60.0,
        allow_rollup=True,
        allow_atomic=True,
    )
    assert await create_stream(bus, log)
    held = await stream_spec(bus, log.name)
    assert held is not None
    assert (held.retention, held.max_msgs_per_subject, held.max_age_s) == ("limits", 1, 60.0)
    assert (held.allow_rollup, held.allow_atomic) == (True, True)


@contract
async def test_creating_a_stream_again_is_accepted_with_its_config_and_refused_with_another(
    backend: Backend,
) -> None:
    bus = await backend.connect("admin")
    spec = StreamSpec(name=backend.fresh("S"), subjects=(f"{backend.fresh('p')}.>",))
    assert await create_stream(bus, spec)
    assert await create_stream(bus, spec)  # a second worker opening the tier at the same time
    with pytest.raises(BusError, match=f"cannot create stream {spec.name}"):
        await create_stream(bus, msgspec.structs.replace(spec, max_msgs_per_subject=1))
    held = await stream_spec(bus, spec.name)
    assert held is not None and held.max_msgs_per_subject == -1  # left as it was


@contract
async def test_a_stream_whose_subjects_another_captures_is_not_created(
    backend: Backend,
) -> None:
    bus = await backend.connect("admin")
    prefix = backend.fresh("p")
    first = StreamSpec(name=backend.fresh("S"), subjects=(f"{prefix}.in.*",))
    assert await create_stream(bus, first)
    assert await stream_capturing(bus, f"{prefix}.in.x") == first.name
    assert await stream_capturing(bus, f"{prefix}.out.x") is None

    overlapping = StreamSpec(name=backend.fresh("S"), subjects=(f"{prefix}.>",))
    assert not await create_stream(bus, overlapping)
    assert await stream_spec(bus, overlapping.name) is None
    assert await stream_capturing(bus, f"{prefix}.in.x") == first.name


@contract
async def test_an_update_changes_the_settings_it_names_and_keeps_the_rest_and_the_messages(
    backend: Backend,
) -> None:
    bus = await backend.connect("admin")
    prefix = backend.fresh("p")
    stream = backend.fresh("LOG")
    # A log stream of an earlier version: an age limit, no rollups, no batches.
    earlier = StreamSpec(
        name=stream,
        subjects=(f"{prefix}.log.*",),
        max_age_s=3600.0,
        duplicate_window_s=120.0,
        metadata={"made-by": "an earlier version"},
    )
    assert await create_stream(bus, earlier)
    subject = f"{prefix}.log.0"
    seq = await bus.append_expecting(subject, b"entry", 0)

    await open_partition_log(bus, stream, prefix)

    held = await stream_spec(bus, stream)
    assert held is not None
    assert (held.max_age_s, held.allow_rollup, held.allow_atomic) == (None, True, True)
    assert held.subjects == earlier.subjects and held.duplicate_window_s == 120.0
    assert (held.metadata or {}).get("made-by") == "an earlier version"
    assert await last_message(bus, stream, subject) == b"entry"
    assert await bus.append_expecting(subject, b"next", seq) == seq + 1


@contract
async def test_the_partition_transform_stores_each_handoff_in_the_partition_of_its_id(
    backend: Backend,
) -> None:
    bus = await backend.connect("admin")
    prefix, stream, partitions = backend.fresh("p"), backend.fresh("IN"), 4
    await open_partitions(bus, stream, prefix, partitions)
    await open_partitions(bus, stream, prefix, partitions)  # a second worker: accepted
    with pytest.raises(PartitionsMismatch, match="has 4 partition"):
        await open_partitions(bus, stream, prefix, partitions + 1)

    handoffs = [uuid.UUID(int=n * 0x9E3779B97F4A7C15 + n) for n in range(1, 13)]
    for handoff in handoffs:
        for _ in range(2):  # every input of a handoff lands in its one partition
            await bus.publish_durable(f"{prefix}.in.{handoff}", b"input")

    expected = {
        f"{prefix}.inp.{partition_of(handoff, partitions)}.{handoff}": 2 for handoff in handoffs
    }
    assert await stored_subjects(bus, stream) == expected
    assert len({subject.split(".")[2] for subject in expected}) > 1  # not all in one

    # The stream captures `<prefix>.in.*` only: its own stored subjects are nobody's input.
    ack = await bus.publish_stored(f"{prefix}.inp.0.{handoffs[0]}", b"bypass")
    with pytest.raises(BusError):
        await bus.flush()
    assert ack.done() and isinstance(ack.exception(), BusError)


@contract
async def test_a_work_queue_stream_takes_one_consumer_per_partition_and_no_overlapping_one(
    backend: Backend,
) -> None:
    bus = await backend.connect("admin")
    prefix, stream, partitions = backend.fresh("p"), backend.fresh("IN"), 2
    await open_partitions(bus, stream, prefix, partitions)
    names = []
    for partition in range(partitions):
        names.append(
            await open_partition_consumer(
                bus,
                stream,
                prefix,
                "worker",
                partition,
                ack_wait_s=1.0,
                max_pending=64,
                priority_timeout_s=3.0,
                partitions=partitions,
            )
        )
    assert names == ["worker-p0", "worker-p1"]
    info = await consumer_info(bus, stream, "worker-p1")
    config = info["config"]
    assert config["filter_subject"] == f"{prefix}.inp.1.*"
    assert (config["ack_policy"], config["deliver_policy"]) == ("explicit", "all")
    assert (config["ack_wait"], config["max_ack_pending"]) == (1 * _NS, 64)
    assert config["priority_groups"] == ["owner"]
    assert config["priority_policy"] == "pinned_client"
    assert config["priority_timeout"] == 3 * _NS

    # Every worker opens every partition's consumer: the same config is kept as it is, a
    # changed one (a new --ack-wait) updates it.
    async def reopen(ack_wait_s: float) -> None:
        await create_pull_consumer(
            bus,
            stream,
            "worker-p0",
            filter_subject=f"{prefix}.inp.0.*",
            ack_wait_s=ack_wait_s,
            max_pending=64,
            group="owner",
            priority_timeout_s=3.0,
        )

    await reopen(1.0)
    await reopen(2.0)
    assert (await consumer_info(bus, stream, "worker-p0"))["config"]["ack_wait"] == 2 * _NS

    # A work-queue stream delivers each message to one consumer: no two may overlap.
    for name, filter_subject in [("all", ""), ("again", f"{prefix}.inp.1.*")]:
        with pytest.raises(BusError, match=f"cannot create consumer {name}"):
            await create_pull_consumer(
                bus, stream, name, filter_subject=filter_subject, ack_wait_s=1.0, max_pending=1
            )
