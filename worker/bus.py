"""The worker's side of NATS: a durable JetStream inbox for inputs, core NATS for actions.

Inputs are captured by a JetStream stream with work-queue retention (an input leaves the
stream once the worker acknowledges it, which it does only after the input is committed to the
event log) and consumed through one durable pull consumer with explicit acks.

JetStream redelivers an unacknowledged input only after the ack wait, while newer inputs keep
flowing, so a restart would see inputs out of order (a fact before the outcome it depends on).
Work-queue retention keeps exactly the unacknowledged inputs, so the worker re-creates its
consumer on start and reads them again from the oldest, in stream order. Actions are
published with core NATS: the event log is their outbox, and an action with no outcome is
published again, so a lost action costs a retry interval, never correctness.

Start-up. nats-py's connect loop retries forever when told to reconnect forever (which a worker
that outlives NATS restarts must be), even when the server refuses our credentials or TLS
handshake, and it offers no way to tell those apart from a server that is not up yet. So
`Bus.connect` watches the client's error callback while it connects: a refusal ends the attempt
at once with `BusRefused`, naming the setting to check; a round of failures over every server
retries with backoff. Cancelling `Bus.connect` gives up and leaves nothing open.

One consumer per stream. Two workers on one consumer would split the stream between two logs,
and re-creating the consumer at start would pull inputs from under a running worker. So before
it touches the consumer a worker takes a lease in the JetStream KV bucket `KVHANDOFF_LEASES`:
one key per stream and consumer, holding who the holder is (`LeaseHolder`). The bucket keeps one
revision per key and drops it after `LEASE_TTL_S`; the holder refreshes it well within that by
compare-and-set on the revision it wrote last, so a refresh that finds another revision knows
it lost the lease (`LeaseHeld`). A starting worker that finds the lease held watches it: a
refresh proves the holder alive, and the starting worker refuses (`LeaseHeld`); expiry proves
it gone, and the lease is free. A lease whose holder names this host and this event log belongs
to a dead predecessor, because a worker holds an exclusive lock on its log while it lives; it
is taken over at once, by compare-and-set, instead of after the TTL.

nats-py errors are translated to `BusError` here and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import ssl
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StreamConfig,
)
from nats.js.kv import KeyValue

from worker.config import NatsSettings
from worker.errors import BusError, BusRefused, LeaseHeld

logger = logging.getLogger(__name__)


def connect_options(settings: NatsSettings, name: str) -> dict[str, Any]:
    """Keyword arguments for `nats.connect` from the shared NATS settings."""
    options: dict[str, Any] = {
        "servers": [url.strip() for url in settings.url.split(",")],
        "name": name,
        "max_reconnect_attempts": -1,  # a worker outlives NATS restarts
        "reconnect_time_wait": 0.5,
        # nats-py pings every 2 minutes by default: a connection that died silently (the peer
        # came back at another address) would go unnoticed for minutes. Notice within ~15 s.
        "ping_interval": 5,
        "max_outstanding_pings": 2,
        "connect_timeout": 5,
    }
    if settings.user is not None:
        options["user"] = settings.user
        options["password"] = settings.password
    if settings.token is not None:
        options["token"] = settings.token
    if settings.creds is not None:
        options["user_credentials"] = str(settings.creds)
    if settings.uses_tls:
        context = ssl.create_default_context(
            cafile=None if settings.tls_ca is None else str(settings.tls_ca)
        )
        if settings.tls_cert is not None and settings.tls_key is not None:
            context.load_cert_chain(str(settings.tls_cert), str(settings.tls_key))
        options["tls"] = context
    return options


_CONNECT_BACKOFF_FIRST_S = 0.25
_CONNECT_BACKOFF_MAX_S = 5.0
_CANCEL_AGAIN_S = 0.05
# What nats-server answers, in nats-py's error text, when it refuses the credentials we sent
# (or the absence of any); nats-py raises a plain `Error` for it while connecting.
_AUTH_REFUSALS = ("authorization violation", "authentication expired", "authentication revoked")


def _refusal(exc: BaseException, settings: NatsSettings) -> str | None:
    """Why NATS refused us for good, naming the settings to check; None if a retry may help."""
    if isinstance(exc, ssl.SSLError):  # certificate verification included
        if settings.tls_cert is None and "certificate required" in str(exc).lower():
            return (
                f"the TLS handshake failed ({exc}): the server verifies clients; "
                "set --tls-cert and --tls-key"
            )
        if not settings.uses_tls:
            return (
                f"the TLS handshake failed ({exc}): the server requires TLS; "
                "set --tls-ca to the CA that signed its certificate"
            )
        return (
            f"the TLS handshake failed ({exc}); check --tls-ca (the CA that signed the "
            "server's certificate), --tls-cert/--tls-key (if the server verifies clients) and "
            "the host name in --nats-url"
        )
    text = str(exc).lower()
    if isinstance(exc, nats.errors.AuthorizationError) or any(
        refusal in text for refusal in _AUTH_REFUSALS
    ):
        if settings.user is not None:
            check = "--nats-user/--nats-password"
        elif settings.token is not None:
            check = "--nats-token"
        elif settings.creds is not None:
            check = "--nats-creds"
        else:
            return (
                f"authentication refused ({exc}): the server requires credentials; set "
                "--nats-user/--nats-password, --nats-token or --nats-creds"
            )
        return f"authentication refused ({exc}); check {check}"
    return None


async def _connect_once(settings: NatsSettings, name: str) -> Client:
    """One client's first connection: the client once connected, `BusRefused` if NATS
    refused us, `BusError` once every server in the pool failed in some other way."""
    try:
        options = connect_options(settings, name)
    except (ssl.SSLError, OSError) as exc:
        raise BusRefused(
            f"cannot load the TLS files ({exc}); check --tls-ca, --tls-cert and --tls-key"
        ) from exc
    client = Client()
    failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
    failures = 0
    connected = False

    async def on_error(exc: Exception) -> None:
        nonlocal failures
        if connected:
            logger.warning("NATS: %s", exc)
            return
        failures += 1
        refused = _refusal(exc, settings) is not None
        if not failed.done() and (refused or failures >= len(options["servers"])):
            failed.set_result(exc)

    async def on_disconnect() -> None:
        if connected and not client.is_closed:  # not when we close it ourselves
            logger.warning("disconnected from NATS; reconnecting")

    async def on_reconnect() -> None:
        logger.info("reconnected to NATS at %s", client.connected_url)

    connecting = asyncio.ensure_future(
        client.connect(
            **options,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
    )
    try:
        either: list[asyncio.Future[Any]] = [connecting, failed]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if connecting.done():
            error = connecting.exception()
            if error is None:
                connected = True
                return client
        else:
            error = failed.result()
    finally:
        if not connected:
            # Abandoning the attempt (refused, unreachable, or cancelled by our caller).
            while not connecting.done():
                # Python 3.11's wait_for, which nats-py uses, drops a cancellation that
                # coincides with what it waits for (a TCP connect that just succeeded), and
                # nats-py would then carry on: cancel until it takes.
                connecting.cancel()
                await asyncio.wait([connecting], timeout=_CANCEL_AGAIN_S)
            if not connecting.cancelled():
                connecting.exception()  # retrieved: it is `error`, or the attempt was dropped
            # A failure while closing a client that never connected changes nothing.
            with contextlib.suppress(Exception):
                await client.close()
    reason = _refusal(error, settings)
    if reason is not None:
        raise BusRefused(f"NATS at {settings.url} refused the connection: {reason}") from error
    raise BusError(f"cannot connect to NATS at {settings.url}: {error}") from error


LEASE_BUCKET = "KVHANDOFF_LEASES"
LEASE_TTL_S = 5.0  # a dead worker on another host blocks a successor this long
_LEASE_POLL_S = 0.2  # while watching another worker's lease at start
_LEASE_RETRY_S = 0.5  # after a refresh that failed because NATS did not answer
_LEASE_RELEASE_TIMEOUT_S = 2.0


class LeaseHolder(msgspec.Struct, frozen=True):
    """Who holds a consumer lease: enough for an operator to find that worker, and for a
    successor to recognise its own event log. The lease's value, as JSON."""

    host: str
    pid: int
    db: str  # the event log, absolute
    instance: str  # unique per start, so a worker recognises its own writes
    since_ms: int

    @classmethod
    def this_process(cls, db_path: Path) -> LeaseHolder:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            db=str(db_path.resolve()),
            instance=uuid.uuid4().hex,
            since_ms=time.time_ns() // 1_000_000,
        )

    def succeeds(self, other: LeaseHolder) -> bool:
        """Whether `other` was a predecessor on this event log, and so is dead: a live worker
        keeps its log locked, and we hold that lock."""
        return other.host == self.host and other.db == self.db

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since_ms / 1000))
        return f"pid {self.pid} on {self.host} with log {self.db}, since {since}"


