"""The one NATS module: every process of kvhandoff reaches NATS through `Bus`.

Nothing else imports nats-py (tests/test_layering.py checks it), so connecting, the publish
barrier, durable publishing and pulling from JetStream exist once, and every nats-py error is
translated to `BusError` here and nowhere else, `Inbound.ack` and `nak` included. The
worker consumes its input stream and publishes actions; the client library (`client/`: engines
and frontends, and through it the mock engines and the load generator), the demo and the
benchmarks subscribe, publish, read the completion stream and gather reports with the same
`Bus`.

Connecting. nats-py's connect loop retries forever when told to reconnect forever (which every
long-lived process here must, to outlive NATS restarts), even when the server refuses our
credentials or TLS handshake, and it offers no way to tell those apart from a server that is not
up yet. So `Bus.connect` watches the client's error callback while it connects: a refusal ends
the attempt at once with `BusRefused`, naming the setting to check (the commands exit 2); a
round of failures over every server retries with backoff. Cancelling `Bus.connect` gives up and
leaves nothing open; `Bus.connect_unless` gives up when a stop event (a signal) is set.

The barrier. nats-py's own flush() writes its PING straight to the socket, ahead of commands
still in its write buffer, so its PONG proves nothing about them. `Bus.flush` sends a message to
our own inbox instead, behind them: when it comes back, the server has everything before it,
if the connection did not change meanwhile. A reconnect loses what the old connection had
written and the server had not read (a server killed mid-load), while the barrier, written to
the new connection, comes back all the same: so a flush that a reconnect separates from the
first `publish` it covers fails (`BusError`), and its caller publishes again, as for a timeout.
A flush covers what was published since the previous one began, so where several callers
publish and flush independently (a tier worker's partitions), one's flush can take what another
published, and the other's flush then proves nothing of it. Such a caller notes `connection`
before it publishes, keeps the acks its `publish_stored` calls return, and calls `confirm`.

Publishing. `publish` is core NATS, buffered and in order. `publish_durable` is a JetStream
publish that returns once the stream stored the message; it retries with backoff while no
stream answers (not created yet, NATS reconnecting), while the stream elects a leader, and while
its own earlier attempt is still being replicated, and raises `BusError` when its time is up.
Every attempt of one call carries the same `Nats-Msg-Id`, so a retry after a lost
acknowledgement is stored once (within the stream's duplicate window). `publish_stored` is the
worker's pipelined JetStream publish, confirmed by the next `flush`: a core publish whose reply
subject is `<inbox>.<n>` on one inbox the Bus subscribes once, where the stream's ack (or its
refusal, or the server's 503 when no stream takes the subject) resolves the future it returned.
nats-py's `publish_async` spends a random token, a semaphore and a `wait_for` on each message,
and every handoff's `Complete` is one (bench/README.md: a hop's p50 at 16 in flight fell by a
fifth without them). A reconnect fails every ack still awaited (the old connection may have
lost the message or the ack), so that the caller publishes again.

The inbox. Inputs are captured by a JetStream stream with work-queue retention (an input leaves
the stream once the worker acknowledges it, which it does only after the input is in the event
log) and consumed through one durable pull consumer per partition with explicit acks (see
Partitions and Pins). JetStream redelivers an unacknowledged input only after the ack wait,
while newer inputs keep flowing, so a new owner would see inputs out of order (a fact before the
outcome it depends on); it reads what was delivered and never acknowledged first
(`unacknowledged`, worker.tier.owner's "Order").

The pull. nats-py's `fetch` costs about 110 µs per message (a task and a `wait_for` each), so
`Pull` speaks the pull protocol itself. It subscribes once to `<inbox>.*` and publishes pull
requests (`PullRequest`) to `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`, each with its own
reply subject `<inbox>.<n>`. The server sends the messages to that subscription (nats-py's
parser hands them to the Pull directly: `_Deliveries`), each with its
`$JS.ACK...` reply subject, which `Inbound` reads once for its metadata and publishes `+ACK`
or `-NAK` to. It also sends status messages there, header only (`NATS/1.0 <code>
<description>`, on the request's own reply subject). The Pull keeps two fetches' worth of messages
requested or ready, and asks again once half of that has been taken. Each request expires after
`expires_s` and asks for an idle heartbeat every `heartbeat_s`. The statuses:

    100 Idle Heartbeat    the request is alive. No message and no status for two intervals
                          means the server lost it: the Pull asks again. (Without heartbeats,
                          nothing heard for a request's whole expiry and a grace means that.)
    404 No Messages       a `no_wait` request found nothing more: `fetch` returns what it has.
    408 Request Timeout   the request expired; `Nats-Pending-Messages` says how much of it was
                          never delivered. The Pull asks again.
    409 Leadership Change, Server Shutdown
                          every open request is gone: the Pull asks again.
    409 Consumer Deleted  `BusError`.
    409 Message Size Exceeds MaxBytes
                          the request is full: the Pull asks again, unless not one byte of it
                          was used. Then the next message can never fit: `BusError`.
    409 Exceeded MaxWaiting, any other 409
    400 Bad Request       the server refused the request (a 400: the priority group is missing
                          or unknown, say): `BusError`. The next fetch asks again. (A request
                          with heartbeats that the consumer has no room for is dropped without
                          a 409, nats-server 2.15: it is counted lost, see 100.)
    423 Nats-Pin-Id mismatch
                          another client holds the pin of the request's priority group (ADR-42):
                          `PinMismatch`. The Pull drops its pin id, so it asks to be pinned anew.
    503 No Responders     no such consumer: `BusError`.

A `BusError` from a status is raised by the next `fetch`. Messages cannot be told apart by
request (the server serves open requests in turn), so what is on its way is a count, not a
ledger: each message takes one off, and a status that ends a request takes off its undelivered
part (`Nats-Pending-Messages`, or the request's whole batch when the status has no such header).
The count errs low (a status without that header), so the Pull may ask for a little more than it
keeps ahead; it errs high only when the server loses a request without a word, which the
heartbeats reveal. A reconnect forgets every open request (a restarted server has none), and
nothing is requested while disconnected: nats-py would buffer the request and send it after the
reconnect, beside the ones asked for then.

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
break the other tier. Streams and buckets are R3 when the server we
reached is in a cluster (its INFO names one), R1 alone.

Pins. Each partition has one durable pull consumer (`<consumer>-p<p>`, filtering that
partition's subject, or, in a stream of one partition, unfiltered: a wildcard filter over a
backlog of many handoffs, one subject each, costs nats-server more per delivery, and there it
selects every message anyway) with the priority group `owner` and the `pinned_client` policy
(ADR-42), made with the raw `$JS.API.CONSUMER.CREATE` request because nats-py has no priority
groups. The server pins the group to the first client that pulls, stamps `Nats-Pin-Id` on what
it delivers, answers a pull with another id with 423 (`PinMismatch`), and keeps a pull without
an id waiting (408 at its expiry), until `priority_timeout` passes without a pull from the
pinned client or the pin is released (`unpin`); then the next puller is pinned. What a pin
guarantees: at most one client is *delivered* a partition's new messages at a time, for as long
as it keeps pulling. What it does not: acks are not checked against it, and a paused client that
wakes after the pin moved still holds the messages it was given, may ack them and may publish. A
pin is not a fence.

Fencing. The fence is a compare-and-set append to a replicated per-partition log subject
(`<prefix>.log.<p>`): `append_expecting` publishes with `Nats-Expected-Last-Subject-Sequence`
and returns the new sequence; if another writer appended to the subject since, JetStream
refuses it (err_code 10071, or 10164 from a replicated stream whose leader is replicating
another append to the subject) and `Fenced` says so. A new owner first appends its ownership record
at the last sequence it read, so the old owner's next append fails and it must stop acting for
the partition: no publish, no ack. Every attempt of one append carries one `Nats-Msg-Id`, and
JetStream checks duplicates before the expected sequence, so an append retried after a lost
acknowledgement returns the sequence it got the first time instead of fencing its own writer.
What it guarantees: appends to a subject are totally ordered, and a writer learns at its next
append that it lost the race. What it does not: anything done before that append (a publish, an
ack) was not checked, so an owner must act only after its append succeeded.

Membership. Workers announce themselves in the KV bucket `KVHANDOFF_MEMBERS`: one key per worker
instance, `<tier>.<instance>` (the tier named by its input stream, so that tiers of other
streams on the same account count apart), one revision kept, dropped after `MEMBER_TTL_S`
without a refresh; `Membership.keep` refreshes it every third of that. `members` lists who is
live, read from the bucket's leader (no direct gets: a replica may answer from before the latest
refresh). Membership says who is *probably* alive, to size each worker's share (ceil(P / live));
it never decides who owns a partition. A paused worker stays listed until its TTL passes.
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
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StreamConfig,
    SubjectTransform,
)
from nats.js.kv import KeyValue

from kvhandoff.worker.config import NatsSettings
from kvhandoff.worker.errors import (
    BusError,
    BusRefused,
    ConfigError,
    Fenced,
    PartitionsMismatch,
    PinMismatch,
    StreamMismatch,
)
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


_KV_RETRY_S = 0.5  # after a refresh of a bucket's key that failed because NATS did not answer
_KV_DELETE_TIMEOUT_S = 2.0


MEMBERS_BUCKET = "KVHANDOFF_MEMBERS"
MEMBER_TTL_S = 5.0  # a dead worker counts as live this long, in every other worker's share


class Member(msgspec.Struct, frozen=True):
    """A worker of the tier, as it announces itself in `MEMBERS_BUCKET`: the value, as JSON.
    The key is `<tier>.<instance>` (`member_key`): `instance` is unique per start, and the tier
    is its input stream's name, so that tiers of several streams share one bucket apart."""

    host: str
    pid: int
    instance: str
    since_ms: int

    @classmethod
    def this_process(cls) -> Member:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            instance=uuid.uuid4().hex,
            since_ms=time.time_ns() // 1_000_000,
        )


