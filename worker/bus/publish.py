"""Publishing, and knowing what the server has: the barrier, JetStream publishes, and
compare-and-set appends.

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

A roll-up too large for one message goes as one JetStream atomic batch (`roll_up_batch`,
ADR-50): all of it is stored, with the same compare-and-set, or none of it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from kvhandoff.worker.ambient import new_id
from kvhandoff.worker.bus.failures import DESCRIPTION, RETRYABLE, STATUS, why
from kvhandoff.worker.errors import BusError, Fenced

_PUBLISH_ACK_TIMEOUT_S = 2.0
_PUBLISH_BACKOFF_S = (0.05, 2.0)  # first and longest pause between attempts
_BARRIER_TIMEOUT_S = 5.0
_STORED_SWEEP_MIN = 4096  # acks awaited before `publish_stored` first drops those given up on
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


class _ApiError(msgspec.Struct, frozen=True):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _StoredAck(msgspec.Struct, frozen=True):
    """A stream's answer to a JetStream publish (its `PubAck`, or the error it refused it with)."""

    seq: int = 0
    error: _ApiError | None = None


_STORED_ACK = msgspec.json.Decoder(_StoredAck)


class Publishing:
    """What a `Bus` publishes and how it learns that the server has it: the part of the Bus
    (its base class) that owns the barrier and the acks awaited, per connection."""

    def __init__(self, client: Client) -> None:
        self._nc = client
        self._js = client.jetstream()
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
        self._connection = 0  # counts reconnects
        # The connection that the oldest `publish` not yet covered by a `flush` was made on.
        self._unflushed_on: int | None = None

    async def _start_publishing(self) -> None:
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
        if status := headers.get(STATUS):  # 503: no stream takes the subject
            description = headers.get(DESCRIPTION, "")
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

    def _count_reconnect(self) -> None:
        """NATS reconnected: what the old connection carried may be lost (see "The barrier")."""
        self._connection += 1
        stored, self._stored = self._stored, {}
        for ack in stored.values():
            if not ack.done():
                ack.set_exception(
                    BusError("NATS reconnected before a stream acknowledged a message")
                )

    @property
    def connection(self) -> int:
        """How many times the client reconnected: what was published under an earlier count
        may have died with its connection (see "The barrier")."""
        return self._connection

    async def publish(self, subject: str, payload: bytes) -> None:
        """Core NATS publish: buffered, in order with everything else on this connection."""
        if self._unflushed_on is None:
            self._unflushed_on = self._connection
        try:
            await self._nc.publish(subject, payload)
        except nats.errors.Error as exc:
            raise BusError(f"publish to {subject} failed: {why(exc)}") from exc

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
            raise BusError(f"flush failed: {why(exc)}") from exc
        finally:
            self._barriers.pop(token, None)
        if reconnects:
            for future in unconfirmed:
                future.cancel()
            raise BusError(
                f"flush failed: NATS reconnected ({reconnects} time(s)) after messages it "
                "covers were published, so the server may never have read them"
            )

    async def publish_durable(
        self,
        subject: str,
        payload: bytes,
        *,
        give_up_after_s: float = 5.0,
        msg_id: str | None = None,
    ) -> None:
        """JetStream publish: returns once the stream stored the message. Retried with backoff
        (see `_store`); `BusError` after `give_up_after_s`, or at once on an error that no retry
        can fix (the stream refused the message). `msg_id` names the message for the stream's
        duplicate window where two publishers may send the same one (a lease's answers)."""
        headers = {"Nats-Msg-Id": msg_id or new_id()}
        await self._store(
            subject, payload, headers, give_up_after_s, f"durable publish to {subject}"
        )

    async def _store(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str],
        give_up_after_s: float,
        what: str,
    ) -> int:
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
                        f"{what} was refused: another writer appended first ({why(exc)})"
                    ) from exc
                if exc.err_code != _OWN_ATTEMPT_IN_FLIGHT and not isinstance(
                    exc, (*RETRYABLE, nats.js.errors.ServiceUnavailableError)
                ):
                    raise BusError(f"{what} failed: {why(exc)}") from exc
                failure: Exception = exc
            except RETRYABLE as exc:
                failure = exc
            except nats.errors.Error as exc:
                raise BusError(f"{what} failed: {why(exc)}") from exc
            if loop.time() + backoff_s >= give_up_at:
                raise BusError(
                    f"{what} failed for {give_up_after_s:g}s: {why(failure)}"
                ) from failure
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, _PUBLISH_BACKOFF_S[1])

    async def publish_stored(self, subject: str, payload: bytes) -> asyncio.Future[int]:
        """JetStream publish whose ack the next `flush` awaits: many can be in flight at once.
        Returns the ack (the stored message's sequence, or a `BusError`), for `confirm`."""
        token = str(next(self._stored_count))
        ack: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        try:
            await self._nc.publish(subject, payload, reply=f"{self._stored_inbox}.{token}")
        except nats.errors.Error as exc:
            raise BusError(f"durable publish to {subject} failed: {why(exc)}") from exc
        self._stored[token] = ack
        if len(self._stored) > self._stored_sweep_at:
            # An ack never comes for a message that a stream's leader change lost: those that
            # `flush` or `confirm` gave up on (cancelled) are dropped here.
            self._stored = {t: f for t, f in self._stored.items() if not f.done()}
            self._stored_sweep_at = max(_STORED_SWEEP_MIN, 2 * len(self._stored))
        self._unconfirmed.append(ack)
        return ack

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
        for ack in stored:
            if ack in pending:  # in the order published, not a set's (the futures' addresses')
                ack.cancel()  # given up on: swept from the acks awaited
        failed = [ack for ack in done if ack.cancelled() or ack.exception() is not None]
        if pending or failed:
            raise BusError(
                f"flush failed: a stream did not store {len(pending) + len(failed)} of "
                f"{len(stored)} messages (no answer within {_BARRIER_TIMEOUT_S}s, or refused)"
            )

    async def append_expecting(
        self,
        subject: str,
        payload: bytes,
        last_seq: int,
        *,
        give_up_after_s: float = 5.0,
        rollup: bool = False,
    ) -> int:
        """Append `payload` to `subject` only if the subject's last message is still at
        `last_seq` (0: it has none); the new message's sequence. `Fenced` if another writer
        appended first, `BusError` if no stream took it within `give_up_after_s`. Attempts
        share one `Nats-Msg-Id` (see "Fencing" and `_store`). With `rollup`, the stream drops
        the subject's earlier messages as it stores this one, in the same compare-and-set
        (`Nats-Rollup: sub`: only this subject, never the stream)."""
        headers = {"Nats-Msg-Id": new_id(), _EXPECTED_LAST_SUBJECT_SEQ: str(last_seq)}
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
        batch_id = new_id()
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
            raise BusError(f"{what} failed: {why(exc)}") from exc
        ack = _STORED_ACK.decode(reply.data)
        if ack.error is not None:
            if ack.error.err_code in _WRONG_LAST_SEQUENCE:
                raise Fenced(
                    f"{what} was refused: another writer appended first ({ack.error.description})"
                )
            raise BusError(f"{what} was refused: {ack.error.description}")
        return ack.seq
