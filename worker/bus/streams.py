"""JetStream administration: streams and consumers, made, checked, read and removed.

Generic calls on a `Bus`, for whatever streams their caller keeps (the tier's rules are in
worker.tier.streams). A stream is described by a `StreamSpec`, the few settings kvhandoff
sets, so that callers need no nats-py type: `stream_spec` reads one, `create_stream` makes one
(False if another stream captures its subjects: `stream_capturing` names it), `update_stream`
changes the settings a spec names and keeps the others.

Consumers. `create_pull_consumer` makes a durable pull consumer with explicit acks through the
raw `$JS.API.CONSUMER.CREATE` request (nats-py has no priority groups), optionally with one
priority group pinned to one client (ADR-42; see worker.bus.pull for how a Pull speaks it);
`unpin` releases a group's pin, `pinned` tells whether a client holds it, `pin_of` whose it is.

Reading. `last_message`/`last_sequence` read a subject's last message; `read_subject` reads
every message of a subject through an ephemeral consumer, again until it reaches the last one
the stream's leader has (a replica may lag); `unacknowledged` lists what a consumer delivered
and never had acknowledged, in stream order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StreamConfig,
    SubjectTransform,
)

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.failures import api_error, why
from kvhandoff.worker.bus.pull import Pull
from kvhandoff.worker.errors import BusError

_JS_INFO = "$JS.API.INFO"
_JS_API_TIMEOUT_S = 5.0
_JS_READY_POLL_S = 0.1
_READ_BATCH = 256
_STALE_READ_GIVE_UP_S = 30.0  # how long a catch-up waits for a lagging replica to catch up
_READER_IDLE_S = 30.0  # a reader's consumer that its reader left goes away after this
_S_TO_NS = 1_000_000_000
# "subjects overlap with an existing stream": another stream captures what we would.
_SUBJECTS_OVERLAP = 10065


class StreamSpec(msgspec.Struct, frozen=True):
    """The settings of a stream that kvhandoff sets; the server's defaults for the rest.
    Defaults are nats-py's, so a spec builds the very request nats-py would."""

    name: str
    subjects: tuple[str, ...]
    retention: str = RetentionPolicy.LIMITS.value  # "limits", "workqueue" or "interest"
    # (source, destination): the subject transform applied as messages are stored.
    transform: tuple[str, str] | None = None
    max_msgs_per_subject: int = -1
    max_age_s: float | None = None
    duplicate_window_s: float = 0
    replicas: int | None = None  # None: the server's default (one)
    metadata: dict[str, str] | None = None
    allow_rollup: bool = False  # `Nats-Rollup` headers
    allow_atomic: bool | None = None  # atomic batches (ADR-50)
    allow_msg_ttl: bool | None = None  # `Nats-TTL` headers
    delete_marker_ttl_s: float | None = None  # markers left when a message's TTL expires

    def captures(self) -> str:
        """What the stream stores, for a message to a person."""
        return f"{', '.join(self.subjects) or 'nothing'} ({self.retention} retention)"


def _config_fields(spec: StreamSpec) -> dict[str, Any]:
    transform = None if spec.transform is None else SubjectTransform(*spec.transform)
    return {
        "name": spec.name,
        "subjects": list(spec.subjects),
        "retention": RetentionPolicy(spec.retention),
        "subject_transform": transform,
        "max_msgs_per_subject": spec.max_msgs_per_subject,
        "max_age": spec.max_age_s,
        "duplicate_window": spec.duplicate_window_s,
        "num_replicas": spec.replicas,
        "metadata": spec.metadata,
        "allow_rollup_hdrs": spec.allow_rollup,
        "allow_atomic": spec.allow_atomic,
        "allow_msg_ttl": spec.allow_msg_ttl,
        "subject_delete_marker_ttl": spec.delete_marker_ttl_s,
    }