def member_key(tier: str, instance: str) -> str:
    """A member's key in `MEMBERS_BUCKET`."""
    return f"{tier}.{instance}"


_MEMBER_ENCODER = msgspec.json.Encoder()
_MEMBER_DECODER = msgspec.json.Decoder(Member)


class Membership:
    """This worker's key in `MEMBERS_BUCKET`, refreshed by `keep` until `leave`."""

    def __init__(
        self, client: Client, kv: KeyValue, tier: str, member: Member, ttl_s: float
    ) -> None:
        self._nc = client
        self._kv = kv
        self.member = member
        self._key = member_key(tier, member.instance)
        self._value = _MEMBER_ENCODER.encode(member)
        self.ttl_s = ttl_s

    async def keep(self) -> None:
        """Refresh the announcement every third of the TTL, until cancelled. A refresh that
        NATS does not answer is retried sooner; one that lands after the key expired simply
        announces the worker again (the key is this instance's alone)."""
        wait = self.ttl_s / 3
        while True:
            await asyncio.sleep(wait)
            try:
                await self._kv.put(self._key, self._value)
                wait = self.ttl_s / 3
            except (TimeoutError, nats.errors.Error) as exc:
                logger.warning(
                    "membership %s: refresh failed, retrying: %s", self.member.instance, exc
                )
                wait = _KV_RETRY_S

    async def leave(self) -> None:
        """Withdraw the announcement, so the others need not wait for the TTL."""
        problem = "no connection"
        if self._nc.is_connected:
            try:
                await asyncio.wait_for(self._kv.delete(self._key), _KV_DELETE_TIMEOUT_S)
                return
            except (TimeoutError, nats.errors.Error) as exc:
                problem = str(exc)
        logger.warning(
            "membership %s not withdrawn (%s); it expires in %.0fs",
            self.member.instance, problem, self.ttl_s,
        )  # fmt: skip


def _why(exc: BaseException) -> str:
    """An exception's message, or its type when it has none (nats-py's timeouts)."""
    return str(exc) or type(exc).__name__


def _api_error(error: object) -> nats.js.errors.APIError:
    """The error of a JetStream API answer read by `Bus._js_api`, as nats-py raises those it
    reads itself: one text for a refusal, whichever path asked."""
    fields: dict[Any, Any] = error if isinstance(error, dict) else {"description": str(error)}
    return nats.js.errors.APIError(
        code=fields.get("code"), err_code=fields.get("err_code"),
        description=fields.get("description"),
    )  # fmt: skip


# --- Core NATS ------------------------------------------------------------------------------


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
            raise BusError(f"unsubscribe from {self.subject} failed: {_why(exc)}") from exc


# --- JetStream: one input and its settling ---------------------------------------------------

_ACK = b"+ACK"
_NAK = b"-NAK"
# A `$JS.ACK...` reply subject has 9 tokens,
# $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>,
# or, with <domain>.<account hash> before <stream>, 11 or more (ADR-15 lets servers append
# tokens). The delivery count is at 4 or 6, and the stream sequence follows it.
_V1_TOKENS = 9
_V2_MIN_TOKENS = 11


class Inbound:
    """One input message from the stream, with the two ways to settle it.

    Its metadata is read once, from the `$JS.ACK...` subject the server gave it as its reply
    subject; settling it is a core publish to that subject. Settling fails with `BusError`
    (without NATS, or with nats-py's write buffer full while it reconnects): JetStream then
    redelivers the input after the ack wait, and the log drops it as a duplicate.
    """

    __slots__ = ("_nc", "_reply", "data", "deliveries", "stream_seq", "subject")

    def __init__(self, client: Client, subject: str, data: bytes, reply: str) -> None:
        tokens = reply.split(".")
        at = 4 if len(tokens) == _V1_TOKENS else 6 if len(tokens) >= _V2_MIN_TOKENS else 0
        if not at or tokens[0] != "$JS" or tokens[1] != "ACK":
            raise BusError(f"message on {subject} is not a JetStream delivery (reply {reply!r})")
        try:
            # How many times JetStream delivered this input, this time included.
            self.deliveries = int(tokens[at])
            # Its position in the stream: the same on every delivery.
            self.stream_seq = int(tokens[at + 1])
        except ValueError as exc:
            raise BusError(f"message on {subject} has a malformed reply {reply!r}") from exc
        self._nc = client
        self._reply = reply
        self.subject = subject
        self.data = data

    async def ack(self) -> None:
        """Done: JetStream never delivers it again (and drops it, with work-queue retention)."""
        await self._settle(_ACK, "ack")

    async def nak(self, delay_s: float | None = None) -> None:
        """Redeliver, after `delay_s` if given."""
        payload = _NAK
        if delay_s:
            payload += b' {"delay": %d}' % int(delay_s * 1e9)
        await self._settle(payload, "nak")

    async def _settle(self, payload: bytes, how: str) -> None:
        try:
            await self._nc.publish(self._reply, payload)
        except (nats.errors.Error, OSError) as exc:
            raise BusError(
                f"{how} of input {self.subject} (stream seq {self.stream_seq}) failed: {_why(exc)}"
            ) from exc


# --- JetStream: the lean pull ----------------------------------------------------------------

_STATUS = "Status"
_DESCRIPTION = "Description"
_PENDING_MESSAGES = "Nats-Pending-Messages"
_PENDING_BYTES = "Nats-Pending-Bytes"
_PIN_ID_LINE = b"\r\nNats-Pin-Id:"  # how a raw header block spells the header's start
_REQUESTS_KEPT = 64  # open requests remembered by reply token, newest first
# Without heartbeats, an open request is counted lost once nothing was heard of it for its
# whole expiry and this much more.
_LOST_GRACE_S = 5.0
_S_TO_NS = 1_000_000_000


class PullRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """A pull request's body (ADR-13), published to `$JS.API.CONSUMER.MSG.NEXT.<stream>.
    <consumer>` with the reply subject that its messages and statuses are to go to. Durations
    are nanoseconds; a zero or absent field leaves the server's default."""

    batch: int
    expires: int = 0  # then the server ends the request with 408
    max_bytes: int = 0  # the request ends before a message that would exceed it (409)
    no_wait: bool = False  # answer 404 at once instead of waiting for messages
    idle_heartbeat: int = 0  # a 100 status this often while the request waits
    # Priority groups (ADR-42): the consumer's group this request pulls for, and the pin id
    # that the server gave this client (for a consumer with the `pinned_client` policy).
    group: str | None = None
    id: str | None = None


_PULL_REQUEST_ENCODER = msgspec.json.Encoder()


