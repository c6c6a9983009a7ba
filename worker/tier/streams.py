"""The tier's streams: its partitioned input, its partitions' consumers, its partition logs and
its completions, and the rules by which a worker refuses streams that are not its tier's.

Partitions. For a tier of workers the input stream is split into P partitions, P fixed when the
stream is created and stored in its metadata (`kvhandoff.partitions`). Publishers keep
publishing to `<prefix>.in.<handoff_id>`; the stream's subject transform `{{partition(P,1)}}`
(FNV-1a of the id, modulo P) stores each input as `<prefix>.inp.<p>.<handoff_id>`, so every
input of one handoff lands in one partition, in publish order. The partitioned stream captures
`<prefix>.in.*` only, so nothing lands outside a partition. A worker opening the stream with
another P gets `PartitionsMismatch` (it exits 2): re-partitioning would move handoffs between
partitions, and with them between owners. The metadata also names the kind of worker that
consumes the stream (`kvhandoff.consumer`): `tier`. Earlier versions ran a single worker, with
a lease instead of pins and its local file for the authority, on a stream of one partition
without a transform, marked `single` (or, before that, without the metadata at all); a tier
must not take such a stream over, since the single worker's history is in no replicated log,
so it gets `PartitionsMismatch` too. A stream of the tier (input, completion, log) that exists
with other subjects or retention than the tier's, another tier's most likely, or whose subjects
another stream captures, is `StreamMismatch` (exit 2 too): updating or appending to it would
break the other tier. Streams and buckets are R3 when the server we reached is in a cluster
(its INFO names one), R1 alone (`Bus.replicas`).

Pins. Each partition has one durable pull consumer (`<consumer>-p<p>`, filtering that partition's
subject, or, in a stream of one partition, unfiltered: a wildcard filter over a backlog of many
handoffs, one subject each, costs nats-server more per delivery, and there it selects every message
anyway) with the priority group `owner` and the `pinned_client` policy (ADR-42), made by
worker.bus.streams.create_pull_consumer. The server pins the group to the first client that pulls,
stamps `Nats-Pin-Id` on what it delivers, answers a pull with another id with 423 (`PinMismatch`),
and keeps a pull without an id waiting (408 at its expiry), until `priority_timeout` passes without
a pull from the pinned client or the pin is released (worker.bus.streams.unpin); then the next
puller is pinned. What a pin guarantees: at most one client is *delivered* a partition's new
messages at a time, for as long as it keeps pulling. What it does not: acks are not checked against
it, and a paused client that wakes after the pin moved still holds the messages it was given, may
ack them and may publish. A pin is not a fence.

Logs. The tier's partition logs share one replicated stream, one subject per partition
(`events.subjects.partition_log_subject`), appended with compare-and-set (see "Fencing" in
worker.bus.publish). It keeps every entry until a snapshot rolls its subject up.

Completions and rejections. The completion stream keeps the last `Complete` of every handoff for a
while, and the rejection stream its last `Rejection`, so a frontend that was away when either
went out can still read it. (The rejection stream is named after the completion stream, whose
flag, `--done-stream`, names both.)
"""

from __future__ import annotations

import logging

import msgspec

from kvhandoff.events.subjects import partition_subject, partition_transform
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.streams import (
    StreamSpec,
    create_pull_consumer,
    create_stream,
    stream_capturing,
    stream_spec,
    update_stream,
)
from kvhandoff.worker.errors import ConfigError, PartitionsMismatch, StreamMismatch

logger = logging.getLogger(__name__)

PARTITIONS_METADATA = "kvhandoff.partitions"
# Which kind of worker consumes the input stream, in its metadata beside the partition count:
# a tier (a pinned consumer per partition; the replicated log is the authority), or `single`,
# the single worker of earlier versions (its local file was the authority), which a tier must
# not take over.
CONSUMER_METADATA = "kvhandoff.consumer"
PRIORITY_GROUP = "owner"  # the one priority group of every partition's consumer
_INPUT_DUPLICATE_WINDOW_S = 120.0
_LOG_DUPLICATE_WINDOW_S = 120.0


def _check_stream(held: StreamSpec, wanted: StreamSpec, role: str, flag: str) -> None:
    """`StreamMismatch` unless the stream there captures the subjects this tier's `role`
    does, with its retention: it is another tier's (or made by hand), which an update or our
    appends would break, and which would never hold what we store."""
    if sorted(held.subjects) == sorted(wanted.subjects) and held.retention == wanted.retention:
        return
    others = "" if flag == "--stream" else ", or give the tier its own --stream, which names it"
    raise StreamMismatch(
        f"stream {wanted.name} captures {held.captures()}, not {wanted.captures()} as this "
        f"tier's {role}: it is another tier's, or made by hand; name this tier's {role} with "
        f"{flag}{others}"
    )


async def _create(bus: Bus, spec: StreamSpec, role: str, flag: str) -> None:
    """Create the stream; `StreamMismatch` if another stream captures its subjects (another
    tier's of the same subject prefix, most likely)."""
    if await create_stream(bus, spec):
        return
    # It went away meanwhile: the next start will tell.
    other = await stream_capturing(bus, spec.subjects[0]) or "another stream"
    raise StreamMismatch(
        f"cannot create stream {spec.name} for {', '.join(spec.subjects)} as this tier's "
        f"{role}: {other} captures them (another tier's, of this --subject-prefix?); "
        f"give this tier its own --subject-prefix, or name that stream with {flag}"
    )