def _spec_of(config: StreamConfig) -> StreamSpec:
    transform = config.subject_transform
    return StreamSpec(
        name=config.name or "",
        subjects=tuple(config.subjects or ()),
        # nats-py leaves a stream info's retention as the server's string.
        retention=RetentionPolicy(config.retention or RetentionPolicy.LIMITS).value,
        transform=None if transform is None else (transform.src, transform.dest),
        max_msgs_per_subject=config.max_msgs_per_subject,
        max_age_s=config.max_age or None,
        duplicate_window_s=config.duplicate_window or 0,
        replicas=config.num_replicas,
        metadata=config.metadata,
        allow_rollup=bool(config.allow_rollup_hdrs),
        allow_atomic=config.allow_atomic,
        allow_msg_ttl=config.allow_msg_ttl,
        delete_marker_ttl_s=config.subject_delete_marker_ttl,
    )


async def stream_spec(bus: Bus, stream: str) -> StreamSpec | None:
    """The settings of `stream`, or None if there is no such stream."""
    try:
        info = await bus._js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return None
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot read stream {stream}: {why(exc)}") from exc
    return _spec_of(info.config)


async def create_stream(bus: Bus, spec: StreamSpec) -> bool:
    """Create the stream; False if another stream captures any of its subjects (then
    `stream_capturing` names it) and nothing was created."""
    try:
        await bus._js.add_stream(StreamConfig(**_config_fields(spec)))
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code == _SUBJECTS_OVERLAP:
            return False
        raise BusError(f"cannot create stream {spec.name}: {why(exc)}") from exc
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot create stream {spec.name}: {why(exc)}") from exc
    return True


async def stream_capturing(bus: Bus, subject: str) -> str | None:
    """The name of the stream that captures `subject`, or None if none does."""
    try:
        return await bus._js.find_stream_name_by_subject(subject)
    except nats.js.errors.NotFoundError:
        return None
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot find the stream of {subject}: {why(exc)}") from exc


async def update_stream(bus: Bus, spec: StreamSpec) -> None:
    """Give the stream the settings `spec` names (a None among them clears it); the server
    keeps those it does not name as they are."""
    try:
        info = await bus._js.stream_info(spec.name)
        await bus._js.update_stream(dataclasses.replace(info.config, **_config_fields(spec)))
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot update stream {spec.name}: {why(exc)}") from exc


async def create_pull_consumer(
    bus: Bus,
    stream: str,
    name: str,
    *,
    filter_subject: str,
    ack_wait_s: float,
    max_pending: int,
    group: str | None = None,
    priority_timeout_s: float = 0,
) -> None:
    """Create (or keep, if it exists with this config) the durable pull consumer `name`: every
    message from the start, explicit acks, redelivered without limit after `ack_wait_s`, at
    most `max_pending` unacknowledged, of the stream's replicas. `filter_subject` "" takes
    every subject. With `group`, its one priority group, pinned to one client until
    `priority_timeout_s` passes without a pull from it. Pull it with `Pull(..., group=group)`."""
    config: dict[str, Any] = {
        "name": name,
        "durable_name": name,
        "filter_subject": filter_subject,
        "ack_policy": "explicit",
        "deliver_policy": "all",
        "ack_wait": int(ack_wait_s * _S_TO_NS),
        "max_ack_pending": max_pending,
        "max_deliver": -1,
        "num_replicas": 0,  # the stream's
    }
    if group is not None:
        config |= {
            "priority_groups": [group],
            "priority_policy": "pinned_client",
            "priority_timeout": int(priority_timeout_s * _S_TO_NS),
        }
    await js_api(
        bus,
        f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
        {"stream_name": stream, "config": config},
        f"cannot create consumer {name} on {stream}",
    )


async def wait_jetstream(bus: Bus, timeout_s: float) -> None:
    """Return once JetStream answers `$JS.API.INFO` (in a cluster: once its meta group
    has a leader); `BusError` with its last answer after `timeout_s`."""
    clock = asyncio.get_running_loop().time
    give_up = clock() + timeout_s
    last = "nothing"
    while True:
        try:
            reply = await bus._nc.request(_JS_INFO, b"", timeout=_JS_API_TIMEOUT_S)
            answer = msgspec.json.decode(reply.data)
            if isinstance(answer, dict) and "error" not in answer:
                return
            last = reply.data[:200].decode(errors="replace")
        except (TimeoutError, nats.errors.Error, msgspec.DecodeError) as exc:
            last = why(exc)
        if clock() > give_up:
            raise BusError(f"JetStream did not answer within {timeout_s:g}s: {last}")
        await asyncio.sleep(_JS_READY_POLL_S)


