"""The lean JetStream pull: a durable consumer's messages, delivered and settled one by one.

The inbox. Inputs are captured by a JetStream stream with work-queue retention (an input leaves
the stream once the worker acknowledges it, which it does only after the input is in the event
log) and consumed through one durable pull consumer per partition with explicit acks (see
"Partitions" and "Pins" in worker.tier.streams). JetStream redelivers an unacknowledged input
only after the ack wait, while newer inputs keep flowing, so a new owner would see inputs out of
order (a fact before the outcome it depends on); it reads what was delivered and never
acknowledged first (worker.bus.streams.unacknowledged, worker.tier.owner's "Order").

The pull. nats-py's `fetch` costs about 110 µs per message (a task and a `wait_for` each), so
`Pull` speaks the pull protocol itself. It subscribes once to `<inbox>.*` and publishes pull
requests (`PullRequest`) to `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`, each with its own
reply subject `<inbox>.<n>`. The server sends the messages to that subscription (nats-py's
parser hands them to the Pull directly: `Deliveries`), each with its
`$JS.ACK...` reply subject, which `Inbound` reads once for its metadata and publishes `+ACK` or
`-NAK` to. It also sends status messages there, header only (`NATS/1.0 <code>
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

`Inbound` is one delivered input; `Pull` keeps a consumer's messages requested ahead; and
`Deliveries` hands what the server sends to each Pull's inbox straight from nats-py's parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from typing import TYPE_CHECKING

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription as NatsSubscription

from kvhandoff.worker.ambient import monotonic_s
from kvhandoff.worker.bus.failures import DESCRIPTION, STATUS, why
from kvhandoff.worker.errors import BusError, ConfigError, PinMismatch

if TYPE_CHECKING:
    from kvhandoff.worker.bus.connection import Bus

logger = logging.getLogger(__name__)

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
                f"{how} of input {self.subject} (stream seq {self.stream_seq}) failed: {why(exc)}"
            ) from exc


_PENDING_MESSAGES = "Nats-Pending-Messages"
_PENDING_BYTES = "Nats-Pending-Bytes"
_PIN_ID_LINE = b"\r\nNats-Pin-Id:"  # how a raw header block spells the header's start
_REQUESTS_KEPT = 64  # open requests remembered by reply token, newest first
_S_TO_NS = 1_000_000_000
# Without heartbeats, an open request is counted lost once nothing was heard of it for its
# whole expiry and this much more.
_LOST_GRACE_S = 5.0


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
        self.resets = 0  # reconnects since the Pull started (`reset`)
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
            raise BusError(f"pull from {self.consumer}: cannot subscribe: {why(exc)}") from exc
        self._bus._deliveries.route(self._subscription, self)  # and a reconnect resets it

    async def close(self) -> None:
        """Unsubscribe; the server drops the open requests once it cannot deliver to them."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            self._bus._deliveries.unroute(subscription)
            try:
                await subscription.unsubscribe()
            except nats.errors.Error as exc:
                raise BusError(f"pull from {self.consumer}: {why(exc)}") from exc

    async def __aenter__(self) -> Pull:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def fetch(
        self,
        max_messages: int,
        timeout_s: float,
        *,
        max_bytes: int | None = None,
        overhead: int = 0,
    ) -> list[Inbound]:
        """Up to `max_messages` messages in stream order: at once those ready, if any; else the
        first to arrive within `timeout_s`, or []. With `max_bytes`, the messages' payloads and
        `overhead` bytes each add up to at most that, but for a first message that alone is
        more (the rest stay ready for the next call). Raises the `BusError` that a status
        reported since the last call (the next call asks again)."""
        if self._subscription is None:
            raise BusError(f"pull from {self.consumer}: fetch before start or after close")
        self._ahead = min(self._max_ahead, 2 * max_messages)
        deadline = monotonic_s() + timeout_s
        while True:
            # Cleared before looking, so that whatever arrives while we ask wakes the wait.
            self._changed.clear()
            self._raise_failure()
            if self._ready:
                break
            if self._empty or self._woken:
                self._empty = self._woken = False
                return []
            now = monotonic_s()
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
        that stayed up resumes them, which costs at most a batch more than `max_ahead`).
        Counted in `resets`: what the server sent on the lost connection never arrives, and
        comes again only after its ack wait, behind what is delivered on the new one."""
        self.resets += 1
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
            raise BusError(f"pull request to {self.consumer} failed: {why(exc)}") from exc
        self._open[token] = batch
        if len(self._open) > _REQUESTS_KEPT:
            # The oldest have long ended: a request that is served in full ends silently.
            del self._open[next(iter(self._open))]
        self._pending += batch
        self._empty = False
        self._heard_at = monotonic_s()

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
        straight from nats-py's parser (see `Deliveries`)."""
        self._heard_at = monotonic_s()
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
        self._heard_at = monotonic_s()
        self._changed.set()
        token = subject.rpartition(b".")[2].decode("ascii", "replace")
        status = headers.get(STATUS, "")
        description = headers.get(DESCRIPTION, "").strip()
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


class Deliveries:
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
    itself stays nats-py's (its SUB, its resubscription after a reconnect, its UNSUB). These
    names, and `Subscription._id` by which a message's sid is told, are nats-py internals (read
    in 2.15 and 2.16, the releases pyproject.toml allows): tests/worker/test_nats_privates.py checks
    that the installed nats-py has them, and were they to change, no Pull would receive
    anything, and every test of tests/worker/test_pull.py would say so too.

    The routes are also the Bus's started Pulls, which `reset` resets after a reconnect."""

    def __init__(self, client: Client) -> None:
        self._routes: dict[int, Pull] = {}
        self._process_msg = client._process_msg
        self._process_headers = client._process_headers
        client._process_msg = self._process  # type: ignore[method-assign]

    def route(self, subscription: NatsSubscription, pull: Pull) -> None:
        self._routes[subscription._id] = pull

    def unroute(self, subscription: NatsSubscription) -> None:
        self._routes.pop(subscription._id, None)

    def reset(self) -> None:
        """Forget every routed Pull's open requests (NATS reconnected)."""
        for pull in self._routes.values():
            pull.reset()

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