_LEASE_ENCODER = msgspec.json.Encoder()
_LEASE_DECODER = msgspec.json.Decoder(LeaseHolder)


def _lease_holder(value: bytes | None) -> LeaseHolder | None:
    """The holder in a lease's value, or None if it is not one (something else wrote it)."""
    try:
        return _LEASE_DECODER.decode(value or b"")
    except msgspec.DecodeError:
        return None


def _describe(holder: LeaseHolder | None, value: bytes | None) -> str:
    if holder is None:
        return f"an unreadable lease {(value or b'')[:200]!r}"
    return holder.describe()


class Lease:
    """The right to consume one stream through one consumer, until it is released or lost."""

    def __init__(
        self,
        client: Client,
        kv: KeyValue,
        key: str,
        holder: LeaseHolder,
        *,
        revision: int | None,
        ttl_s: float,
    ) -> None:
        self._nc = client
        self._kv = kv
        self._key = key
        self._holder = holder
        self._value = _LEASE_ENCODER.encode(holder)
        self._revision = revision
        self.ttl_s = ttl_s

    async def keep(self) -> None:
        """Refresh the lease every third of its TTL, until cancelled.

        Raises `LeaseHeld` as soon as a refresh finds that another worker holds it. A refresh
        that NATS does not answer is retried; if the lease expired meanwhile, and nobody took
        it, it is created again.
        """
        wait = self.ttl_s / 3
        while True:
            await asyncio.sleep(wait)
            try:
                await self._refresh()
                wait = self.ttl_s / 3
            except (TimeoutError, nats.errors.Error) as exc:
                logger.warning("lease %s: refresh failed, retrying: %s", self._key, exc)
                wait = _LEASE_RETRY_S

    async def _refresh(self) -> None:
        with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
            self._revision = await self._kv.update(self._key, self._value, last=self._revision)
            return
        try:
            entry = await self._kv.get(self._key)
        except nats.js.errors.KeyNotFoundError:
            # It expired while NATS was out of our reach, and nobody took it. If somebody
            # creates it first, this fails and the next refresh finds them.
            self._revision = await self._kv.create(self._key, self._value)
            logger.warning("lease %s had expired; took it again", self._key)
            return
        current = _lease_holder(entry.value)
        if current is not None and current.instance == self._holder.instance:
            self._revision = entry.revision  # our last refresh landed; its answer was lost
            return
        raise LeaseHeld(f"lost the lease {self._key} to {_describe(current, entry.value)}")

    async def release(self) -> None:
        """Give the lease up, if it is still ours, so a successor need not wait for the TTL."""
        problem = "no connection"  # then waiting for NATS would only delay a stop
        if self._nc.is_connected:
            try:
                await asyncio.wait_for(
                    self._kv.delete(self._key, last=self._revision), _LEASE_RELEASE_TIMEOUT_S
                )
                return
            except (TimeoutError, nats.errors.Error) as exc:
                problem = str(exc)
        logger.warning(
            "lease %s not released (%s); it expires in %.0fs", self._key, problem, self.ttl_s
        )