async def delete_stream(bus: Bus, stream: str) -> None:
    try:
        await bus._js.delete_stream(stream)
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot delete stream {stream}: {why(exc)}") from exc


async def capture_unless_captured(bus: Bus, stream: str, subjects: str, max_age_s: float) -> bool:
    """Create `stream` to store `subjects` unless a stream already does (a worker's input
    stream, say); True if it created one. `kvhandoff engine-check` uses it so that an
    engine's JetStream publishes are stored, and so answered, without a worker."""
    return await create_stream(
        bus, StreamSpec(name=stream, subjects=(subjects,), max_age_s=max_age_s)
    )


async def unpin(bus: Bus, stream: str, consumer: str, group: str) -> None:
    """Release the pin of `group` on `consumer`, so the next puller is pinned at once
    instead of after the priority timeout (a clean hand-over). Whoever holds it: the server
    takes no pin id (ADR-42), so a caller that means to release its own pin reads whose it is
    first (`pin_of`)."""
    await js_api(
        bus,
        f"$JS.API.CONSUMER.UNPIN.{stream}.{consumer}",
        {"group": group},
        f"cannot unpin group {group!r} of {stream} / {consumer}",
    )


async def pinned(bus: Bus, stream: str, consumer: str, group: str) -> bool:
    """Whether a client holds the pin of `group` on `consumer` now (its consumer info names
    one). The server pins a client only when it delivers to it: a consumer with nothing to
    deliver has no pinned client, whoever pulls it."""
    return await pin_of(bus, stream, consumer, group) is not None


async def pin_of(bus: Bus, stream: str, consumer: str, group: str) -> str | None:
    """The pin id of the client that holds the pin of `group` on `consumer` now, as its
    consumer info names it; None if nobody holds it."""
    info = await js_api(
        bus,
        f"$JS.API.CONSUMER.INFO.{stream}.{consumer}",
        {},
        f"cannot read the pin of group {group!r} of {stream} / {consumer}",
    )
    for g in info.get("priority_groups") or []:
        if g.get("group") == group and g.get("pinned_client_id"):
            return str(g["pinned_client_id"])
    return None


async def ack_floor(bus: Bus, stream: str, consumer: str) -> int:
    """The stream sequence at and below which `consumer` has every message acknowledged:
    it never delivers those again."""
    try:
        info = await bus._js.consumer_info(stream, consumer)
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot read the ack floor of {stream} / {consumer}: {why(exc)}") from exc
    return info.ack_floor.stream_seq if info.ack_floor is not None else 0


async def unacknowledged(
    bus: Bus, stream: str, consumer: str, held: Callable[[], Mapping[int, str]] | None = None
) -> list[tuple[int, str]]:
    """The messages `consumer` delivered and never had acknowledged, as (stream sequence,
    subject), in stream order: what a new owner must apply before newer inputs of the same
    subjects. Between the consumer's ack floor and the last it delivered, one message get
    per message (a work-queue stream allows no second consumer on the same subjects), so
    at most `max_ack_pending` of them.

    `held`, if given, tells what the caller holds delivered and unacknowledged (stream
    sequence: subject), and is asked again once the walk passes the last of it (more may
    have come meanwhile): those are not read again. A new owner's first batch over a
    backlog holds nearly all of what it would otherwise read, one round trip each."""
    try:
        info = await bus._js.consumer_info(stream, consumer)
        filter_subject = info.config.filter_subject or ">"  # unfiltered: every subject
        floor, top = info.ack_floor.stream_seq, info.delivered.stream_seq
        in_hand: Mapping[int, str] = {} if held is None else held()
        last_held = max(in_hand, default=0)
        found: list[tuple[int, str]] = []
        seq = floor + 1
        while seq <= top:
            if seq > last_held and held is not None:
                in_hand = held()
                last_held = max(in_hand, default=0)
            if (subject := in_hand.get(seq)) is not None:
                found.append((seq, subject))
                seq += 1
                continue
            try:
                message = await bus._js.get_msg(stream, seq, subject=filter_subject, next=True)
            except nats.js.errors.NotFoundError:
                break  # none left from seq on
            if message.seq is None or message.subject is None or message.seq > top:
                break
            found.append((message.seq, message.subject))
            seq = message.seq + 1
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(
            f"cannot read what {stream} / {consumer} left unacknowledged: {why(exc)}"
        ) from exc
    return found


