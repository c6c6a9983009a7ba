"""One connection to the bus for engines and frontends, and the seam where `worker.bus`'s errors
become the client's (`BusError` → `BusUnavailable`, `BusRefused` → `Refused`).

It holds a `worker.bus.connection.Bus` (the package that talks to nats-py) and offers what the
roles need from it in the wire vocabulary: inputs stored with JetStream, actions and completions
decoded, the last completion a stream keeps, scatter-gather for reports. Every engine and the
frontend of a process can share one connection. A message that does not decode is logged and
skipped here, so the handlers get typed messages only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import NoReturn

import msgspec

from kvhandoff.client.errors import BusUnavailable, Refused
from kvhandoff.events.codec import decode_action, decode_rejection, encode
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import Action, Complete, Input, Rejection
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus, Message, Subscription
from kvhandoff.worker.bus.kv import open_expiring_bucket, put_expiring
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.bus.streams import last_message
from kvhandoff.worker.errors import BusError, BusRefused

logger = logging.getLogger(__name__)

# How long an input is retried while NATS or the input stream does not answer.
DEFAULT_PUBLISH_GIVE_UP_S = 30.0
# How long the lease bucket remembers that a lease expired (its delete marker), so that a
# worker that starts, or claims a partition, meanwhile learns that the engine is gone.
LEASE_MARKER_TTL_S = 24 * 3600.0

ActionHandler = Callable[[Action], Awaitable[None]]
CompleteHandler = Callable[[Complete], Awaitable[None]]
RejectionHandler = Callable[[Rejection], Awaitable[None]]


def _translated(exc: BusError, doing: str | None) -> NoReturn:
    """Raise the client's error for `exc`, prefixed with what we were `doing` unless the bus's
    message says it already."""
    message = str(exc) if doing is None else f"{doing}: {exc}"
    if isinstance(exc, BusRefused):
        raise Refused(message) from exc
    raise BusUnavailable(message) from exc


class Watch:
    """A subscription made by the connection, until `close`."""

    def __init__(self, subscription: Subscription) -> None:
        self._subscription = subscription

    async def close(self) -> None:
        try:
            await self._subscription.unsubscribe()
        except BusError as exc:
            _translated(exc, "unsubscribe")


class Connection:
    """One NATS connection with the shared `--nats-*`/`--tls-*` settings. Open it with `open`
    (an async context manager that closes it), or `open_unless` to give up on a stop event."""

    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        """Adopt a connected `Bus` (closed by `close`), on the subjects of `subjects`."""
        self._bus = bus
        self.subjects = subjects
        self._lease_bucket_open = False

    @classmethod
    async def open(cls, settings: NatsSettings, name: str) -> Connection:
        """Connect, retrying while no server answers; `Refused` at once if NATS refuses us.
        Cancel the call to give up."""
        try:
            bus = await Bus.connect(settings, name)
        except BusError as exc:
            _translated(exc, None)  # the bus's message names the server
        return cls(bus, Subjects(settings.subject_prefix))

    @classmethod
    async def open_unless(
        cls, stop: asyncio.Event, settings: NatsSettings, name: str
    ) -> Connection | None:
        """`open`, or None if `stop` is set first (a signal while NATS does not answer)."""
        try:
            bus = await Bus.connect_unless(stop, settings, name)
        except BusError as exc:
            _translated(exc, None)  # the bus's message names the server
        return None if bus is None else cls(bus, Subjects(settings.subject_prefix))

    async def close(self) -> None:
        """Flush what was published, then disconnect."""
        await self._bus.close()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    def on_reconnect(self, listener: Callable[[], None]) -> None:
        """Call `listener` after every reconnect: core messages sent meanwhile were lost."""
        self._bus.on_reconnect(listener)

    # --- Inputs ---------------------------------------------------------------------------

    async def send(
        self, message: Input, *, give_up_after_s: float = DEFAULT_PUBLISH_GIVE_UP_S
    ) -> None:
        """Store an input in the worker's input stream (a JetStream publish, retried with
        backoff under one message id, so a retry is stored once)."""
        await self.send_encoded(message, encode(message), give_up_after_s=give_up_after_s)

    async def send_encoded(
        self, message: Input, payload: bytes, *, give_up_after_s: float = DEFAULT_PUBLISH_GIVE_UP_S
    ) -> None:
        """`send` with the payload already encoded (`events.codec.encode(message)`)."""
        subject = self.subjects.input(message.handoff_id)
        try:
            await self._bus.publish_durable(subject, payload, give_up_after_s=give_up_after_s)
        except BusError as exc:
            _translated(exc, f"handoff {message.handoff_id}: storing {_tag(message)}")

    # --- Leases (issue #34; client.lease) --------------------------------------------------

    async def put_lease(
        self, engine_id: str, value: bytes, ttl_s: float, *, give_up_after_s: float
    ) -> None:
        """Store an engine's lease for `ttl_s` in the lease bucket, created if absent."""
        bucket = self.subjects.lease_bucket
        try:
            if not self._lease_bucket_open:
                await open_expiring_bucket(self._bus, bucket, LEASE_MARKER_TTL_S)
                self._lease_bucket_open = True
            await put_expiring(
                self._bus, bucket, engine_id, value, ttl_s, give_up_after_s=give_up_after_s
            )
        except BusError as exc:
            _translated(exc, f"{engine_id}: renewing its lease")

    # --- Subscriptions --------------------------------------------------------------------

    async def watch_actions(
        self, engine_id: str, handler: ActionHandler, on_malformed: Callable[[], None]
    ) -> Watch:
        """Every action sent to `engine_id`, decoded; registered once `flush` returns. A
        message that does not decode is logged, `on_malformed` is told, and it is dropped. A
        request with an empty body is a presence probe (`engine_listening`): answered, empty."""

        async def deliver(msg: Message) -> None:
            if not msg.data and msg.reply:
                try:
                    await self._bus.publish(msg.reply, b"")
                except BusError as exc:
                    logger.warning("%s could not answer a presence probe: %s", engine_id, exc)
                return
            try:
                action = decode_action(msg.data)
            except msgspec.DecodeError as exc:
                logger.warning("%s ignored an undecodable action: %s", engine_id, exc)
                on_malformed()
                return
            await handler(action)

        return await self._subscribe(self.subjects.engine(engine_id), deliver)

    async def watch_completions(self, handler: CompleteHandler) -> Watch:
        """Every `Complete` of every handoff on the bus, as core NATS delivers them."""

        async def deliver(msg: Message) -> None:
            try:
                action = decode_action(msg.data)
            except msgspec.DecodeError as exc:
                logger.warning("ignored an undecodable message on %s: %s", msg.subject, exc)
                return
            if isinstance(action, Complete):
                await handler(action)

        return await self._subscribe(self.subjects.all_done, deliver)

    async def watch_rejections(self, handler: RejectionHandler) -> Watch:
        """Every `Rejection` the worker publishes."""

        async def deliver(msg: Message) -> None:
            try:
                rejection = decode_rejection(msg.data)
            except msgspec.DecodeError as exc:
                logger.warning("ignored an undecodable rejection on %s: %s", msg.subject, exc)
                return
            await handler(rejection)

        return await self._subscribe(self.subjects.all_rejected, deliver)

    async def last_complete(self, stream: str, handoff_id: HandoffId) -> Complete | None:
        """The last `Complete` that the completion stream keeps for the handoff, or None (not
        completed, completed longer ago than the stream keeps, or no stream yet)."""
        subject = self.subjects.done(handoff_id)
        data = await self._last_kept(stream, subject, f"the completion of handoff {handoff_id}")
        if data is None:
            return None
        try:
            action = decode_action(data)
        except msgspec.DecodeError as exc:
            logger.warning("handoff %s: undecodable completion in %s: %s", handoff_id, stream, exc)
            return None
        return action if isinstance(action, Complete) else None

    async def last_rejection(self, stream: str, handoff_id: HandoffId) -> Rejection | None:
        """The last `Rejection` that the rejection stream keeps for the handoff, or None (none
        rejected, rejected longer ago than the stream keeps, or no stream yet: a tier of an
        earlier version)."""
        subject = self.subjects.rejected(handoff_id)
        data = await self._last_kept(stream, subject, f"the rejections of handoff {handoff_id}")
        if data is None:
            return None
        try:
            return decode_rejection(data)
        except msgspec.DecodeError as exc:
            logger.warning("handoff %s: undecodable rejection in %s: %s", handoff_id, stream, exc)
            return None

    async def _last_kept(self, stream: str, subject: str, what: str) -> bytes | None:
        """The last message `stream` keeps on `subject` (`what` it is), or None."""
        try:
            return await last_message(self._bus, stream, subject)
        except BusError as exc:
            _translated(exc, f"reading {what}")

    async def engine_listening(self, engine_id: str, *, wait_s: float = 1.0) -> bool:
        """Whether an engine client listens to `engine_id`'s actions: it answers a request with
        an empty body there within `wait_s`. (The worker never sends an empty action.)"""
        replies = await self.gather(
            self.subjects.engine(engine_id), first_reply_s=wait_s, quiet_s=0.0
        )
        return bool(replies)

    async def flush(self) -> None:
        """Return once the server has everything sent so far, subscriptions included."""
        try:
            await self._bus.flush()
        except BusError as exc:
            _translated(exc, "flush")

    # --- Scatter-gather, for reports ------------------------------------------------------

    async def answer(self, subject: str, report: Callable[[], bytes]) -> Watch:
        """Answer every request on `subject` with `report()`."""

        async def reply(msg: Message) -> None:
            if msg.reply:
                try:
                    await self._bus.publish(msg.reply, report())
                except BusError as exc:
                    logger.warning("could not answer on %s: %s", subject, exc)

        return await self._subscribe(subject, reply)

    async def gather(self, subject: str, *, first_reply_s: float, quiet_s: float) -> list[bytes]:
        """Ask on `subject` and collect the replies: up to `first_reply_s` for the first, then
        until `quiet_s` passes without one."""
        try:
            return await self._bus.gather(
                subject, b"", first_reply_s=first_reply_s, quiet_s=quiet_s
            )
        except BusError as exc:
            _translated(exc, f"gathering replies on {subject}")

    async def _subscribe(
        self, subject: str, deliver: Callable[[Message], Awaitable[None]]
    ) -> Watch:
        try:
            return Watch(await self._bus.subscribe(subject, deliver))
        except BusError as exc:
            _translated(exc, f"subscribing to {subject}")


def _tag(message: Input) -> str:
    tag = type(message).__struct_config__.tag
    return str(tag)