class Inbound:
    """One input message from the stream, with the three ways to settle it."""

    __slots__ = ("_msg", "data", "subject")

    def __init__(self, msg: Msg) -> None:
        self._msg = msg
        self.data = msg.data
        self.subject = msg.subject

    @property
    def deliveries(self) -> int:
        """How many times JetStream has delivered this input, this time included."""
        return int(self._msg.metadata.num_delivered)

    @property
    def stream_seq(self) -> int:
        """The input's position in the stream: the same on every delivery."""
        return int(self._msg.metadata.sequence.stream)

    async def ack(self) -> None:
        await self._settle(self._msg.ack(), "ack")

    async def term(self) -> None:
        """Never redeliver: the input was rejected, and redelivering changes nothing."""
        await self._settle(self._msg.term(), "term")

    async def nak(self, delay_s: float | None = None) -> None:
        """Redeliver, after `delay_s` if given."""
        await self._settle(self._msg.nak(delay=delay_s), "nak")

    async def _settle(self, settling: Awaitable[None], how: str) -> None:
        # An ack during a disconnect fails in nats-py's terms; JetStream redelivers the input
        # after the ack wait, and the log drops it as a duplicate, so it is only a BusError.
        try:
            await settling
        except (nats.errors.Error, OSError) as exc:
            raise BusError(f"{how} of input {self.subject} failed: {exc}") from exc