async def open_partitions(bus: Bus, stream: str, prefix: str, partitions: int) -> None:
    """Create the partitioned input stream if absent (R3 in a cluster), or check that the
    one there is a tier's with `partitions` partitions (`PartitionsMismatch` if not)."""
    if partitions < 1:
        raise ConfigError(f"stream {stream}: {partitions} partitions; at least one")
    spec = StreamSpec(
        name=stream,
        subjects=(f"{prefix}.in.*",),
        retention="workqueue",
        transform=partition_transform(prefix, partitions),
        duplicate_window_s=_INPUT_DUPLICATE_WINDOW_S,
    )
    held = await stream_spec(bus, stream)
    if held is None:
        await _create(
            bus,
            msgspec.structs.replace(
                spec,
                replicas=bus.replicas,
                metadata={PARTITIONS_METADATA: str(partitions), CONSUMER_METADATA: "tier"},
            ),
            "input stream",
            "--stream",
        )
        logger.info(
            "created stream %s for %s: %d partition(s), R%d",
            stream,
            list(spec.subjects),
            partitions,
            bus.replicas,
        )
        return
    metadata = held.metadata or {}
    stored = metadata.get(PARTITIONS_METADATA, "1")
    stored_consumer = metadata.get(CONSUMER_METADATA, "single" if stored == "1" else "tier")
    if stored_consumer != "tier":
        raise PartitionsMismatch(
            f"stream {stream} was made for {stored_consumer!r}, the single worker of an "
            "earlier kvhandoff, whose log is its local file and in no replicated log: let "
            "that version finish its open handoffs, then delete the stream"
        )
    _check_stream(held, spec, "input stream", "--stream")
    if stored != str(partitions):
        raise PartitionsMismatch(
            f"stream {stream} has {stored} partition(s) and this worker was started with"
            f" {partitions}; the partitions are fixed when the stream is created: start"
            f" every worker with --partitions {stored}, or delete the stream"
        )


async def open_partition_consumer(
    bus: Bus,
    stream: str,
    prefix: str,
    consumer: str,
    partition: int,
    *,
    ack_wait_s: float,
    max_pending: int,
    priority_timeout_s: float,
    partitions: int,
) -> str:
    """Create (or keep) the durable pull consumer of one partition of `partitions`, with
    the priority group `PRIORITY_GROUP` pinned to one client; its name. It never deletes a
    consumer: other workers pull from it. Pull it with `Pull(..., group=PRIORITY_GROUP)`.
    The only partition of a stream is not filtered (see "Pins"): a consumer that an earlier
    version made with a filter is updated."""
    name = f"{consumer}-p{partition}"
    await create_pull_consumer(
        bus,
        stream,
        name,
        filter_subject="" if partitions == 1 else partition_subject(prefix, partition),
        ack_wait_s=ack_wait_s,
        max_pending=max_pending,
        group=PRIORITY_GROUP,
        priority_timeout_s=priority_timeout_s,
    )
    return name


async def open_partition_log(bus: Bus, stream: str, prefix: str) -> None:
    """Create the replicated stream of the partitions' logs if absent: one subject per
    partition (`partition_log_subject`), appended with `append_expecting`. It keeps every
    entry until a snapshot rolls its subject up (`Nats-Rollup: sub`), so it takes rollup
    headers and atomic batches. A stream of an earlier version (an age limit, no rollups,
    no batches) is updated in place."""
    spec = StreamSpec(
        name=stream,
        subjects=(f"{prefix}.log.*",),
        duplicate_window_s=_LOG_DUPLICATE_WINDOW_S,
        replicas=bus.replicas,
        # Snapshots roll a partition's subject up, as one message or one atomic batch.
        allow_rollup=True,
        allow_atomic=True,
    )
    held = await stream_spec(bus, stream)
    if held is None:
        await _create(bus, spec, "log stream", "--log-stream")
        logger.info("created stream %s for %s, R%d", stream, list(spec.subjects), bus.replicas)
        return
    _check_stream(held, spec, "log stream", "--log-stream")
    if held.max_age_s or not held.allow_rollup or not held.allow_atomic:
        # An age limit would drop an open handoff's entries that no snapshot holds yet.
        relaxed = msgspec.structs.replace(
            held, max_age_s=None, allow_rollup=True, allow_atomic=True
        )
        await update_stream(bus, relaxed)
        logger.info("stream %s now keeps its entries until rolled up", stream)


async def open_completions(bus: Bus, stream: str, subjects: str, max_age_s: float) -> None:
    """Create (or update) the stream that keeps the last completion of every handoff, so a
    frontend that was away when its `Complete` went out can still read it."""
    await _open_last_of_each(bus, stream, subjects, max_age_s, "completion stream")


async def open_rejections(bus: Bus, stream: str, subjects: str, max_age_s: float) -> None:
    """Create (or update) the stream that keeps the last rejection of every handoff, so a
    frontend that was away when its start was rejected still hears of it. A stream of its own,
    not more subjects of the completion stream: a worker of an earlier version, which checks
    that stream's subjects, would refuse it (`StreamMismatch`) in the middle of an upgrade."""
    await _open_last_of_each(bus, stream, subjects, max_age_s, "rejection stream")


async def _open_last_of_each(
    bus: Bus, stream: str, subjects: str, max_age_s: float, role: str
) -> None:
    spec = StreamSpec(
        name=stream,
        subjects=(subjects,),
        max_msgs_per_subject=1,
        max_age_s=max_age_s,
        replicas=bus.replicas,  # a frontend reads it after a node died, too
    )
    held = await stream_spec(bus, stream)
    if held is None:
        await _create(bus, spec, role, "--done-stream")
        logger.info("created stream %s for %s", stream, subjects)
    else:
        _check_stream(held, spec, role, "--done-stream")
        await update_stream(bus, spec)
