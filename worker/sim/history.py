"""The history of one simulated run: what the model of NATS saw, in the order it saw it, and
what the clients' pulls asked and read.

Theory of operation. The checkers (worker.sim.checks) judge a run after it ended, from what
happened rather than from what the tier says of itself, so the model records five kinds of
event as they happen, through hooks that cost nothing when no `History` is attached
(`SimCluster.record`), and what JetStream answered a publish with:

- `StoredMessage`: every message a stream stored (the JetStream model's store path, delete
  markers and atomic batches' messages included), even one that a later roll-up, limit or
  acknowledgement removed: the checkers must see a zombie's append that a snapshot rolled up;
- `AckedMessage`: every acknowledgement a consumer settled (`+ACK`, `+TERM`, `+NXT`), of one
  stream sequence each (an ack policy `all` settles several: one record each), and whether it
  removed the message from a work-queue stream;
- `NakedMessage`: every `-NAK` a consumer took (of a delivery still pending): an input given
  back, to come again later than inputs stored after it;
- `Published`: every publish a client made (core or JetStream, as the server parsed it), with
  the name and wall clock of the publishing process;
- `ConnectionReset`: every connection the network lost (a reset, a host gone), by the host
  of its client: what was in flight on it, a `PubAck` among it, never arrived;
- `PubAcked`: every `PubAck` JetStream sent for a publish (a stored message's, a duplicate's,
  an atomic batch commit's), by the reply subject the publish named (`Published.reply`: nats-py
  asks each attempt on a reply subject of its own). A publish whose ack the lost-ack fault
  dropped, that an election left unanswered, or that was refused has none. Sent is not
  received: the network may still lose it on its way (a node's connection reset).

And two that the client records, not the model (worker.sim.pulls), since only the client knows
when it asked a pull request and when it read the server's answer:

- `PullAsked`: every pull request, as the client asked it;
- `PullRead`: every 423 a Pull read, and every new pin id it read on its messages.

Order. Each record gets the next `index` of one counter shared by the eight kinds: "stored
before acknowledged" is a comparison of indexes, exact even between records of one virtual
instant. `at` is the loop's (virtual) time, for the messages that report a violation.

Who published. The server knows each client by the host it connects from, which on the
simulated network is its process's name (worker.sim.network); the run registers its processes
here by name (`processes`), so a publish is stamped with its publisher's name and its own,
possibly skewed, wall clock, which is the clock its timers read. (The server cannot ask the
ambient: it parses a client's bytes in the network's context, not the publisher's.)

Determinism: nothing here draws, reads a wall clock of the machine or iterates a set; the
records are plain values in lists.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvhandoff.worker.ambient import Ambient
from kvhandoff.worker.sim.nats.jetstream.api import Stored


@dataclass(frozen=True)
class StoredMessage:
    """A message a stream stored."""

    index: int
    at: float
    stream: str
    subject: str
    seq: int
    headers: Mapping[str, str] | None
    payload: bytes


@dataclass(frozen=True)
class AckedMessage:
    """A stream sequence a consumer's acknowledgement settled."""

    index: int
    at: float
    stream: str
    consumer: str
    seq: int
    removed: bool  # it removed the message from its (work-queue) stream


@dataclass(frozen=True)
class NakedMessage:
    """A stream sequence a consumer's negative acknowledgement gave back."""

    index: int
    at: float
    stream: str
    consumer: str
    seq: int


@dataclass(frozen=True)
class ConnectionReset:
    """A connection lost, with what was in flight on it."""

    index: int
    at: float
    host: str  # its client's: a simulated process's name


@dataclass(frozen=True)
class Published:
    """A client's publish, as the server read it."""

    index: int
    at: float
    subject: str
    reply: str
    header: bytes | None  # the header block as published
    payload: bytes
    publisher: str | None  # the publishing process's name, if it was a simulated one
    wall_ms: int | None  # the publishing process's wall clock then, likewise


@dataclass(frozen=True)
class PubAcked:
    """A `PubAck` JetStream sent, on the reply subject of the publish it answers."""

    index: int
    at: float
    reply: str
    stream: str
    seq: int
    duplicate: bool  # the publish was a duplicate of one already stored (its `Nats-Msg-Id`)


