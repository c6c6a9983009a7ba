"""The connection to NATS: every process of kvhandoff reaches NATS through a `Bus`.

Nothing outside `worker.bus` imports nats-py (tests/test_layering.py checks it), so connecting,
the publish barrier, durable publishing and pulling from JetStream exist once, and every
nats-py error is translated to `BusError` inside this package and nowhere else (the words it
shares: worker.bus.failures), `Inbound.ack` and `nak` included. The worker consumes its
input stream and publishes actions; the client library (`client/`: engines and frontends, and
through it the mock engines and the load generator), the demo and the benchmarks subscribe,
publish, read the completion stream and gather reports with the same `Bus`.

Connecting. nats-py's connect loop retries forever when told to reconnect forever (which every
long-lived process here must, to outlive NATS restarts), even when the server refuses our
credentials or TLS handshake, and it offers no way to tell those apart from a server that is not
up yet. So `Bus.connect` watches the client's error callback while it connects: a refusal ends
the attempt at once with `BusRefused`, naming the setting to check (the commands exit 2); a
round of failures over every server retries with backoff. Cancelling `Bus.connect` gives up and
leaves nothing open; `Bus.connect_unless` gives up when a stop event (a signal) is set.

Core NATS. `publish` (worker.bus.publish) is buffered and in order; `subscribe` calls a handler
with each `Message` in order; `gather` publishes a request and collects every reply until they
stop coming. A reconnect resubscribes (nats-py does), resets every Pull's open requests, fails
the stored publishes still awaited, and then calls the `on_reconnect` listeners.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from kvhandoff.worker.bus.failures import STATUS, why
from kvhandoff.worker.bus.publish import Publishing
from kvhandoff.worker.bus.pull import Deliveries
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.errors import BusError, BusRefused
from kvhandoff.worker.stoppable import cancel_until_done, unless_stopped

logger = logging.getLogger(__name__)


def connect_options(settings: NatsSettings, name: str) -> dict[str, Any]:
    """Keyword arguments for nats-py's `Client.connect` from the shared NATS settings."""
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
# What nats-server answers, in nats-py's error text, when it refuses the credentials we sent
# (or the absence of any); nats-py raises a plain `Error` for it while connecting.
_AUTH_REFUSALS = ("authorization violation", "authentication expired", "authentication revoked")
_CLOSED_AT_TLS = (BrokenPipeError, ConnectionResetError, ssl.SSLEOFError)


def _refusal(exc: BaseException, settings: NatsSettings) -> str | None:
    """Why NATS refused us for good, naming the settings to check; None if a retry may help."""
    if settings.uses_tls and settings.tls_cert is None and isinstance(exc, _CLOSED_AT_TLS):
        # A server that verifies clients ends the TLS 1.3 handshake after the client thinks it
        # done; depending on timing we see its alert, or only the pipe it closed.
        return (
            f"the connection closed as TLS began ({exc}): the server verifies clients; "
            "set --tls-cert and --tls-key"
        )
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


async def _connect_once(
    settings: NatsSettings, name: str, reconnected: Callable[[], None]
) -> Client:
    """One client's first connection: the client once connected, `BusRefused` if NATS
    refused us, `BusError` once every server in the pool failed in some other way.
    `reconnected` is called after every reconnect."""
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
        reconnected()

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
            # nats-py would carry on with a connect that succeeded as it was cancelled.
            await cancel_until_done(connecting)
            if not connecting.cancelled():
                connecting.exception()  # retrieved: it is `error`, or the attempt was dropped
            # A failure while closing a client that never connected changes nothing.
            with contextlib.suppress(Exception):
                await client.close()
    reason = _refusal(error, settings)
    if reason is not None:
        raise BusRefused(f"NATS at {settings.url} refused the connection: {reason}") from error
    raise BusError(f"cannot connect to NATS at {settings.url}: {error}") from error


class Message:
    """A core NATS message, as a subscriber's handler gets it."""

    __slots__ = ("data", "reply", "subject")

    def __init__(self, subject: str, data: bytes, reply: str) -> None:
        self.subject = subject
        self.data = data
        self.reply = reply  # "" when the sender expects no answer


Handler = Callable[[Message], Awaitable[None]]


class Subscription:
    """A subscription made by `Bus.subscribe`, until `unsubscribe`."""

    def __init__(self, subscription: NatsSubscription, subject: str) -> None:
        self._subscription = subscription
        self.subject = subject

    async def unsubscribe(self) -> None:
        try:
            await self._subscription.unsubscribe()
        except nats.errors.Error as exc:
            raise BusError(f"unsubscribe from {self.subject} failed: {why(exc)}") from exc


CLUSTER_REPLICAS = 3


