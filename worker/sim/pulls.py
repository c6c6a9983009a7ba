"""What the simulation watches of each pull at the client: what it asks, and what it reads.

Theory of operation. Whether a pull obeys a 423 (ADR-42: another client holds the pin of the
request's priority group, so the pull must ask to be pinned anew) cannot be judged from the
server's side. A request carrying a refused pin id may have been asked before the client read
the refusal: it may still be in nats-py's write buffer or on the wire when the 423 arrives.
The server sees when a request arrives, not when the client asked it. So `watched(history)`
records two things in the client, at the moments that decide (worker.sim.checks's
`check_refused_pins` judges them):

- `PullAsked`: every pull request (`$JS.API.CONSUMER.MSG.NEXT.*`), as `Client.publish` is
  called with it: its reply subject (`<inbox>.<token>`) and its body, which names its pin id;
- `PullRead`: what the client's parser hands to a Pull (`worker.bus.pull.Deliveries`), in the
  order read: each 423 (by the reply subject of the request it refused), and each change of
  the pin id that the server stamped on the inbox's messages (`Nats-Pin-Id`). A message served
  under an old pin (ADR-42 promises no exclusivity) gives the old id back legitimately.

Both patch classes, not instances, for the length of the block, as `natspy.pinned` does: the
Bus's `Deliveries` binds its `_process` when it is made, inside the block. Each record takes
the next index of the history's one counter, so "asked after it read the 423" is a comparison
of indexes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from nats.aio.client import Client

from kvhandoff.worker import ambient
from kvhandoff.worker.bus import pull as bus_pull
from kvhandoff.worker.sim.history import History

PULL_PREFIX = "$JS.API.CONSUMER.MSG.NEXT."
_REFUSED = b"NATS/1.0 423"  # a status's header block starts with its code


def _process_name() -> str | None:
    return getattr(ambient.current(), "name", None)


@contextlib.contextmanager
def watched(history: History) -> Iterator[None]:
    """Record every pull request asked and every refusal and pin read, until the block ends."""
    publish = Client.publish
    process = bus_pull.Deliveries._process
    pins: dict[str, str] = {}  # inbox -> the pin id last read on it

    async def watched_publish(
        self: Client,
        subject: str,
        payload: bytes = b"",
        reply: str = "",
        headers: dict[str, Any] | None = None,
    ) -> None:
        if subject.startswith(PULL_PREFIX):
            consumer = subject.removeprefix(PULL_PREFIX)
            history.on_pull_asked(consumer, reply, payload, process=_process_name())
        await publish(self, subject, payload, reply, headers)

    # nats-py's parser calls it with these five, positionally.
    async def watched_process(  # noqa: PLR0917
        self: bus_pull.Deliveries,
        sid: int,
        subject: bytes,
        reply: bytes,
        data: bytes,
        headers: bytes | None,
    ) -> None:
        pull = self._routes.get(sid)
        if pull is not None and headers:
            # A status comes on its request's reply subject; a message on its own subject.
            if not reply and headers.startswith(_REFUSED):
                history.on_pull_refused(pull._inbox, subject.decode(), process=_process_name())
            elif (
                reply
                and (pin_id := bus_pull._pin_id(headers)) is not None
                and pin_id != pins.get(pull._inbox)
            ):
                pins[pull._inbox] = pin_id
                history.on_pin_read(pull._inbox, pin_id, process=_process_name())
        await process(self, sid, subject, reply, data, headers)

    Client.publish = watched_publish  # type: ignore[method-assign]
    bus_pull.Deliveries._process = watched_process  # type: ignore[method-assign]
    try:
        yield
    finally:
        Client.publish = publish  # type: ignore[method-assign]
        bus_pull.Deliveries._process = process  # type: ignore[method-assign]
