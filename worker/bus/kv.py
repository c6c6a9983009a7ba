"""Key-value buckets: JetStream streams of one message per key.

Two kinds. A `Bucket` (`open_bucket`) is nats-py's KV, one revision per key dropped after the
bucket's TTL without a refresh, read from the stream's leader where `direct` is off (a replica
may answer from before the latest write): what worker.tier.members keeps its announcements in.
Its keys are listed from the stream's own count per subject, answered by its leader: nats-py's
`keys()` lists them through a consumer made for the purpose, which can come up empty when a
refresh replaces a key's message just as it is made.

An expiring bucket (`open_expiring_bucket`) gives each message its own TTL (`Nats-TTL`,
nats-server 2.11+, `put_expiring`) and leaves a delete marker when one expires, so that an
expiry is a message that a watch (`watch_bucket`) receives: the engines' leases (client.lease,
worker.tier.leases).

A bucket that another process just made in a cluster answers on every node only once its
interest spread: `open_bucket` and `Bucket.put` ask again for `give_up_after_s` while no stream
answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StreamConfig,
)
from nats.js.kv import KeyValue

from kvhandoff.worker.ambient import new_id
from kvhandoff.worker.bus.connection import Bus, Subscription
from kvhandoff.worker.bus.failures import RETRYABLE, why
from kvhandoff.worker.errors import BusError
from kvhandoff.worker.stoppable import cancel_until_done

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_ANSWER_POLL_S = 0.1
_WATCH_CATCH_UP_S = 5.0
_RESUME_RETRY_S = 0.5  # between attempts to resume a watch after a reconnect
# "stream name already in use": another process created the stream just now.
_STREAM_NAME_IN_USE = 10058


async def _until_answered(give_up_after_s: float, attempt: Callable[[], Awaitable[_T]]) -> _T:
    """`attempt()`, made again while no stream answers, until `give_up_after_s` passed."""
    clock = asyncio.get_running_loop().time
    give_up = clock() + give_up_after_s
    while True:
        try:
            return await attempt()
        except (*RETRYABLE, nats.js.errors.ServiceUnavailableError):
            if clock() >= give_up:
                raise
        await asyncio.sleep(_ANSWER_POLL_S)


class Bucket:
    """A KV bucket opened by `open_bucket`; every failure is a `BusError`."""

    def __init__(self, bus: Bus, kv: KeyValue, name: str) -> None:
        self._bus = bus
        self._kv = kv
        self.name = name

    async def ttl_s(self) -> float | None:
        """How long a key lives without a refresh; None if for ever."""
        try:
            return (await self._kv.status()).ttl or None
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot read the status of bucket {self.name}: {why(exc)}") from exc

    async def put(self, key: str, value: bytes, *, give_up_after_s: float = 0.0) -> None:
        try:
            await _until_answered(give_up_after_s, lambda: self._kv.put(key, value))
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot put {key} in bucket {self.name}: {why(exc)}") from exc

    async def get(self, key: str) -> bytes | None:
        """The value of `key`; None if it has none (expired, deleted or never put)."""
        try:
            entry = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot get {key} from bucket {self.name}: {why(exc)}") from exc
        return entry.value or b""

    async def delete(self, key: str, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._kv.delete(key), timeout_s)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot delete {key} from bucket {self.name}: {why(exc)}") from exc

    async def keys(self, pattern: str) -> list[str]:
        """The keys that match `pattern` (`*` and `>` as in subjects) and hold a value now, as
        the stream's leader counts them (see the module docstring)."""
        prefix = f"$KV.{self.name}."
        try:
            info = await self._bus._js.stream_info(
                f"KV_{self.name}", subjects_filter=f"{prefix}{pattern}"
            )
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot list the keys of bucket {self.name}: {why(exc)}") from exc
        return [subject.removeprefix(prefix) for subject in info.state.subjects or {}]


async def open_bucket(
    bus: Bus,
    name: str,
    *,
    description: str,
    history: int,
    ttl_s: float,
    direct: bool,
    give_up_after_s: float = 0.0,
) -> Bucket:
    """The bucket `name`, created with these settings (R3 in a cluster) if absent."""

    async def attempt() -> KeyValue:
        try:
            return await bus._js.key_value(name)
        except nats.js.errors.BucketNotFoundError:
            return await bus._js.create_key_value(
                KeyValueConfig(
                    bucket=name,
                    description=description,
                    history=history,
                    ttl=ttl_s,
                    replicas=bus.replicas,
                    direct=direct,
                )
            )

    try:
        return Bucket(bus, await _until_answered(give_up_after_s, attempt), name)
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot open bucket {name}: {why(exc)}") from exc


async def open_expiring_bucket(bus: Bus, bucket: str, marker_ttl_s: float) -> None:
    """Create the stream of an expiring bucket if absent: a KV bucket (`$KV.<bucket>.<key>`, one
    message a key) whose messages carry their own TTL (`Nats-TTL`, nats-server 2.11+), and
    which leaves a delete marker when one expires, so an expiry is a message that a watch
    receives. The marker itself lives `marker_ttl_s`."""
    stream = f"KV_{bucket}"
    config = StreamConfig(
        name=stream,
        subjects=[f"$KV.{bucket}.>"],
        retention=RetentionPolicy.LIMITS,
        max_msgs_per_subject=1,
        allow_msg_ttl=True,
        subject_delete_marker_ttl=marker_ttl_s,
        allow_rollup_hdrs=True,
        num_replicas=bus.replicas,
    )
    try:
        try:
            await bus._js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            await bus._js.add_stream(config)
            logger.info("created bucket %s, R%d", bucket, bus.replicas)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != _STREAM_NAME_IN_USE:  # another process created it just now
            raise BusError(f"cannot open bucket {bucket}: {why(exc)}") from exc
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot open bucket {bucket}: {why(exc)}") from exc