class Bus(Publishing):
    """One connection to NATS, and core NATS on it. Make one with `connect` (or
    `connect_unless`), `close` it when done. What it publishes, and the barrier, come from
    `Publishing` (worker.bus.publish); pulls, streams and buckets are used through it
    (worker.bus.pull, .streams, .kv)."""

    def __init__(self, client: Client) -> None:
        super().__init__(client)
        self._deliveries = Deliveries(client)  # every started Pull, reset on a reconnect
        self._reconnect_listeners: list[Callable[[], None]] = []

    def _reconnected(self) -> None:
        self._count_reconnect()
        self._deliveries.reset()
        for listener in self._reconnect_listeners:
            listener()

    def on_reconnect(self, listener: Callable[[], None]) -> None:
        """Call `listener` after every reconnect, once nats-py has subscribed again: a core
        message published while we were away is lost, and what a stream kept can be read."""
        self._reconnect_listeners.append(listener)

    @classmethod
    async def connect(cls, settings: NatsSettings, name: str) -> Bus:
        """Connect, retrying with backoff while no server answers (NATS may start after us).

        Raises `BusRefused` at once if NATS refuses our credentials or TLS, which no retry
        can fix. Cancel the call to give up: the client of the attempt in flight is closed.
        """
        bus: Bus | None = None

        def reconnected() -> None:
            if bus is not None:
                bus._reconnected()

        delay = _CONNECT_BACKOFF_FIRST_S
        while True:
            try:
                client = await _connect_once(settings, name, reconnected)
            except BusRefused:
                raise
            except BusError as exc:
                logger.warning("%s; retrying in %.2gs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, _CONNECT_BACKOFF_MAX_S)
                continue
            bus = cls(client)
            try:
                await bus._start_publishing()
            except nats.errors.Error as exc:
                await client.close()
                raise BusError(f"cannot subscribe on NATS at {settings.url}: {exc}") from exc
            except asyncio.CancelledError:
                await client.close()
                raise
            return bus

    @classmethod
    async def connect_unless(
        cls, stop: asyncio.Event, settings: NatsSettings, name: str
    ) -> Bus | None:
        """`connect`, or None if `stop` is set first (a signal while NATS does not answer):
        the client's way to it, which may import only the bus of the worker."""
        return await unless_stopped(stop, cls.connect(settings, name))

    @property
    def is_connected(self) -> bool:
        return bool(self._nc.is_connected)

    @property
    def max_payload(self) -> int:
        """The largest message the server takes (its INFO's `max_payload`)."""
        return int(self._nc.max_payload)

    @property
    def clustered(self) -> bool:
        """Whether the server we reached is in a cluster (its INFO names one)."""
        return bool(self._nc._server_info.get("cluster"))

    @property
    def replicas(self) -> int:
        """Replicas for the streams and buckets we create: 3 in a cluster, else 1."""
        return CLUSTER_REPLICAS if self.clustered else 1

    async def subscribe(self, subject: str, handler: Handler) -> Subscription:
        """Call `handler` with every message on `subject`, one at a time, in order. The
        subscription is registered once the next `flush` returns. A handler's exception is
        logged, and the next message is handled."""

        async def deliver(msg: Msg) -> None:
            await handler(Message(msg.subject, msg.data, msg.reply))

        try:
            subscription = await self._nc.subscribe(subject, cb=deliver)
        except nats.errors.Error as exc:
            raise BusError(f"subscribe to {subject} failed: {why(exc)}") from exc
        return Subscription(subscription, subject)

    async def gather(
        self, subject: str, payload: bytes, *, first_reply_s: float, quiet_s: float
    ) -> list[bytes]:
        """Scatter-gather: publish `payload` to `subject` with a reply inbox, and collect every
        reply, waiting up to `first_reply_s` for the first, then until `quiet_s` passes
        without one."""
        replies: asyncio.Queue[bytes] = asyncio.Queue()

        async def collect(msg: Msg) -> None:
            # The server's own status message (503: nobody listens on `subject`) is no reply.
            if not msg.data and msg.headers and STATUS in msg.headers:
                return
            replies.put_nowait(msg.data)

        inbox = self._nc.new_inbox()
        try:
            subscription = await self._nc.subscribe(inbox, cb=collect)
            try:
                await self._nc.publish(subject, payload, reply=inbox)
                gathered: list[bytes] = []
                wait_s = first_reply_s
                while True:
                    try:
                        async with asyncio.timeout(wait_s):
                            gathered.append(await replies.get())
                    except TimeoutError:
                        return gathered
                    wait_s = quiet_s
            finally:
                await subscription.unsubscribe()
        except nats.errors.Error as exc:
            raise BusError(f"gathering replies on {subject} failed: {why(exc)}") from exc

    async def close(self) -> None:
        """Flush what was published (actions, acks), then disconnect."""
        # Without a connection the flush could only time out, and delay a stop for nothing:
        # what it would flush is redelivered (inputs) or republished from the log (actions).
        if self._nc.is_connected:
            try:
                await self.flush()
            except BusError as exc:
                logger.warning("NATS flush on close failed: %s", exc)
        try:
            await self._nc.close()
        except (nats.errors.Error, OSError) as exc:
            # The socket died while nats-py drained it (e.g. `ConnectionResetError` in a
            # reconnect): the connection is gone, which is all a close promises.
            logger.warning("NATS connection lost while closing: %s", why(exc))
