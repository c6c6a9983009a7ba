"""The frontend client: start handoffs, wait for how each ended, cancel them, read their state.

Theory of operation
-------------------
`Frontend.open` subscribes once to every `Complete` (`<prefix>.done.>`) and every `Rejection`
(`<prefix>.rejected.>`) and waits until the server registered both; only then can a handoff be
started. One subscription serves every handoff, so `start` is a single JetStream publish, with
no subscription and no round trip of its own. The price: a frontend sees the completions of
handoffs that other frontends started, and drops them.

No window for a missed `Complete`. A `Complete` is published with core NATS semantics to
subscribers and stored in the worker's completion stream (`KVHANDOFF_DONE` by default; a tier
of another input stream has its own, `events.subjects.done_stream_of`), which keeps each
handoff's last one for `--completion-ttl`. Core delivery can miss one in two cases only: the
subscription did not exist yet (a handoff started elsewhere, or before this frontend
subscribed), or the connection was down when it went by. So `wait` reads the stream's last
completion of the handoff whenever either may have happened: for a handoff this frontend did
not start since its subscription, and after every reconnect (nats-py subscribes again before it
reports the reconnect, so what the stream lacks at that read, the subscription delivers). A read
that fails (in a cluster, a node died and the stream is electing a new leader) is made again
after a pause, until the wait's timeout.

Nor for a rejected start. The worker's rejection stream (named after the completion stream,
`KVHANDOFF_REJECTED`: `events.subjects.rejections_stream_of`) keeps each handoff's last
`Rejection` as long, and the same reads of the completion stream read it too: a rejected
`StartHandoff` raises `HandoffRejected` in `wait` even if its rejection went by while the
connection was down. (Against a tier of an earlier version, which has no such stream, that
wait ends at its timeout.)

Which `Complete` ends a wait. A handoff can complete twice: a terminal fact after a success
reopens the cleanup and it completes again as canceled (see `docs/handoff.md`, "Cleanup"). `wait`
returns the first `Complete` seen, except for a handoff this frontend canceled: a `Canceled`
fact always ends in a `Complete(canceled)`, even when it crossed the success, so `wait` returns
that one, unless the worker rejects the cancel, which then changed nothing. A rejected
`StartHandoff` raises `HandoffRejected`. (A cancel's rejection is heard by core NATS only: the
stream keeps one rejection of a handoff, the last, and cannot tell an earlier cancel's from
this one's. So a wait whose cancel's rejection went by while the connection was down ends
at its timeout.)

`state` reads the completion stream alone: the last `Complete` kept, or `OPEN` when there is
none (not completed yet, or completed longer ago than the stream keeps; the worker's event log
keeps every handoff for good: `kvhandoff list`).

Memory: what the frontend knows of a handoff (its completions, its cancel) is kept for the
`remember` handoffs watched last.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvhandoff.client.connection import DEFAULT_PUBLISH_GIVE_UP_S, Connection, Watch
from kvhandoff.client.errors import BusUnavailable, CompletionTimeout, HandoffRejected
from kvhandoff.events.codec import decode_input
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import (
    Canceled,
    Complete,
    HandoffCompletion,
    Input,
    Rejection,
    StartHandoff,
)
from kvhandoff.events.subjects import DEFAULT_DONE_STREAM, rejections_stream_of

logger = logging.getLogger(__name__)

# The first and the longest pause before the completion stream is read again after a failure.
_REREAD_PAUSE_S = (0.1, 2.0)

DEFAULT_REMEMBER = 100_000


class CompletionStatus(enum.StrEnum):
    """What the completion stream tells of a handoff: its last `Complete`, if the stream keeps
    one. Named like the log's states (`worker.log.schema.HandoffState`), but not one of them:
    OPEN is no `Complete` kept, which is also a handoff that ended longer ago than the stream
    keeps, and the stream knows nothing of a quarantined handoff."""

    OPEN = "open"  # no completion kept: not completed yet, or longer ago than the stream keeps
    SUCCEEDED = "succeeded"
    CANCELED = "canceled"


@dataclass(eq=False)
class _Watched:
    """What the frontend knows of one handoff."""

    # The connection's reconnect count when core delivery of its completions was last known
    # gap-free; None until then (a handoff this frontend did not start).
    covered_since: int | None = None
    first: Complete | None = None
    canceled: Complete | None = None  # the first Complete(canceled)
    cancel_sent: bool = False
    cancel_rejected: bool = False
    start_rejected: str | None = None  # the worker's reason
    seen: set[int] = field(default_factory=set)  # the action ids of the Completes seen
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def saw(self, complete: Complete) -> None:
        self.seen.add(complete.action_id)
        if self.first is None:
            self.first = complete
        if complete.completion is HandoffCompletion.CANCELED and self.canceled is None:
            self.canceled = complete
        self.changed.set()

    def end(self) -> Complete | None:
        """The `Complete` that ends a wait, if it came."""
        if self.cancel_sent and not self.cancel_rejected:
            return self.canceled
        return self.first


class Frontend:
    """Starts and follows handoffs on a `Connection` (which the caller opens and closes). Make
    one with `open`; `close` it (or use it as an async context manager) when done.

    `on_complete` and `on_rejection`, if given, see every `Complete` and `Rejection` of the
    handoffs this frontend watches, as they arrive, before any wait returns on them.
    """

    def __init__(
        self,
        connection: Connection,
        *,
        done_stream: str = DEFAULT_DONE_STREAM,
        remember: int = DEFAULT_REMEMBER,
        publish_give_up_s: float = DEFAULT_PUBLISH_GIVE_UP_S,
        on_complete: Callable[[Complete], None] | None = None,
        on_rejection: Callable[[Rejection, Input | None], None] | None = None,
    ) -> None:
        if remember < 1:
            raise ValueError(f"remember must be at least 1 handoff, got {remember}")
        self._connection = connection
        self._done_stream = done_stream
        self._rejections_stream = rejections_stream_of(done_stream)
        self._remember = remember
        self._publish_give_up_s = publish_give_up_s
        self._on_complete = on_complete
        self._on_rejection = on_rejection
        self._watched: OrderedDict[HandoffId, _Watched] = OrderedDict()
        self._watches: list[Watch] = []
        self._reconnects = 0

    @classmethod
    async def open(
        cls,
        connection: Connection,
        *,
        done_stream: str = DEFAULT_DONE_STREAM,
        remember: int = DEFAULT_REMEMBER,
        publish_give_up_s: float = DEFAULT_PUBLISH_GIVE_UP_S,
        on_complete: Callable[[Complete], None] | None = None,
        on_rejection: Callable[[Rejection, Input | None], None] | None = None,
    ) -> Frontend:
        """A frontend whose subscriptions the server has registered."""
        frontend = cls(
            connection,
            done_stream=done_stream,
            remember=remember,
            publish_give_up_s=publish_give_up_s,
            on_complete=on_complete,
            on_rejection=on_rejection,
        )
        connection.on_reconnect(frontend._reconnected)
        frontend._watches = [
            await connection.watch_completions(frontend._on_complete_message),
            await connection.watch_rejections(frontend._on_rejection_message),
        ]
        await connection.flush()
        return frontend

    async def close(self) -> None:
        """Unsubscribe; waits in progress end at their timeouts."""
        watches, self._watches = self._watches, []
        for watch in watches:
            await watch.close()

    async def __aenter__(self) -> Frontend:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # --- Operations -----------------------------------------------------------------------

    async def start(self, start: StartHandoff) -> HandoffId:
        """Start a handoff: returns once the input stream stored the `StartHandoff`."""
        watched = self._watch(start.handoff_id)
        # The subscription has been registered since `open`: from here on, only a reconnect
        # can make core delivery miss this handoff's Complete.
        if watched.covered_since is None:
            watched.covered_since = self._reconnects
        await self._send(start)
        return start.handoff_id

    async def cancel(self, handoff_id: HandoffId) -> None:
        """Ask the worker to cancel the handoff; a later `wait` returns its canceled
        completion (unless the worker rejects the cancel)."""
        watched = self._watch(handoff_id)
        # Before the publish: a success that crosses the cancel must not end a wait.
        watched.cancel_sent = True
        watched.cancel_rejected = False
        await self._send(Canceled(handoff_id))

    async def wait(self, handoff_id: HandoffId, timeout_s: float | None = None) -> Complete:
        """The `Complete` that ends the handoff (see "Which `Complete` ends a wait").

        `CompletionTimeout` if none came within `timeout_s` (None: wait for ever),
        `HandoffRejected` if the worker rejected its `StartHandoff`. A read of the completion
        stream that fails (a NATS node died, and the stream is electing a new leader) is made
        again after a pause, within the timeout: it does not end the wait.
        """
        watched = self._watch(handoff_id)
        unread: BusUnavailable | None = None  # the last read of the stream that failed
        pause_s = _REREAD_PAUSE_S[0]
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    watched.changed.clear()
                    ended = watched.end()
                    if ended is not None:
                        return ended
                    if watched.start_rejected is not None:
                        raise HandoffRejected(
                            f"handoff {handoff_id}: the worker rejected its start: "
                            f"{watched.start_rejected}"
                        )
                    if watched.covered_since == self._reconnects:
                        await watched.changed.wait()
                        continue
                    try:
                        await self._read_stream(handoff_id, watched)
                        unread = None
                    except BusUnavailable as exc:
                        if unread is None:
                            logger.warning("handoff %s: %s; reading it again", handoff_id, exc)
                        unread = exc
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(pause_s):
                                await watched.changed.wait()  # or a Complete comes meanwhile
                        pause_s = min(2 * pause_s, _REREAD_PAUSE_S[1])
        except TimeoutError as exc:
            why = "" if unread is None else f" (the completion stream could not be read: {unread})"
            raise CompletionTimeout(
                f"handoff {handoff_id}: no final Complete within {timeout_s:g}s{why}"
            ) from exc

    async def state(self, handoff_id: HandoffId) -> CompletionStatus:
        """The handoff's state from the last `Complete` the completion stream keeps, or, while
        the stream has none, from the one that ended this frontend's wait on it."""
        last = await self._connection.last_complete(self._done_stream, handoff_id)
        if last is None and (watched := self._watched.get(handoff_id)) is not None:
            # The server hands a publish to core subscribers before its stream stores it, so
            # a read right after a wait returned can come before the stream has the Complete.
            last = watched.end()
        if last is None:
            return CompletionStatus.OPEN
        if last.completion is HandoffCompletion.SUCCESS:
            return CompletionStatus.SUCCEEDED
        return CompletionStatus.CANCELED

    def forget(self, handoff_id: HandoffId) -> None:
        """Drop what the frontend knows of the handoff (its later messages are ignored)."""
        self._watched.pop(handoff_id, None)

    # --- Internals ------------------------------------------------------------------------

    async def _read_stream(self, handoff_id: HandoffId, watched: _Watched) -> None:
        """Read what core delivery may have missed: the handoff's last `Complete`, and its
        last `Rejection`, if that is of its start."""
        covered = self._reconnects  # before the read: a reconnect during it reads again
        last = await self._connection.last_complete(self._done_stream, handoff_id)
        rejection = await self._connection.last_rejection(self._rejections_stream, handoff_id)
        watched.covered_since = covered
        if last is not None and last.action_id not in watched.seen:
            self._seen(watched, last)
        if rejection is not None and watched.start_rejected is None:
            refused = _rejected_input(rejection.payload)
            if isinstance(refused, StartHandoff):
                self._rejected(watched, rejection, refused)

    async def _send(self, message: Input) -> None:
        await self._connection.send(message, give_up_after_s=self._publish_give_up_s)

    def _watch(self, handoff_id: HandoffId) -> _Watched:
        watched = self._watched.get(handoff_id)
        if watched is None:
            watched = self._watched[handoff_id] = _Watched()
            while len(self._watched) > self._remember:
                self._watched.popitem(last=False)
        else:
            self._watched.move_to_end(handoff_id)
        return watched

    def _seen(self, watched: _Watched, complete: Complete) -> None:
        if self._on_complete is not None:
            self._on_complete(complete)
        watched.saw(complete)

    async def _on_complete_message(self, complete: Complete) -> None:
        watched = self._watched.get(complete.handoff_id)
        if watched is not None:  # another frontend's handoff otherwise
            self._seen(watched, complete)

    async def _on_rejection_message(self, rejection: Rejection) -> None:
        if rejection.handoff_id is None:
            return
        watched = self._watched.get(rejection.handoff_id)
        if watched is None:
            return
        self._rejected(watched, rejection, _rejected_input(rejection.payload))

    def _rejected(self, watched: _Watched, rejection: Rejection, refused: Input | None) -> None:
        if self._on_rejection is not None:
            self._on_rejection(rejection, refused)
        if isinstance(refused, StartHandoff):
            watched.start_rejected = rejection.reason
        elif isinstance(refused, Canceled) and watched.cancel_sent:
            # The cancel changed nothing: the handoff ends at its success, had or to come.
            watched.cancel_rejected = True
        watched.changed.set()

    def _reconnected(self) -> None:
        self._reconnects += 1
        for watched in self._watched.values():
            watched.changed.set()  # waits read the stream again


def _rejected_input(payload: str) -> Input | None:
    """The input a rejection quotes, or None if that does not decode (an undecodable input, or
    one the worker cut at its payload limit)."""
    try:
        return decode_input(payload)
    except msgspec.DecodeError:
        return None