async def put_expiring(
    bus: Bus, bucket: str, key: str, value: bytes, ttl_s: float, *, give_up_after_s: float
) -> None:
    """Store `value` under `key` for `ttl_s` (whole milliseconds); `BusError` if it could not
    be stored within `give_up_after_s`."""
    headers = {"Nats-Msg-Id": new_id(), "Nats-TTL": f"{round(ttl_s * 1000)}ms"}
    await bus._store(
        f"$KV.{bucket}.{key}", value, headers, give_up_after_s, f"{key} in bucket {bucket}"
    )


class Watch(Subscription):
    """A watch of a bucket (`watch_bucket`), until `unsubscribe`.

    Its messages come through nats-py's ordered consumer, pushed to this connection: those in
    flight when the connection is lost are lost with it, and nats-py notices the gap only at
    the consumer's next message or its next idle heartbeat (5 s on). Meanwhile a delete
    marker, an engine's lease gone, would be unseen. So on every reconnect the watch
    subscribes again from after the last message it delivered, and drops the consumer before.
    It does so itself rather than through nats-py's `reset_ordered_consumer`, which makes the
    new consumer in a task of its own and only reports a failure (JetStream electing a leader,
    a node down) to the error callback: the watch would then be dead until two heartbeats
    were missed, 10 to 20 s, while a new lease went unseen and the tier answered for a live
    engine (seeds 157 and 283 of `kvhandoff sim`). Here each attempt that fails is made again
    until one succeeds; a message that two consumers deliver is delivered once.
    """

    def __init__(self, bus: Bus, cursor: _Cursor, subscription: NatsSubscription) -> None:
        super().__init__(subscription, cursor.subject)
        self._bus = bus
        self._cursor = cursor
        self._watching = True
        self._resuming: asyncio.Task[None] | None = None
        bus.on_reconnect(self._resume)

    def _resume(self) -> None:
        if not self._watching:
            return
        if self._resuming is not None:  # made on the connection just lost: start again
            self._resuming.cancel()
        self._resuming = asyncio.create_task(self._subscribe_again())

    async def _subscribe_again(self) -> None:
        while True:
            try:
                fresh = await self._cursor.subscribe(self._bus, self._cursor.last_seq + 1)
                break
            except (TimeoutError, nats.errors.Error) as exc:
                logger.warning(
                    "watch of %s: cannot resume after a reconnect yet: %s", self.subject, why(exc)
                )
            await asyncio.sleep(_RESUME_RETRY_S)
        before, self._subscription = self._subscription, fresh
        try:
            await before.unsubscribe()
        except nats.errors.Error as exc:  # the server drops an ephemeral consumer left idle
            logger.info("watch of %s: the consumer before: %s", self.subject, why(exc))

    async def unsubscribe(self) -> None:
        self._watching = False
        if self._resuming is not None:
            await cancel_until_done(self._resuming)
        await super().unsubscribe()


class _Cursor:
    """Where a watch is in its bucket's stream: what it delivered last, by stream sequence."""

    def __init__(self, bucket: str, on_entry: Callable[[str, bytes | None], None]) -> None:
        self.stream = f"KV_{bucket}"
        self.prefix = f"$KV.{bucket}."
        self.subject = f"{self.prefix}>"
        self.last_seq = 0
        self.caught_up = asyncio.get_running_loop().create_future()
        self._on_entry = on_entry

    async def subscribe(self, bus: Bus, from_seq: int | None) -> NatsSubscription:
        """An ordered consumer from `from_seq` on, or from the last message of every key."""
        if from_seq is None:
            policy, config = DeliverPolicy.LAST_PER_SUBJECT, None
        else:
            policy, config = DeliverPolicy.BY_START_SEQUENCE, ConsumerConfig(opt_start_seq=from_seq)
        return await bus._js.subscribe(
            self.subject,
            stream=self.stream,
            cb=self.deliver,
            ordered_consumer=True,
            deliver_policy=policy,
            config=config,
        )

    async def deliver(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.last_seq:  # delivered by the consumer before, or by this one's reset
            return
        self.last_seq = seq
        headers = msg.headers or {}
        expired = "Nats-Marker-Reason" in headers or headers.get("KV-Operation") in {
            "DEL",
            "PURGE",
        }
        self._on_entry(msg.subject.removeprefix(self.prefix), None if expired else msg.data)
        if msg.metadata.num_pending == 0 and not self.caught_up.done():
            self.caught_up.set_result(None)


async def watch_bucket(
    bus: Bus, bucket: str, on_entry: Callable[[str, bytes | None], None]
) -> Watch:
    """Call `on_entry(key, value)` for the last message of every key of `bucket`,
    then for every later one, in stream order, a reconnect notwithstanding (`Watch`); `value`
    is None for a delete marker (the key expired or was deleted). Returns once every key's
    current message was delivered."""
    cursor = _Cursor(bucket, on_entry)
    try:
        info = await bus._js.stream_info(cursor.stream)
        subscription = await cursor.subscribe(bus, None)
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot watch bucket {bucket}: {why(exc)}") from exc
    if info.state.messages:
        try:
            await asyncio.wait_for(cursor.caught_up, _WATCH_CATCH_UP_S)
        except TimeoutError:
            # The messages counted expired meanwhile, or arrive late: the watch goes on.
            logger.warning("bucket %s: not read to its end yet", bucket)
    return Watch(bus, cursor, subscription)