class Pull:
    """A durable consumer's messages, pulled ahead over one inbox of `bus` (see "The pull" in
    the module docstring). `start` it, `fetch` from it, `close` it; or `async with` it.

    `max_ahead` bounds the messages requested or ready at once. With `no_wait`, each request
    asks only for what the consumer holds now, one request at a time, and `fetch` returns []
    as soon as the server says it holds nothing: for readers that must leave no request
    waiting on the server. `heartbeat_s=0` asks for no heartbeats, and so notices a lost
    request only after its expiry. `group` and `pin_id` are sent with every request; the pin id
    is then the one the server attached to the last message (`Nats-Pin-Id`).
    """

    def __init__(
        self,
        bus: Bus,
        stream: str,
        consumer: str,
        *,
        max_ahead: int,
        expires_s: float = 30.0,
        heartbeat_s: float = 5.0,
        max_bytes: int = 0,
        no_wait: bool = False,
        group: str | None = None,
        pin_id: str | None = None,
    ) -> None:
        if max_ahead < 1 or expires_s <= 0 or heartbeat_s < 0 or max_bytes < 0:
            raise ConfigError(
                f"pull from {stream} / {consumer}: max_ahead ({max_ahead}) and expires_s "
                f"({expires_s}) must be positive, heartbeat_s ({heartbeat_s}) and max_bytes "
                f"({max_bytes}) not negative"
            )
        if not no_wait and 2 * heartbeat_s > expires_s:
            # The server refuses such a request (400 "heartbeat value too large").
            raise ConfigError(
                f"pull from {stream} / {consumer}: heartbeat_s ({heartbeat_s}) must be at most "
                f"half of expires_s ({expires_s})"
            )
        self.consumer = f"{stream} / {consumer}"
        self.group = group
        self.pin_id = pin_id
        self._bus = bus
        self._nc = bus._nc
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = self._nc.new_inbox()
        self._max_ahead = self._ahead = max_ahead
        self._no_wait = no_wait
        self._expires_ns = 0 if no_wait else int(expires_s * _S_TO_NS)
        self._heartbeat_s = 0.0 if no_wait else heartbeat_s
        # How long nothing may be heard of open requests before they count as lost.
        self._lost_after_s = (
            2 * self._heartbeat_s
            if self._heartbeat_s
            else (0.0 if no_wait else expires_s) + _LOST_GRACE_S
        )
        self._max_bytes = max_bytes
        self._ready: deque[Inbound] = deque()
        self._pending = 0  # messages requested and neither delivered nor released
        self._open: dict[str, int] = {}  # reply token -> batch, of requests that may be open
        self._tokens = itertools.count()
        self._heard_at = 0.0  # the last message or status, or the last request
        self._failure: BusError | None = None
        self._empty = False  # no_wait: the server said that it holds nothing more
        self._woken = False  # `wake`: the fetch in progress, or the next, returns at once
        self._changed = asyncio.Event()
        self._subscription: NatsSubscription | None = None

    @property
    def pending(self) -> int:
        """Messages requested and not yet delivered, as far as the Pull can tell."""
        return self._pending

    async def start(self) -> None:
        """Subscribe to the inbox. Nothing is requested before the first `fetch`."""
        try:
            self._subscription = await self._nc.subscribe(f"{self._inbox}.*")
        except nats.errors.Error as exc:
            raise BusError(f"pull from {self.consumer}: cannot subscribe: {_why(exc)}") from exc
        self._bus._deliveries.route(self._subscription, self)
        self._bus._pulls.add(self)  # so that a reconnect resets it

    async def close(self) -> None:
        """Unsubscribe; the server drops the open requests once it cannot deliver to them."""
        self._bus._pulls.discard(self)
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            self._bus._deliveries.unroute(subscription)
            try:
                await subscription.unsubscribe()
            except nats.errors.Error as exc:
                raise BusError(f"pull from {self.consumer}: {_why(exc)}") from exc

    async def __aenter__(self) -> Pull:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def fetch(
        self, max_messages: int, timeout_s: float, *, max_bytes: int | None = None,
        overhead: int = 0,
    ) -> list[Inbound]:  # fmt: skip
        """Up to `max_messages` messages in stream order: at once those ready, if any; else the
        first to arrive within `timeout_s`, or []. With `max_bytes`, the messages' payloads and
        `overhead` bytes each add up to at most that, but for a first message that alone is
        more (the rest stay ready for the next call). Raises the `BusError` that a status
        reported since the last call (the next call asks again)."""
        if self._subscription is None:
            raise BusError(f"pull from {self.consumer}: fetch before start or after close")
        self._ahead = min(self._max_ahead, 2 * max_messages)
        deadline = time.monotonic() + timeout_s
        while True:
            # Cleared before looking, so that whatever arrives while we ask wakes the wait.
            self._changed.clear()
            self._raise_failure()
            if self._ready:
                break
            if self._empty or self._woken:
                self._empty = self._woken = False
                return []
            now = time.monotonic()
            self._check_heard(now)
            await self._ask(max_messages)
            wait_s = deadline - now
            if wait_s <= 0:
                return []
            if self._pending:
                wait_s = min(wait_s, self._lost_after_s / 2)  # to notice a lost request
            # Not `wait_for`: Python 3.11's drops a cancellation that coincides with the
            # event, which arrives all the time here; `timeout` runs no task either.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._changed.wait()
        ready = self._ready
        if max_bytes is None:
            taken = [ready.popleft() for _ in range(min(max_messages, len(ready)))]
        else:
            taken, size = [], 0
            while ready and len(taken) < max_messages:
                size += len(ready[0].data) + overhead
                if taken and size > max_bytes:
                    break
                taken.append(ready.popleft())
        await self._ask(max_messages)
        return taken

    def wake(self) -> None:
        """End the `fetch` in progress (or, if none is, the next one) at once, with what is
        ready, else []: for a caller that stops and must not wait out the fetch's timeout."""
        self._woken = True
        self._changed.set()

    @property
    def ready(self) -> list[Inbound]:
        """The messages delivered and not yet fetched, in the order they came (left in place)."""
        return list(self._ready)

    def take_ready(self) -> list[Inbound]:
        """The messages delivered and not yet fetched, taken out of the Pull: for an owner
        that hands its partition over and must settle them (nak) rather than drop them."""
        taken = list(self._ready)
        self._ready.clear()
        return taken

    def reset(self) -> None:
        """Forget every open request (after a reconnect: a restarted server has none, and one
        that stayed up resumes them, which costs at most a batch more than `max_ahead`)."""
        self._pending = 0
        self._open.clear()
        self._changed.set()

    async def _ask(self, batch_hint: int) -> None:
        """Request more if less than half of what the Pull keeps ahead is on its way."""
        if not self._nc.is_connected:
            return  # `reset` asks again once reconnected
        if self._no_wait:
            if self._pending or self._ready:
                return
            batch = batch_hint
        else:
            batch = self._ahead - self._pending - len(self._ready)
            if 2 * batch < self._ahead:
                return
        token = str(next(self._tokens))
        request = PullRequest(
            batch=batch,
            expires=self._expires_ns,
            max_bytes=self._max_bytes,
            no_wait=self._no_wait,
            idle_heartbeat=int(self._heartbeat_s * _S_TO_NS),
            group=self.group,
            id=self.pin_id,
        )
        try:
            await self._nc.publish(
                self._next_subject,
                _PULL_REQUEST_ENCODER.encode(request),
                reply=f"{self._inbox}.{token}",
            )
        except nats.errors.Error as exc:
            raise BusError(f"pull request to {self.consumer} failed: {_why(exc)}") from exc
        self._open[token] = batch
        if len(self._open) > _REQUESTS_KEPT:
            # The oldest have long ended: a request that is served in full ends silently.
            del self._open[next(iter(self._open))]
        self._pending += batch
        self._empty = False
        self._heard_at = time.monotonic()

    def _check_heard(self, now: float) -> None:
        if self._pending and now - self._heard_at > self._lost_after_s:
            logger.warning(
                "pull from %s: nothing heard of the open requests for %.1fs; asking again",
                self.consumer,
                now - self._heard_at,
            )
            self.reset()

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _fail(self, failure: BusError) -> None:
        if self._failure is None:  # the first is the cause; the others follow from it
            self._failure = failure

    def _on_delivery(
        self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        """A message of the stream (it has the `$JS.ACK...` reply subject; statuses have none),
        straight from nats-py's parser (see `_Deliveries`)."""
        self._heard_at = time.monotonic()
        try:
            inbound = Inbound(self._nc, subject.decode(), data, reply.decode())
        except (BusError, UnicodeDecodeError) as exc:
            logger.warning("pull from %s: ignored %s", self.consumer, exc)
            return
        if self._pending:
            self._pending -= 1
        if headers and (pin_id := _pin_id(headers)) is not None:
            self.pin_id = pin_id
        self._ready.append(inbound)
        self._changed.set()

    def _on_status(self, subject: bytes, headers: dict[str, str]) -> None:
        self._heard_at = time.monotonic()
        self._changed.set()
        token = subject.rpartition(b".")[2].decode("ascii", "replace")
        status = headers.get(_STATUS, "")
        description = headers.get(_DESCRIPTION, "").strip()
        if status == "100":
            return  # idle heartbeat: our requests are alive
        self._release(token, headers)
        refused = f"pull from {self.consumer}: {status} {description}"
        match status, description:
            case "404", _:
                self._empty = self._no_wait
            case "408", _:
                pass  # expired: the next fetch asks again
            case "409", "Leadership Change" | "Server Shutdown":
                self.reset()
            case "409", "Consumer Deleted":
                self.reset()
                self._fail(BusError(f"{refused}: the consumer is gone"))
            case "409", _ if description.startswith("Message Size Exceeds MaxBytes"):
                if headers.get(_PENDING_BYTES) == str(self._max_bytes):
                    self._fail(
                        BusError(
                            f"{refused}: the next message is larger than max_bytes "
                            f"({self._max_bytes}), so no request can ever take it"
                        )
                    )
            case "423", _:
                self.pin_id = None
                self._fail(
                    PinMismatch(
                        f"{refused}: another client holds the pin of priority group "
                        f"{self.group!r}; the next fetch asks to be pinned anew"
                    )
                )
            case "503", _:
                self._fail(BusError(f"pull from {self.consumer}: no responders: no such consumer"))
            case _:
                self._fail(BusError(f"{refused}: the server refused the pull request"))

    def _release(self, token: str, headers: dict[str, str]) -> None:
        """Take what an ended request will never deliver off the count (see the docstring)."""
        batch = self._open.pop(token, 0)
        try:
            undelivered = int(headers[_PENDING_MESSAGES])
        except (KeyError, ValueError):
            undelivered = batch
        self._pending = max(0, self._pending - undelivered)


def _pin_id(headers: bytes) -> str | None:
    """The last `Nats-Pin-Id` of a raw header block (the server's: it adds its own after any a
    publisher set), as nats-py's parse into a dict keeps the last one."""
    at = headers.rfind(_PIN_ID_LINE)
    if at < 0:
        return None
    start = at + len(_PIN_ID_LINE)
    return headers[start : headers.find(b"\r\n", start)].strip().decode("utf-8", "replace")


class _Deliveries:
    """What the server sends to each Pull's inbox goes to the Pull straight from nats-py's
    parser, not through a subscription's callback.

    nats-py hands every message it reads to `Client._process_msg`, which parses its headers into
    a dict, builds a `Msg` and queues it for the subscription's task, which then awaits its
    callback. Every input comes this way, and every one carries headers (the server's
    `Nats-Pin-Id`, the publisher's `Nats-Msg-Id`): that path was a fifth of the worker's CPU
    in a drain (bench/README.md, "Deliveries from the parser"). So the Bus puts itself
    in front of `_process_msg` on its own client: a message for a routed subscription is given
    to its Pull there and then, in the order read (statuses included, their headers parsed by
    nats-py's own `_process_headers`); any other goes on to nats-py as before. The subscription
    itself stays nats-py's (its SUB, its resubscription after a reconnect, its UNSUB). Both
    names are nats-py internals (read in 2.16): were they to change, no Pull would receive
    anything, and every test of tests/worker/test_pull.py would say so."""

    def __init__(self, client: Client) -> None:
        self._routes: dict[int, Pull] = {}
        self._process_msg = client._process_msg
        self._process_headers = client._process_headers
        client._process_msg = self._process  # type: ignore[method-assign]

    def route(self, subscription: NatsSubscription, pull: Pull) -> None:
        self._routes[subscription._id] = pull

    def unroute(self, subscription: NatsSubscription) -> None:
        self._routes.pop(subscription._id, None)

    async def _process(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        pull = self._routes.get(sid)
        if pull is None:
            # nats-py's own parser passes None for a message without headers, as here.
            await self._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
        elif reply:
            pull._on_delivery(subject, reply, data, headers)
        else:
            pull._on_status(subject, await self._process_headers(headers) or {})


# --- The bus --------------------------------------------------------------------------------

# JetStream does not answer while a stream is created or NATS reconnects: retried.
_RETRYABLE = (
    TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
)
_PUBLISH_ACK_TIMEOUT_S = 2.0
_PUBLISH_BACKOFF_S = (0.05, 2.0)  # first and longest pause between attempts
_BARRIER_TIMEOUT_S = 5.0
_STORED_SWEEP_MIN = 4096  # acks awaited before `publish_stored` first drops those given up on


class _ApiError(msgspec.Struct, frozen=True):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _StoredAck(msgspec.Struct, frozen=True):
    """A stream's answer to a JetStream publish (its `PubAck`, or the error it refused it with)."""

    seq: int = 0
    error: _ApiError | None = None


_STORED_ACK = msgspec.json.Decoder(_StoredAck)

# The input stream's settings, partitioned or not.
_INPUT_STREAM: dict[str, Any] = {
    "retention": RetentionPolicy.WORK_QUEUE,
    "duplicate_window": 120.0,
}
PARTITIONS_METADATA = "kvhandoff.partitions"
# Which kind of worker consumes the input stream, in its metadata beside the partition count:
# a tier (a pinned consumer per partition; the replicated log is the authority), or `single`,
# the single worker of earlier versions (its local file was the authority), which a tier must
# not take over.
CONSUMER_METADATA = "kvhandoff.consumer"
PRIORITY_GROUP = "owner"  # the one priority group of every partition's consumer
CLUSTER_REPLICAS = 3
_JS_INFO = "$JS.API.INFO"
_JS_API_TIMEOUT_S = 5.0
_JS_READY_POLL_S = 0.1
_READ_BATCH = 256
_STALE_READ_GIVE_UP_S = 30.0  # how long a catch-up waits for a lagging replica to catch up
_ANNOUNCE_GIVE_UP_S = 15.0
_READER_IDLE_S = 30.0  # a reader's consumer that its reader left goes away after this
_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
# JetStream's err_codes for a refused expected last sequence: 10071 when the stream checked it
# against what it stores (naming the sequence it holds), 10164 when a replicated stream's leader
# refused it because another append to the subject, which passed that check, is being
# replicated. Either way another writer got there first (nats-py's KV reads both the same way).
_WRONG_LAST_SEQUENCE = (10071, 10164)
# "duplicate message id is in process": our own earlier attempt is still being replicated.
_OWN_ATTEMPT_IN_FLIGHT = 10158
# A roll-up: the stored message replaces every earlier one of its subject (never the stream's).
_ROLLUP = "Nats-Rollup"
_ROLLUP_SUBJECT = "sub"
# JetStream's atomic batch publish (ADR-50, server 2.12+): every message of a batch names it
# and its place; the last commits it, and only then is any of it stored.
_BATCH_ID = "Nats-Batch-Id"
_BATCH_SEQUENCE = "Nats-Batch-Sequence"
_BATCH_COMMIT = "Nats-Batch-Commit"
MAX_BATCH_MESSAGES = 1000  # the server's limit on one atomic batch
# "subjects overlap with an existing stream": another stream captures what we would.
_SUBJECTS_OVERLAP = 10065
# "stream name already in use": another process created the stream just now.
_STREAM_NAME_IN_USE = 10058


def _captures(config: StreamConfig) -> str:
    # nats-py leaves a stream info's retention as the server's string.
    retention = RetentionPolicy(config.retention or RetentionPolicy.LIMITS).value
    return f"{', '.join(config.subjects or []) or 'nothing'} ({retention} retention)"


def _check_stream(held: StreamConfig, wanted: StreamConfig, role: str, flag: str) -> None:
    """`StreamMismatch` unless the stream there captures the subjects this tier's `role`
    does, with its retention: it is another tier's (or made by hand), which an update or our
    appends would break, and which would never hold what we store."""
    if (
        sorted(held.subjects or []) == sorted(wanted.subjects or [])
        and held.retention == wanted.retention
    ):
        return
    others = "" if flag == "--stream" else ", or give the tier its own --stream, which names it"
    raise StreamMismatch(
        f"stream {wanted.name} captures {_captures(held)}, not {_captures(wanted)} as this "
        f"tier's {role}: it is another tier's, or made by hand; name this tier's {role} with "
        f"{flag}{others}"
    )


def partition_subject(prefix: str, partition: int) -> str:
    """The subjects of one partition's inputs, as the stream's transform stores them."""
    return f"{prefix}.inp.{partition}.*"


def partition_log_subject(prefix: str, partition: int) -> str:
    """The subject of one partition's log, appended with compare-and-set."""
    return f"{prefix}.log.{partition}"


class Bus:
    """One connection to NATS and everything kvhandoff does with it. Make one with `connect`
    (or `connect_unless`), `close` it when done."""

    def __init__(self, client: Client) -> None:
        self._nc = client
        self._js = client.jetstream()
        self._pulls: set[Pull] = set()  # every started Pull, reset on a reconnect
        self._deliveries = _Deliveries(client)
        self._barrier_subject = client.new_inbox()
        self._barriers: dict[bytes, asyncio.Future[None]] = {}
        self._barrier_count = itertools.count()
        # JetStream acks of durable publishes not yet awaited; `flush` awaits them.
        self._unconfirmed: list[asyncio.Future[int]] = []
        # `publish_stored`: the acks awaited, by the last token of their reply subject.
        self._stored_inbox = client.new_inbox()
        self._stored: dict[str, asyncio.Future[int]] = {}
        self._stored_count = itertools.count()
        self._stored_sweep_at = _STORED_SWEEP_MIN
        self._reconnect_listeners: list[Callable[[], None]] = []
        self._connection = 0  # counts reconnects
        # The connection that the oldest `publish` not yet covered by a `flush` was made on.
        self._unflushed_on: int | None = None

    async def _start(self) -> None:
        await self._nc.subscribe(self._barrier_subject, cb=self._on_barrier)
        await self._nc.subscribe(f"{self._stored_inbox}.*", cb=self._on_stored)

    async def _on_barrier(self, msg: Msg) -> None:
        waiter = self._barriers.pop(msg.data, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _on_stored(self, msg: Msg) -> None:
        ack = self._stored.pop(msg.subject.rpartition(".")[2], None)
        if ack is None or ack.done():
            return
        headers = msg.headers or {}
        if status := headers.get(_STATUS):  # 503: no stream takes the subject
            description = headers.get(_DESCRIPTION, "")
            ack.set_exception(BusError(f"no stream stored a message: {status} {description}"))
            return
        try:
            reply = _STORED_ACK.decode(msg.data)
        except msgspec.DecodeError as exc:
            ack.set_exception(BusError(f"a stream's ack is malformed: {exc}"))
            return
        if (error := reply.error) is not None:
            ack.set_exception(
                BusError(
                    f"a stream refused a message: {error.description} "
                    f"(code {error.code}, err_code {error.err_code})"
                )
            )
        else:
            ack.set_result(reply.seq)

    def _reconnected(self) -> None:
        self._connection += 1
        stored, self._stored = self._stored, {}
        for ack in stored.values():
            if not ack.done():
                ack.set_exception(
                    BusError("NATS reconnected before a stream acknowledged a message")
                )
        for pull in self._pulls:
            pull.reset()
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
                await bus._start()
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

    # --- Core NATS ------------------------------------------------------------------------

    async def publish(self, subject: str, payload: bytes) -> None:
        """Core NATS publish: buffered, in order with everything else on this connection."""
        if self._unflushed_on is None:
            self._unflushed_on = self._connection
        try:
            await self._nc.publish(subject, payload)
        except nats.errors.Error as exc:
            raise BusError(f"publish to {subject} failed: {_why(exc)}") from exc

    async def subscribe(self, subject: str, handler: Handler) -> Subscription:
        """Call `handler` with every message on `subject`, one at a time, in order. The
        subscription is registered once the next `flush` returns. A handler's exception is
        logged, and the next message is handled."""

        async def deliver(msg: Msg) -> None:
            await handler(Message(msg.subject, msg.data, msg.reply))

        try:
            subscription = await self._nc.subscribe(subject, cb=deliver)
        except nats.errors.Error as exc:
            raise BusError(f"subscribe to {subject} failed: {_why(exc)}") from exc
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
            if not msg.data and msg.headers and _STATUS in msg.headers:
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
            raise BusError(f"gathering replies on {subject} failed: {_why(exc)}") from exc

    async def flush(self) -> None:
        """Return once the server has everything published so far (subscriptions included),
        and the streams have stored every `publish_stored` message (see "The barrier")."""
        token = str(next(self._barrier_count)).encode()
        waiter = self._barriers[token] = asyncio.get_running_loop().create_future()
        unconfirmed, self._unconfirmed = self._unconfirmed, []
        published_on, self._unflushed_on = self._unflushed_on, None
        try:
            await self._nc.publish(self._barrier_subject, token)
            await asyncio.wait_for(waiter, timeout=_BARRIER_TIMEOUT_S)
            reconnects = 0 if published_on is None else self._connection - published_on
            if unconfirmed and not reconnects:
                await asyncio.wait_for(asyncio.gather(*unconfirmed), timeout=_BARRIER_TIMEOUT_S)
        except (TimeoutError, BusError, nats.errors.Error) as exc:
            for future in unconfirmed:
                future.cancel()
            raise BusError(f"flush failed: {_why(exc)}") from exc
        finally:
            self._barriers.pop(token, None)
        if reconnects:
            for future in unconfirmed:
                future.cancel()
            raise BusError(
                f"flush failed: NATS reconnected ({reconnects} time(s)) after messages it "
                "covers were published, so the server may never have read them"
            )

    # --- JetStream publishing -------------------------------------------------------------

    async def publish_durable(
        self, subject: str, payload: bytes, *, give_up_after_s: float = 5.0,
        msg_id: str | None = None,
    ) -> None:  # fmt: skip
        """JetStream publish: returns once the stream stored the message. Retried with backoff
        (see `_store`); `BusError` after `give_up_after_s`, or at once on an error that no retry
        can fix (the stream refused the message). `msg_id` names the message for the stream's
        duplicate window where two publishers may send the same one (a lease's answers)."""
        headers = {"Nats-Msg-Id": msg_id or uuid.uuid4().hex}
        await self._store(
            subject, payload, headers, give_up_after_s, f"durable publish to {subject}"
        )

    async def _store(
        self, subject: str, payload: bytes, headers: dict[str, str], give_up_after_s: float,
        what: str,
    ) -> int:  # fmt: skip
        """A JetStream publish of `payload`; the stored message's sequence. Every attempt carries
        the one `Nats-Msg-Id` in `headers`, so the stream stores the message once however many
        it takes. Retried with backoff while no stream answers, while the stream has no leader
        for a moment (503: a node died, an election runs), and while an earlier attempt is still
        being replicated (10158: a later one is answered as a duplicate). `Fenced` if the
        stream refused the expected last sequence in `headers`; `BusError` naming `what` after
        `give_up_after_s`, or at once on a refusal that no retry can fix."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + give_up_after_s
        backoff_s = _PUBLISH_BACKOFF_S[0]
        while True:
            attempt_s = max(min(_PUBLISH_ACK_TIMEOUT_S, give_up_at - loop.time()), 0.05)
            try:
                ack = await self._js.publish(subject, payload, timeout=attempt_s, headers=headers)
                return ack.seq
            except nats.js.errors.APIError as exc:
                if exc.err_code in _WRONG_LAST_SEQUENCE:
                    raise Fenced(
                        f"{what} was refused: another writer appended first ({_why(exc)})"
                    ) from exc
                if exc.err_code != _OWN_ATTEMPT_IN_FLIGHT and not isinstance(
                    exc, (*_RETRYABLE, nats.js.errors.ServiceUnavailableError)
                ):
                    raise BusError(f"{what} failed: {_why(exc)}") from exc
                failure: Exception = exc
            except _RETRYABLE as exc:
                failure = exc
            except nats.errors.Error as exc:
                raise BusError(f"{what} failed: {_why(exc)}") from exc
            if loop.time() + backoff_s >= give_up_at:
                raise BusError(
                    f"{what} failed for {give_up_after_s:g}s: {_why(failure)}"
                ) from failure
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, _PUBLISH_BACKOFF_S[1])

    async def get_last_msg(self, stream: str, subject: str) -> bytes | None:
        """The last message `stream` keeps on `subject`, or None if it keeps none there (or
        there is no such stream yet)."""
        try:
            message = await self._js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(
                f"reading the last message on {subject} of {stream}: {_why(exc)}"
            ) from exc
        return message.data or b""

    async def publish_stored(self, subject: str, payload: bytes) -> asyncio.Future[int]:
        """JetStream publish whose ack the next `flush` awaits: many can be in flight at once.
        Returns the ack (the stored message's sequence, or a `BusError`), for `confirm`."""
        token = str(next(self._stored_count))
        ack: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        try:
            await self._nc.publish(subject, payload, reply=f"{self._stored_inbox}.{token}")
        except nats.errors.Error as exc:
            raise BusError(f"durable publish to {subject} failed: {_why(exc)}") from exc
        self._stored[token] = ack
        if len(self._stored) > self._stored_sweep_at:
            # An ack never comes for a message that a stream's leader change lost: those that
            # `flush` or `confirm` gave up on (cancelled) are dropped here.
            self._stored = {t: f for t, f in self._stored.items() if not f.done()}
            self._stored_sweep_at = max(_STORED_SWEEP_MIN, 2 * len(self._stored))
        self._unconfirmed.append(ack)
        return ack

    @property
    def connection(self) -> int:
        """How many times the client reconnected: what was published under an earlier count
        may have died with its connection (see "The barrier")."""
        return self._connection

    async def confirm(self, connection: int, stored: Sequence[asyncio.Future[int]]) -> None:
        """Return once the server has what one caller published since `connection` was its
        count, whatever other callers' flushes took meanwhile: a flush, on this connection
        still, and the acks of its `publish_stored` messages (`stored`). `BusError` otherwise."""
        await self.flush()
        if self._connection != connection:
            raise BusError(
                f"flush failed: NATS reconnected ({self._connection - connection} time(s)) after "
                "messages it covers were published, so the server may never have read them"
            )
        if not stored:
            return
        done, pending = await asyncio.wait(stored, timeout=_BARRIER_TIMEOUT_S)
        for ack in pending:
            ack.cancel()  # given up on: swept from the acks awaited
        failed = [ack for ack in done if ack.cancelled() or ack.exception() is not None]
        if pending or failed:
            raise BusError(
                f"flush failed: a stream did not store {len(pending) + len(failed)} of "
                f"{len(stored)} messages (no answer within {_BARRIER_TIMEOUT_S}s, or refused)"
            )

    # --- The worker's streams ---------------------------------------------------------------

    async def open_completions(self, stream: str, subjects: str, max_age_s: float) -> None:
        """Create (or update) the stream that keeps the last completion of every handoff, so a
        frontend that was away when its `Complete` went out can still read it."""
        config = StreamConfig(
            name=stream,
            subjects=[subjects],
            retention=RetentionPolicy.LIMITS,
            max_msgs_per_subject=1,
            max_age=max_age_s,
            num_replicas=self.replicas,  # a frontend reads it after a node died, too
        )
        try:
            try:
                info = await self._js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                await self._create_stream(config, "completion stream", "--done-stream")
                logger.info("created stream %s for %s", stream, subjects)
            else:
                _check_stream(info.config, config, "completion stream", "--done-stream")
                await self._js.update_stream(config)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot open completion stream {stream}: {exc}") from exc

    async def _create_stream(self, config: StreamConfig, role: str, flag: str) -> None:
        """Create the stream; `StreamMismatch` if another stream captures its subjects (another
        tier's of the same subject prefix, most likely)."""
        try:
            await self._js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _SUBJECTS_OVERLAP:
                raise
            subjects = config.subjects or []
            try:
                other = await self._js.find_stream_name_by_subject(subjects[0])
            except nats.js.errors.NotFoundError:
                other = "another stream"  # it went away meanwhile: the next start will tell
            raise StreamMismatch(
                f"cannot create stream {config.name} for {', '.join(subjects)} as this tier's "
                f"{role}: {other} captures them (another tier's, of this --subject-prefix?); "
                f"give this tier its own --subject-prefix, or name that stream with {flag}"
            ) from exc

    async def capture_unless_captured(self, stream: str, subjects: str, max_age_s: float) -> bool:
        """Create `stream` to store `subjects` unless a stream already does (a worker's input
        stream, say); True if it created one. `kvhandoff engine-check` uses it so that an
        engine's JetStream publishes are stored, and so answered, without a worker."""
        config = StreamConfig(
            name=stream, subjects=[subjects], retention=RetentionPolicy.LIMITS, max_age=max_age_s
        )
        try:
            await self._js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code == _SUBJECTS_OVERLAP:
                return False
            raise BusError(f"cannot open stream {stream}: {_why(exc)}") from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot open stream {stream}: {_why(exc)}") from exc
        return True

    async def delete_stream(self, stream: str) -> None:
        try:
            await self._js.delete_stream(stream)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot delete stream {stream}: {_why(exc)}") from exc

    # --- Scale-out: partitions, pins, fencing, membership (see the module docstring) --------

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

    async def wait_jetstream(self, timeout_s: float) -> None:
        """Return once JetStream answers `$JS.API.INFO` (in a cluster: once its meta group
        has a leader); `BusError` with its last answer after `timeout_s`."""
        clock = asyncio.get_running_loop().time
        give_up = clock() + timeout_s
        last = "nothing"
        while True:
            try:
                reply = await self._nc.request(_JS_INFO, b"", timeout=_JS_API_TIMEOUT_S)
                answer = msgspec.json.decode(reply.data)
                if isinstance(answer, dict) and "error" not in answer:
                    return
                last = reply.data[:200].decode(errors="replace")
            except (TimeoutError, nats.errors.Error, msgspec.DecodeError) as exc:
                last = _why(exc)
            if clock() > give_up:
                raise BusError(f"JetStream did not answer within {timeout_s:g}s: {last}")
            await asyncio.sleep(_JS_READY_POLL_S)

    async def open_partitions(self, stream: str, prefix: str, partitions: int) -> None:
        """Create the partitioned input stream if absent (R3 in a cluster), or check that the
        one there is a tier's with `partitions` partitions (`PartitionsMismatch` if not)."""
        if partitions < 1:
            raise ConfigError(f"stream {stream}: {partitions} partitions; at least one")
        config = StreamConfig(
            name=stream,
            subjects=[f"{prefix}.in.*"],
            subject_transform=SubjectTransform(
                src=f"{prefix}.in.*",
                dest=f"{prefix}.inp.{{{{partition({partitions},1)}}}}.{{{{wildcard(1)}}}}",
            ),
            **_INPUT_STREAM,
        )
        try:
            try:
                info = await self._js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                config.num_replicas = self.replicas
                config.metadata = {PARTITIONS_METADATA: str(partitions), CONSUMER_METADATA: "tier"}
                await self._create_stream(config, "input stream", "--stream")
                logger.info(
                    "created stream %s for %s: %d partition(s), R%d",
                    stream, config.subjects, partitions, config.num_replicas,
                )  # fmt: skip
                return
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot open stream {stream}: {_why(exc)}") from exc
        metadata = info.config.metadata or {}
        stored = metadata.get(PARTITIONS_METADATA, "1")
        stored_consumer = metadata.get(CONSUMER_METADATA, "single" if stored == "1" else "tier")
        if stored_consumer != "tier":
            raise PartitionsMismatch(
                f"stream {stream} was made for {stored_consumer!r}, the single worker of an "
                "earlier kvhandoff, whose log is its local file and in no replicated log: let "
                "that version finish its open handoffs, then delete the stream"
            )
        _check_stream(info.config, config, "input stream", "--stream")
        if stored != str(partitions):
            raise PartitionsMismatch(
                f"stream {stream} has {stored} partition(s) and this worker was started with"
                f" {partitions}; the partitions are fixed when the stream is created: start"
                f" every worker with --partitions {stored}, or delete the stream"
            )

    async def open_partition_consumer(
        self,
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
        request = {
            "stream_name": stream,
            "config": {
                "name": name,
                "durable_name": name,
                "filter_subject": "" if partitions == 1 else partition_subject(prefix, partition),
                "ack_policy": "explicit",
                "deliver_policy": "all",
                "ack_wait": int(ack_wait_s * _S_TO_NS),
                "max_ack_pending": max_pending,
                "max_deliver": -1,
                "num_replicas": 0,  # the stream's
                "priority_groups": [PRIORITY_GROUP],
                "priority_policy": "pinned_client",
                "priority_timeout": int(priority_timeout_s * _S_TO_NS),
            },
        }
        await self._js_api(
            f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
            request,
            f"cannot create consumer {name} of partition {partition} on {stream}",
        )
        return name

    async def unpin(self, stream: str, consumer: str, group: str = PRIORITY_GROUP) -> None:
        """Release the pin of `group` on `consumer`, so the next puller is pinned at once
        instead of after the priority timeout (a clean hand-over)."""
        await self._js_api(
            f"$JS.API.CONSUMER.UNPIN.{stream}.{consumer}",
            {"group": group},
            f"cannot unpin group {group!r} of {stream} / {consumer}",
        )

    async def ack_floor(self, stream: str, consumer: str) -> int:
        """The stream sequence at and below which `consumer` has every message acknowledged:
        it never delivers those again."""
        try:
            info = await self._js.consumer_info(stream, consumer)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(
                f"cannot read the ack floor of {stream} / {consumer}: {_why(exc)}"
            ) from exc
        return info.ack_floor.stream_seq if info.ack_floor is not None else 0

    async def pinned(self, stream: str, consumer: str, group: str = PRIORITY_GROUP) -> bool:
        """Whether a client holds the pin of `group` on `consumer` now (its consumer info names
        one). The server pins a client only when it delivers to it: a consumer with nothing to
        deliver has no pinned client, whoever pulls it."""
        info = await self._js_api(
            f"$JS.API.CONSUMER.INFO.{stream}.{consumer}", {},
            f"cannot read the pin of group {group!r} of {stream} / {consumer}",
        )  # fmt: skip
        groups = info.get("priority_groups") or []
        return any(g.get("group") == group and g.get("pinned_client_id") for g in groups)

    async def _js_api(self, subject: str, request: dict[str, Any], what: str) -> dict[str, Any]:
        """A raw JetStream API request: its answer, or `BusError` naming `what` failed."""
        try:
            reply = await self._nc.request(
                subject, msgspec.json.encode(request), timeout=_JS_API_TIMEOUT_S
            )
            answer = msgspec.json.decode(reply.data)
        except (TimeoutError, nats.errors.Error, msgspec.DecodeError) as exc:
            raise BusError(f"{what}: {_why(exc)}") from exc
        if not isinstance(answer, dict):
            raise BusError(f"{what}: JetStream answered {reply.data[:200]!r}")
        error = answer.get("error")
        if error is not None:
            refusal = _api_error(error)
            raise BusError(f"{what}: {_why(refusal)}") from refusal
        return answer

    async def open_partition_log(self, stream: str, prefix: str) -> None:
        """Create the replicated stream of the partitions' logs if absent: one subject per
        partition (`partition_log_subject`), appended with `append_expecting`. It keeps every
        entry until a snapshot rolls its subject up (`Nats-Rollup: sub`), so it takes rollup
        headers and atomic batches. A stream of an earlier version (an age limit, no rollups,
        no batches) is updated in place."""
        config = StreamConfig(
            name=stream,
            subjects=[f"{prefix}.log.*"],
            retention=RetentionPolicy.LIMITS,
            duplicate_window=120.0,
            num_replicas=self.replicas,
            # Snapshots roll a partition's subject up, as one message or one atomic batch.
            allow_rollup_hdrs=True,
            allow_atomic=True,
        )
        try:
            try:
                info = await self._js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                await self._create_stream(config, "log stream", "--log-stream")
                logger.info("created stream %s for %s, R%d", stream, config.subjects, self.replicas)
                return
            old = info.config
            _check_stream(old, config, "log stream", "--log-stream")
            if old.max_age or not old.allow_rollup_hdrs or not old.allow_atomic:
                # An age limit would drop an open handoff's entries that no snapshot holds yet.
                old.max_age, old.allow_rollup_hdrs, old.allow_atomic = None, True, True
                await self._js.update_stream(old)
                logger.info("stream %s now keeps its entries until rolled up", stream)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot open partition log stream {stream}: {_why(exc)}") from exc

    async def last_sequence(self, stream: str, subject: str) -> int:
        """The stream sequence of the last message on `subject`; 0 if it has none."""
        try:
            message = await self._js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            return 0
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot read the last message on {subject}: {_why(exc)}") from exc
        seq = message.seq
        if seq is None:
            raise BusError(f"the last message on {subject} came without its sequence")
        return seq

    async def read_subject(self, stream: str, subject: str) -> list[tuple[int, bytes]]:
        """Every message stored on `subject`, as (stream sequence, payload), in order: what a
        new owner reads to catch up. Through an ephemeral consumer (in memory, one replica,
        gone once read) pulled with `no_wait`, so it returns once it has what was stored when
        it asked; what is appended meanwhile is left to the caller's compare-and-set. A cluster
        may place that consumer on a replica that lags the leader (a node that restarted
        catches up for seconds), so the read is made again until it reaches the subject's last
        message as the leader has it: an owner that claimed from a stale read would fence
        itself on its own last appends."""
        last = await self.last_sequence(stream, subject)
        clock = asyncio.get_running_loop().time
        give_up = clock() + _STALE_READ_GIVE_UP_S
        while True:
            found = await self._read_subject_once(stream, subject)
            read = found[-1][0] if found else 0
            if read >= last:
                return found
            if clock() > give_up:
                raise BusError(
                    f"cannot read {subject} of {stream} up to its last message {last}: the "
                    f"replica read holds up to {read} after {_STALE_READ_GIVE_UP_S:g}s"
                )
            await asyncio.sleep(_JS_READY_POLL_S)

    async def _read_subject_once(self, stream: str, subject: str) -> list[tuple[int, bytes]]:
        config = ConsumerConfig(
            filter_subject=subject,
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL,
            inactive_threshold=_READER_IDLE_S,
            mem_storage=True,
            num_replicas=1,
        )
        try:
            info = await self._js.add_consumer(stream, config)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot read {subject} of {stream}: {_why(exc)}") from exc
        found: list[tuple[int, bytes]] = []
        clock = asyncio.get_running_loop().time
        give_up = clock() + _JS_API_TIMEOUT_S
        try:
            async with Pull(self, stream, info.name, max_ahead=_READ_BATCH, no_wait=True) as reader:
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
                await self._js.delete_consumer(stream, info.name)  # else it idles away
        return found

    async def unacknowledged(
        self, stream: str, consumer: str, held: Callable[[], Mapping[int, str]] | None = None
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
            info = await self._js.consumer_info(stream, consumer)
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
                    message = await self._js.get_msg(stream, seq, subject=filter_subject, next=True)
                except nats.js.errors.NotFoundError:
                    break  # none left from seq on
                if message.seq is None or message.subject is None or message.seq > top:
                    break
                found.append((message.seq, message.subject))
                seq = message.seq + 1
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(
                f"cannot read what {stream} / {consumer} left unacknowledged: {_why(exc)}"
            ) from exc
        return found

    async def append_expecting(
        self, subject: str, payload: bytes, last_seq: int, *, give_up_after_s: float = 5.0,
        rollup: bool = False,
    ) -> int:  # fmt: skip
        """Append `payload` to `subject` only if the subject's last message is still at
        `last_seq` (0: it has none); the new message's sequence. `Fenced` if another writer
        appended first, `BusError` if no stream took it within `give_up_after_s`. Attempts
        share one `Nats-Msg-Id` (see "Fencing" and `_store`). With `rollup`, the stream drops
        the subject's earlier messages as it stores this one, in the same compare-and-set
        (`Nats-Rollup: sub`: only this subject, never the stream)."""
        headers = {"Nats-Msg-Id": uuid.uuid4().hex, _EXPECTED_LAST_SUBJECT_SEQ: str(last_seq)}
        if rollup:
            headers[_ROLLUP] = _ROLLUP_SUBJECT
        what = f"append to {subject} expecting last sequence {last_seq}"
        return await self._store(subject, payload, headers, give_up_after_s, what)

    async def roll_up_batch(
        self, subject: str, payloads: Sequence[bytes], last_seq: int, *, timeout_s: float = 15.0
    ) -> int:
        """Store `payloads` on `subject` as one JetStream atomic batch (all or none), which
        replaces the subject's earlier messages, only if its last message is still at
        `last_seq`: a roll-up too large for one message. The batch's last sequence. `Fenced`
        if another writer appended first (the whole batch is refused), `BusError` otherwise:
        whether a batch whose commit went unanswered landed is unknown (a retry under a new
        batch id would be refused as a stale write if it had), so it is not retried here; the
        caller reads the log to learn it."""
        if not payloads or len(payloads) > MAX_BATCH_MESSAGES:
            raise BusError(
                f"a batch to {subject} has {len(payloads)} messages; JetStream takes 1 to "
                f"{MAX_BATCH_MESSAGES}"
            )
        batch_id = uuid.uuid4().hex
        what = f"atomic batch of {len(payloads)} to {subject} expecting last sequence {last_seq}"
        try:
            async with asyncio.timeout(timeout_s):
                for index, payload in enumerate(payloads, start=1):
                    headers = {_BATCH_ID: batch_id, _BATCH_SEQUENCE: str(index)}
                    if index == 1:
                        headers[_ROLLUP] = _ROLLUP_SUBJECT
                        headers[_EXPECTED_LAST_SUBJECT_SEQ] = str(last_seq)
                    if index < len(payloads):
                        # Only the commit is answered with the outcome; the first is asked
                        # too, so that a stream that refuses batches says so at once.
                        if index == 1:
                            await self._nc.request(
                                subject, payload, timeout=timeout_s, headers=headers
                            )
                        else:
                            await self._nc.publish(subject, payload, headers=headers)
                        continue
                    headers[_BATCH_COMMIT] = "1"
                    reply = await self._nc.request(
                        subject, payload, timeout=timeout_s, headers=headers
                    )
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"{what} failed: {_why(exc)}") from exc
        ack = _STORED_ACK.decode(reply.data)
        if ack.error is not None:
            if ack.error.err_code in _WRONG_LAST_SEQUENCE:
                raise Fenced(
                    f"{what} was refused: another writer appended first ({ack.error.description})"
                )
            raise BusError(f"{what} was refused: {ack.error.description}")
        return ack.seq

    async def announce(self, member: Member, tier: str) -> Membership:
        """Announce `member` of `tier` in `MEMBERS_BUCKET` (created if absent); keep it with
        `keep`.
        Retried for `_ANNOUNCE_GIVE_UP_S` while no stream answers: a bucket that another
        worker just made in a cluster answers on every node only once its interest spread."""
        clock = asyncio.get_running_loop().time
        give_up = clock() + _ANNOUNCE_GIVE_UP_S
        while True:
            try:
                kv = await self._members_bucket()
                ttl_s = (await kv.status()).ttl
                if not ttl_s:
                    raise BusError(
                        f"member bucket {MEMBERS_BUCKET} has no TTL, so a dead worker would "
                        "count as live for ever; delete the bucket and let the worker create it"
                    )
                await kv.put(member_key(tier, member.instance), _MEMBER_ENCODER.encode(member))
                return Membership(self._nc, kv, tier, member, ttl_s)
            except (*_RETRYABLE, nats.js.errors.ServiceUnavailableError) as exc:
                if clock() > give_up:
                    raise BusError(
                        f"cannot announce {member.instance} in {MEMBERS_BUCKET}: {_why(exc)}"
                    ) from exc
            except (TimeoutError, nats.errors.Error) as exc:
                raise BusError(
                    f"cannot announce {member.instance} in {MEMBERS_BUCKET}: {_why(exc)}"
                ) from exc
            await asyncio.sleep(_JS_READY_POLL_S)

    async def members(self, tier: str) -> list[Member]:
        """The workers of `tier` announced and not expired, oldest first; values that are not
        a `Member` (written by something else) are skipped with a warning."""
        found: list[Member] = []
        try:
            kv = await self._members_bucket()
            # The keys from the stream's own count per subject, answered by its leader: nats-py's
            # `keys()` lists them through a consumer made for the purpose, which can come up
            # empty when a refresh replaces a key's message just as it is made.
            prefix = f"$KV.{MEMBERS_BUCKET}."
            info = await self._js.stream_info(
                f"KV_{MEMBERS_BUCKET}", subjects_filter=f"{prefix}{member_key(tier, '*')}"
            )
            keys = [subject.removeprefix(prefix) for subject in info.state.subjects or {}]
            for key in keys:
                try:
                    entry = await kv.get(key)
                except nats.js.errors.KeyNotFoundError:
                    continue  # it expired or left between the two requests
                try:
                    found.append(_MEMBER_DECODER.decode(entry.value or b""))
                except msgspec.DecodeError as exc:
                    logger.warning("ignored key %s of %s: %s", key, MEMBERS_BUCKET, exc)
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot list the members in {MEMBERS_BUCKET}: {exc}") from exc
        return sorted(found, key=lambda m: (m.since_ms, m.instance))

    async def _members_bucket(self) -> KeyValue:
        try:
            return await self._js.key_value(MEMBERS_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            return await self._js.create_key_value(
                KeyValueConfig(
                    bucket=MEMBERS_BUCKET,
                    description="kvhandoff: the live workers of the tier",
                    history=1,
                    ttl=MEMBER_TTL_S,
                    replicas=self.replicas,
                    # Reads from the stream's leader only: a replica's direct get may answer
                    # from before the latest refresh, or after its own clock expired the key,
                    # and a live worker would drop out of a listing now and then.
                    direct=False,
                )
            )

    # --- Engine leases (issue #34; used by client.lease and worker.tier.leases) -----------------

    async def open_lease_bucket(self, bucket: str, marker_ttl_s: float) -> None:
        """Create the lease bucket's stream if absent: a KV bucket (`$KV.<bucket>.<key>`, one
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
            num_replicas=self.replicas,
        )
        try:
            try:
                await self._js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                await self._js.add_stream(config)
                logger.info("created lease bucket %s, R%d", bucket, self.replicas)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _STREAM_NAME_IN_USE:  # another process created it just now
                raise BusError(f"cannot open lease bucket {bucket}: {_why(exc)}") from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot open lease bucket {bucket}: {_why(exc)}") from exc

    async def put_lease(
        self, bucket: str, key: str, value: bytes, ttl_s: float, *, give_up_after_s: float
    ) -> None:
        """Store `value` under `key` for `ttl_s` (whole milliseconds); `BusError` if it could not
        be stored within `give_up_after_s`."""
        headers = {"Nats-Msg-Id": uuid.uuid4().hex, "Nats-TTL": f"{round(ttl_s * 1000)}ms"}
        await self._store(
            f"$KV.{bucket}.{key}", value, headers, give_up_after_s, f"lease {key} in {bucket}"
        )

    async def watch_leases(
        self, bucket: str, on_entry: Callable[[str, bytes | None], None]
    ) -> Subscription:
        """Call `on_entry(key, value)` for the last message of every key of the lease bucket,
        then for every later one, in stream order; `value` is None for a delete marker (the key
        expired or was deleted). Returns once every key's current message was delivered."""
        prefix = f"$KV.{bucket}."
        caught_up = asyncio.get_running_loop().create_future()

        async def deliver(msg: Msg) -> None:
            headers = msg.headers or {}
            expired = "Nats-Marker-Reason" in headers or headers.get("KV-Operation") in {
                "DEL",
                "PURGE",
            }
            on_entry(msg.subject.removeprefix(prefix), None if expired else msg.data)
            if msg.metadata.num_pending == 0 and not caught_up.done():
                caught_up.set_result(None)

        try:
            info = await self._js.stream_info(f"KV_{bucket}")
            subscription = await self._js.subscribe(
                f"{prefix}>",
                cb=deliver,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            )
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(f"cannot watch lease bucket {bucket}: {_why(exc)}") from exc
        if info.state.messages:
            try:
                await asyncio.wait_for(caught_up, _JS_API_TIMEOUT_S)
            except TimeoutError:
                # The messages counted expired meanwhile, or arrive late: the watch goes on.
                logger.warning("lease bucket %s: not read to its end yet", bucket)
        return Subscription(subscription, f"{prefix}>")

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
            logger.warning("NATS connection lost while closing: %s", _why(exc))