async def js_api(bus: Bus, subject: str, request: dict[str, Any], what: str) -> dict[str, Any]:
    """A raw JetStream API request: its answer, or `BusError` naming `what` failed."""
    try:
        reply = await bus._nc.request(
            subject, msgspec.json.encode(request), timeout=_JS_API_TIMEOUT_S
        )
        answer = msgspec.json.decode(reply.data)
    except (TimeoutError, nats.errors.Error, msgspec.DecodeError) as exc:
        raise BusError(f"{what}: {why(exc)}") from exc
    if not isinstance(answer, dict):
        raise BusError(f"{what}: JetStream answered {reply.data[:200]!r}")
    error = answer.get("error")
    if error is not None:
        refusal = api_error(error)
        raise BusError(f"{what}: {why(refusal)}") from refusal
    return answer


async def last_sequence(bus: Bus, stream: str, subject: str) -> int:
    """The stream sequence of the last message on `subject`; 0 if it has none."""
    try:
        message = await bus._js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        return 0
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot read the last message on {subject}: {why(exc)}") from exc
    seq = message.seq
    if seq is None:
        raise BusError(f"the last message on {subject} came without its sequence")
    return seq


async def read_subject(bus: Bus, stream: str, subject: str) -> list[tuple[int, bytes]]:
    """Every message stored on `subject`, as (stream sequence, payload), in order: what a
    new owner reads to catch up. Through an ephemeral consumer (in memory, one replica,
    gone once read) pulled with `no_wait`, so it returns once it has what was stored when
    it asked; what is appended meanwhile is left to the caller's compare-and-set. A cluster
    may place that consumer on a replica that lags the leader (a node that restarted
    catches up for seconds), so the read is made again until it reaches the subject's last
    message as the leader has it: an owner that claimed from a stale read would fence
    itself on its own last appends."""
    last = await last_sequence(bus, stream, subject)
    clock = asyncio.get_running_loop().time
    give_up = clock() + _STALE_READ_GIVE_UP_S
    while True:
        found = await _read_subject_once(bus, stream, subject)
        read = found[-1][0] if found else 0
        if read >= last:
            return found
        if clock() > give_up:
            raise BusError(
                f"cannot read {subject} of {stream} up to its last message {last}: the "
                f"replica read holds up to {read} after {_STALE_READ_GIVE_UP_S:g}s"
            )
        await asyncio.sleep(_JS_READY_POLL_S)


async def _read_subject_once(bus: Bus, stream: str, subject: str) -> list[tuple[int, bytes]]:
    config = ConsumerConfig(
        filter_subject=subject,
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL,
        inactive_threshold=_READER_IDLE_S,
        mem_storage=True,
        num_replicas=1,
    )
    try:
        info = await bus._js.add_consumer(stream, config)
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot read {subject} of {stream}: {why(exc)}") from exc
    found: list[tuple[int, bytes]] = []
    clock = asyncio.get_running_loop().time
    give_up = clock() + _JS_API_TIMEOUT_S
    try:
        async with Pull(bus, stream, info.name, max_ahead=_READ_BATCH, no_wait=True) as reader:
            while True:
                try:
                    batch = await reader.fetch(_READ_BATCH, timeout_s=_JS_API_TIMEOUT_S)
                except BusError:
                    # In a cluster the new consumer may not be known to our node yet (503
                    # no responders): nothing was read, so asking again changes nothing.
                    if found or clock() > give_up:
                        raise
                    await asyncio.sleep(_JS_READY_POLL_S)
                    continue
                if not batch:
                    break
                found += [(inbound.stream_seq, inbound.data) for inbound in batch]
    finally:
        with contextlib.suppress(TimeoutError, nats.errors.Error):
            await bus._js.delete_consumer(stream, info.name)  # else it idles away
    return found


async def last_message(bus: Bus, stream: str, subject: str) -> bytes | None:
    """The last message `stream` keeps on `subject`, or None if it keeps none there (or
    there is no such stream yet)."""
    try:
        message = await bus._js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        return None
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"reading the last message on {subject} of {stream}: {why(exc)}") from exc
    return message.data or b""
