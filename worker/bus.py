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

nats-py errors are translated to `BusError` here and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
from collections.abc import Awaitable
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StreamConfig

from worker.config import NatsSettings
from worker.errors import BusError

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
        async def on_disconnect() -> None:
            logger.warning("disconnected from NATS; reconnecting")

        async def on_reconnect() -> None:
            logger.info("reconnected to NATS at %s", client.connected_url)

        async def on_error(exc: Exception) -> None:
            logger.warning("NATS: %s", exc)

        try:
            client = await nats.connect(
                **connect_options(settings, name),
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                error_cb=on_error,
            )
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            raise BusError(f"cannot connect to NATS at {settings.url}: {exc}") from exc
        bus = cls(client)
        await bus._start()
        return bus

    @property
    def is_connected(self) -> bool:
        return bool(self._nc.is_connected)

    async def open_inbox(
        self, stream: str, subjects: str, consumer: str, ack_wait_s: float, max_pending: int
    ) -> None:
        """Create the input stream and the durable consumer if absent, and bind to them."""
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
        try:
            await self.flush()
        except BusError as exc:
            logger.warning("NATS flush on close failed: %s", exc)
        await self._nc.close()