@dataclass(frozen=True)
class PullAsked:
    """A pull request, as the client asked it (worker.sim.pulls)."""

    index: int
    at: float
    process: str | None
    consumer: str  # `<stream>.<consumer>`
    reply: str  # `<inbox>.<token>`: its messages' and statuses' subject
    payload: bytes  # its `PullRequest`, which names its pin id


@dataclass(frozen=True)
class PullRead:
    """A 423 refusing a pull request, or a new pin id, as a Pull read it (worker.sim.pulls)."""

    index: int
    at: float
    process: str | None
    inbox: str
    refused: str | None  # the reply subject of the request a 423 refused
    pin_id: str | None  # the pin id a message was stamped with, where it changed


@dataclass
class History:
    """Every `StoredMessage`, `AckedMessage`, `NakedMessage`, `ConnectionReset`, `Published`,
    `PubAcked`, `PullAsked` and `PullRead` of a run, each list in order."""

    stored: list[StoredMessage] = field(default_factory=list)
    acked: list[AckedMessage] = field(default_factory=list)
    naked: list[NakedMessage] = field(default_factory=list)
    resets: list[ConnectionReset] = field(default_factory=list)
    published: list[Published] = field(default_factory=list)
    pub_acked: list[PubAcked] = field(default_factory=list)
    pulls_asked: list[PullAsked] = field(default_factory=list)
    pulls_read: list[PullRead] = field(default_factory=list)
    # The simulated processes by name (the host they connect from), so that a publish is
    # stamped with its publisher's own clock; the run registers each one it starts.
    processes: dict[str, Ambient] = field(default_factory=dict)
    _next: int = 0

    def _index(self) -> tuple[int, float]:
        index = self._next
        self._next += 1
        return index, asyncio.get_running_loop().time()

    def on_stored(self, stream: str, stored: Stored) -> None:
        """The JetStream model stored `stored` in `stream`."""
        index, at = self._index()
        self.stored.append(
            StoredMessage(
                index, at, stream, stored.subject, stored.seq, stored.headers, stored.payload
            )
        )

    def on_acked(self, stream: str, consumer: str, seq: int, *, removed: bool) -> None:
        """`consumer` of `stream` settled `seq`."""
        index, at = self._index()
        self.acked.append(AckedMessage(index, at, stream, consumer, seq, removed))

    def on_naked(self, stream: str, consumer: str, seq: int) -> None:
        """`consumer` of `stream` took a nak of `seq`."""
        index, at = self._index()
        self.naked.append(NakedMessage(index, at, stream, consumer, seq))

    def on_reset(self, host: str) -> None:
        """A connection whose client is on `host` was lost."""
        index, at = self._index()
        self.resets.append(ConnectionReset(index, at, host))

    def on_pub_acked(self, reply: str, stream: str, seq: int, *, duplicate: bool) -> None:
        """JetStream sent a `PubAck` (of `seq` in `stream`) to `reply`."""
        index, at = self._index()
        self.pub_acked.append(PubAcked(index, at, reply, stream, seq, duplicate))

    def on_pull_asked(
        self, consumer: str, reply: str, payload: bytes, *, process: str | None
    ) -> None:
        """`process` asked `consumer` for messages, to come to `reply`."""
        index, at = self._index()
        self.pulls_asked.append(PullAsked(index, at, process, consumer, reply, payload))

    def on_pull_refused(self, inbox: str, reply: str, *, process: str | None) -> None:
        """The Pull of `inbox` read a 423 refusing its request of reply subject `reply`."""
        index, at = self._index()
        self.pulls_read.append(PullRead(index, at, process, inbox, reply, None))

    def on_pin_read(self, inbox: str, pin_id: str, *, process: str | None) -> None:
        """The Pull of `inbox` read a message stamped with a pin id other than the last."""
        index, at = self._index()
        self.pulls_read.append(PullRead(index, at, process, inbox, None, pin_id))

    def on_published(
        self, subject: str, reply: str, header: bytes | None, payload: bytes, *, publisher: str
    ) -> None:
        """The client on host `publisher` (a simulated process's name) published to `subject`."""
        index, at = self._index()
        process = self.processes.get(publisher)
        name = publisher if process is not None else None
        wall_ms = process.wall_ns() // 1_000_000 if process is not None else None
        self.published.append(
            Published(
                index,
                at,
                subject,
                reply,
                header,
                payload,
                name,
                wall_ms,
            )
        )