class Bus:
    def __init__(self, client: Client) -> None:
        self._nc = client
        self._js = client.jetstream()
        self._inbox: Any = None
        self._barrier_subject = client.new_inbox()
        self._barriers: dict[bytes, asyncio.Future[None]] = {}
        self._barrier_count = itertools.count()
        # JetStream acks of durable publishes not yet awaited; `flush` awaits them.
        self._unconfirmed: list[asyncio.Future[Any]] = []

    async def _start(self) -> None:
        await self._nc.subscribe(self._barrier_subject, cb=self._on_barrier)

    async def _on_barrier(self, msg: Msg) -> None:
        waiter = self._barriers.pop(msg.data, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @classmethod
    async def connect(cls, settings: NatsSettings, name: str) -> Bus:
        """Connect, retrying with backoff while no server answers (NATS may start after us).

        Raises `BusRefused` at once if NATS refuses our credentials or TLS, which no retry
        can fix. Cancel the call to give up: the client of the attempt in flight is closed.
        """
        delay = _CONNECT_BACKOFF_FIRST_S
        while True:
            try:
                client = await _connect_once(settings, name)
            except BusRefused:
                raise
            except BusError as exc:
                logger.warning("%s; retrying in %.2gs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, _CONNECT_BACKOFF_MAX_S)
                continue
            bus = cls(client)
            await bus._start()
            return bus

    @property
    def is_connected(self) -> bool:
        return bool(self._nc.is_connected)

    async def acquire_lease(self, stream: str, consumer: str, holder: LeaseHolder) -> Lease:
        """Take the lease on `consumer` of `stream` for `holder`, creating the bucket if absent.

        A lease left by a dead predecessor with this host and this event log is taken over at
        once. Another holder's lease is watched: if it expires (the holder is gone), it is
        taken; if it is refreshed, `LeaseHeld` names the holder, which is alive.
        """
        key = f"{stream}.{consumer}"
        value = _LEASE_ENCODER.encode(holder)
        try:
            kv = await self._lease_bucket()
            ttl_s = (await kv.status()).ttl
            if not ttl_s:
                raise BusError(
                    f"lease bucket {LEASE_BUCKET} has no TTL, so a dead worker's lease would "
                    "never expire; delete the bucket and let the worker create it"
                )
            clock = asyncio.get_running_loop().time
            # A lease that is neither refreshed nor expired after two TTLs is held by no one
            # we can tell apart from a live worker.
            give_up = clock() + 2 * ttl_s
            first_seen: int | None = None
            held_by = "nobody"
            while clock() < give_up:
                with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
                    revision = await kv.create(key, value)
                    return Lease(self._nc, kv, key, holder, revision=revision, ttl_s=ttl_s)
                try:
                    entry = await kv.get(key)
                except nats.js.errors.KeyNotFoundError:
                    continue  # it expired or was released between our two requests
                current = _lease_holder(entry.value)
                held_by = _describe(current, entry.value)
                if current is not None and holder.succeeds(current):
                    with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
                        revision = await kv.update(key, value, last=entry.revision)
                        logger.warning(
                            "took over the lease on %s / %s from %s, which is gone: this "
                            "worker holds its event log now",
                            stream, consumer, held_by,
                        )  # fmt: skip
                        return Lease(self._nc, kv, key, holder, revision=revision, ttl_s=ttl_s)
                elif first_seen is None:
                    first_seen = entry.revision
                    logger.info(
                        "the lease on %s / %s is held by %s; waiting up to %.0fs to see "
                        "whether it expires (the holder is gone) or is refreshed (it is not)",
                        stream, consumer, held_by, ttl_s,
                    )  # fmt: skip
                elif entry.revision != first_seen:
                    raise LeaseHeld(
                        f"stream {stream} / consumer {consumer} is consumed by another worker: "
                        f"{held_by}, which keeps its lease alive; one worker per stream"
                    )
                await asyncio.sleep(_LEASE_POLL_S)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot take the lease on {stream} / {consumer}: {exc}") from exc
        raise LeaseHeld(
            f"stream {stream} / consumer {consumer}: the lease held by {held_by} neither "
            f"expired nor was refreshed in {2 * ttl_s:.0f}s; is the bucket {LEASE_BUCKET} right?"
        )

    async def _lease_bucket(self) -> KeyValue:
        try:
            return await self._js.key_value(LEASE_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            # Workers racing to create it send the same configuration, which JetStream accepts.
            return await self._js.create_key_value(
                KeyValueConfig(
                    bucket=LEASE_BUCKET,
                    description="kvhandoff: which worker consumes each input stream",
                    history=1,
                    ttl=LEASE_TTL_S,
                )
            )

    async def open_inbox(
        self, stream: str, subjects: str, consumer: str, ack_wait_s: float, max_pending: int
    ) -> None:
        """Create the input stream if absent, re-create the durable consumer, and bind to them.

        Re-creating the consumer takes every unacknowledged input from whoever consumes it, so
        call this only while holding the consumer's lease (`acquire_lease`).
        """
        try:
            try:
                await self._js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                await self._js.add_stream(
                    StreamConfig(
                        name=stream,
                        subjects=[subjects],
                        retention=RetentionPolicy.WORK_QUEUE,
                        duplicate_window=120.0,
                    )
                )
                logger.info("created stream %s for %s", stream, subjects)
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self._js.delete_consumer(stream, consumer)
            self._inbox = await self._js.pull_subscribe(
                subjects,
                durable=consumer,
                stream=stream,
                config=ConsumerConfig(
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    ack_wait=ack_wait_s,
                    max_ack_pending=max_pending,
                    max_deliver=-1,
                ),
            )
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot open stream {stream} / consumer {consumer}: {exc}") from exc

    async def open_completions(self, stream: str, subjects: str, max_age_s: float) -> None:
        """Create (or update) the stream that keeps the last completion of every handoff, so a
        frontend that was away when its `Complete` went out can still read it."""
        config = StreamConfig(
            name=stream,
            subjects=[subjects],
            retention=RetentionPolicy.LIMITS,
            max_msgs_per_subject=1,
            max_age=max_age_s,
        )
        try:
            try:
                await self._js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                await self._js.add_stream(config)
                logger.info("created stream %s for %s", stream, subjects)
            else:
                await self._js.update_stream(config)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot open completion stream {stream}: {exc}") from exc

    async def fetch(self, max_messages: int, timeout_s: float) -> list[Inbound]:
        """Whatever inputs are ready, up to `max_messages`; waits up to `timeout_s` for one."""
        try:
            messages = await self._inbox.fetch(max_messages, timeout=timeout_s)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        except nats.errors.Error as exc:
            raise BusError(f"fetch failed: {exc}") from exc
        return [Inbound(m) for m in messages]

    async def publish(self, subject: str, payload: bytes) -> None:
        """Core NATS publish: buffered, in order with everything else on this connection."""
        try:
            await self._nc.publish(subject, payload)
        except nats.errors.Error as exc:
            raise BusError(f"publish to {subject} failed: {exc}") from exc

    async def publish_durable(self, subject: str, payload: bytes) -> None:
        """JetStream publish: returns once the stream stored the message."""
        try:
            await self._js.publish(subject, payload, timeout=5.0)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"durable publish to {subject} failed: {exc}") from exc

    async def publish_stored(self, subject: str, payload: bytes) -> None:
        """JetStream publish whose ack the next `flush` awaits: many can be in flight at once."""
        try:
            self._unconfirmed.append(await self._js.publish_async(subject, payload))
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"durable publish to {subject} failed: {exc}") from exc

    async def flush(self) -> None:
        """Return once the server has everything published so far, and the streams have
        stored every `publish_stored` message.

        nats-py's own flush() writes its PING straight to the socket, ahead of commands still
        in its write buffer, so its PONG proves nothing about them. A message to our own inbox
        travels behind them: when it comes back, everything before it reached the server.
        """
        token = str(next(self._barrier_count)).encode()
        waiter = self._barriers[token] = asyncio.get_running_loop().create_future()
        unconfirmed, self._unconfirmed = self._unconfirmed, []
        try:
            await self._nc.publish(self._barrier_subject, token)
            await asyncio.wait_for(waiter, timeout=5)
            if unconfirmed:
                await asyncio.wait_for(asyncio.gather(*unconfirmed), timeout=5)
        except (TimeoutError, nats.errors.Error) as exc:
            for future in unconfirmed:
                future.cancel()
            raise BusError(f"flush failed: {exc}") from exc
        finally:
            self._barriers.pop(token, None)

    async def close(self) -> None:
        """Flush what was published (actions, acks), then disconnect."""
        # Without a connection the flush could only time out, and delay a stop for nothing:
        # what it would flush is redelivered (inputs) or republished from the log (actions).
        if self._nc.is_connected:
            try:
                await self.flush()
            except BusError as exc:
                logger.warning("NATS flush on close failed: %s", exc)
        await self._nc.close()
