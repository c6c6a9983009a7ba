"""In-memory duplex connections between the loop's clients and simulated servers.

Theory of operation. A server `listen`s on a (host, port) with a factory of `asyncio.Protocol`s,
one per connection, as `loop.create_server` would. A client connects through
`Network.create_connection`, which has `loop.create_connection`'s shape, so a loop that
delegates to it (the simulation's loop, or a test's loop whose method is patched) hands nats-py
an in-memory connection where it expects a TCP one: `asyncio.open_connection` builds a
`StreamReaderProtocol`, and the transport here gives it everything it uses (write, close,
abort, extra info, flow control). Connecting takes one network delay; the server's protocol
sees `connection_made` first, then the client's.

Each connection is two `_End`s, each one a transport whose `write` puts the bytes in flight to
the other end: they arrive after a delay drawn from the network's `chance`, at
max(the previous arrival in that direction, now + delay), so the bytes of one direction arrive
in the order they were written, never reordered, never merged with another connection's. Every
arrival is a `loop.call_at` (and every loss a `loop.call_soon`): the network reads nothing but
`loop.time()`, so on the simulation's loop it runs in virtual time and on asyncio's in real
time. An arrival callback delivers the head of its direction's queue, not a chunk bound to
the callback, so even a loop that runs callbacks due at one instant in any order cannot
reorder a direction.

Faults, all drawn by the simulation, none by the network itself:

- `down(host)`: the host crashed. Every connection to or from it is lost at once: the bytes
  in flight are dropped and both ends see `connection_lost(ConnectionResetError)`. Connecting
  to it is refused until `up(host)`. Listeners stay registered across a crash, as a restarted
  node listens again on the same address.
- `pause(host)`: the host is partitioned. Bytes to and from it stay in flight (writes still
  queue) until `resume(host)`, when what was due is delivered in order; a connection being
  made to or from it waits too. The connections stay up: whether a peer notices is up to its
  own timeouts (nats-py's pings, its connect timeout), as with a real partition.
- `set_delay(min_s, max_s)`: how long bytes are in flight from now on.

A clean `close` sends an end of stream after the bytes already in flight: the peer's protocol
sees `eof_received` and, if that returns false, its transport closes too (asyncio's rule). The
closing end sees `connection_lost(None)` at once; what is in flight towards it is dropped.
`abort` sends a reset instead: the peer sees `connection_lost(ConnectionResetError)`.

Connections are numbered from a counter; a client's address is (`origin()`, a port from
another counter), where `origin` names the simulated process that connects (by default
"client"), so `down(origin)` also crashes a client host. If the running loop has a
`note(text)` method, the network notes each connection, arrival and loss on it, with the
connection's number, the byte count and a crc32 of the bytes, so the loop's trace hash covers
the traffic.

The network belongs to no simulated process: its arrivals and losses run in a context of its
own (`context`, which holds no `Ambient`), and so does the server code an arrival runs, with
the timers that code sets. Scheduled in the context current when some process wrote, a
delivery would be that process's, and the simulation's loop, which stops a crashed or paused
process's callbacks (worker/sim/loop.py), would stop a delivery to someone else with it.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import enum
import random
import zlib
from collections.abc import Callable, Iterable
from typing import Any

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class _Signal(enum.Enum):
    """What travels in a direction besides bytes."""

    EOF = "eof"
    RESET = "reset"


class Network:
    """The simulated network: listeners, connections, and the faults the simulation draws."""

    def __init__(
        self,
        chance: random.Random,
        *,
        min_delay_s: float = 0.0005,
        max_delay_s: float = 0.002,
        origin: Callable[[], str] = lambda: "client",
    ) -> None:
        self._chance = chance
        self._origin = origin
        self.context = contextvars.Context()
        """Where the network's callbacks run: in no simulated process."""
        self._min_delay_s = 0.0
        self._max_delay_s = 0.0
        self.set_delay(min_delay_s, max_delay_s)
        self._listeners: dict[tuple[str, int], Callable[[], asyncio.Protocol]] = {}
        self._down: set[str] = set()
        self._paused: set[str] = set()
        self._held_connects: list[asyncio.Future[None]] = []
        # Keyed by connection number: iteration follows the order connections were made.
        self._connections: dict[int, _Connection] = {}
        self._next_connection = 1
        self._next_client_port = 49152
        # Told the client host of every connection reset (a run's history records them).
        self.on_reset: Callable[[str], None] | None = None

    def listen(
        self, host: str, port: int, protocol_factory: Callable[[], asyncio.Protocol]
    ) -> None:
        """Accept connections to (host, port), each served by a protocol from the factory."""
        if (host, port) in self._listeners:
            raise OSError(f"cannot listen on {host}:{port}: something already listens there")
        self._listeners[(host, port)] = protocol_factory

    def set_delay(self, min_delay_s: float, max_delay_s: float) -> None:
        """Keep bytes written from now on in flight between `min_delay_s` and `max_delay_s`."""
        if not 0.0 <= min_delay_s <= max_delay_s:
            raise ValueError(f"refused delays {min_delay_s}..{max_delay_s} s: need 0 <= min <= max")
        self._min_delay_s = min_delay_s
        self._max_delay_s = max_delay_s

    def down(self, host: str) -> None:
        """Crash `host`: lose every connection to or from it and refuse new ones until `up`."""
        self._down.add(host)
        for connection in list(self._connections.values()):
            if host in (connection.client_host, connection.server_host):
                connection.reset(f"{host} went down")

    def reset(self, host: str) -> None:
        """Reset every connection to or from `host` (a TCP reset): what is in flight either way
        is lost; new connections are taken at once."""
        for connection in list(self._connections.values()):
            if host in (connection.client_host, connection.server_host):
                connection.reset(f"{host}'s connection was reset")

    def up(self, host: str) -> None:
        """Let `host` take connections again (its listeners never went away)."""
        self._down.discard(host)

    def is_up(self, host: str) -> bool:
        """Whether `host` is up (not crashed)."""
        return host not in self._down

    def pause(self, host: str) -> None:
        """Partition `host`: hold every byte to and from it until `resume`."""
        self._paused.add(host)

    def resume(self, host: str) -> None:
        """Heal `host`'s partition: deliver what it held, in order."""
        self._paused.discard(host)
        held, self._held_connects = self._held_connects, []
        for future in held:
            _settle(future)
        for connection in list(self._connections.values()):
            if host in (connection.client_host, connection.server_host):
                connection.rearm()

    def _is_paused(self, connection: _Connection) -> bool:
        """Whether `connection` crosses a partition."""
        return connection.client_host in self._paused or connection.server_host in self._paused

    def _draw_delay(self) -> float:
        """How long the next bytes stay in flight."""
        return self._chance.uniform(self._min_delay_s, self._max_delay_s)

    async def create_connection(
        self,
        protocol_factory: ProtocolFactory,
        host: str | None = None,
        port: int | None = None,
        **options: Any,
    ) -> tuple[asyncio.Transport, asyncio.BaseProtocol]:
        """Connect to (host, port) as `loop.create_connection` does, after one network delay.

        Options that shape a real socket (`limit`, `family`, ...) mean nothing here and are
        ignored; TLS is refused, since nothing here speaks it."""
        if options.get("ssl"):
            raise ValueError(f"refused TLS to {host}:{port}: the simulated network has none")
        if host is None or port is None:
            raise ValueError("refused a connection without a host and a port")
        loop = asyncio.get_running_loop()
        client_host = self._origin()
        number = self._next_connection
        self._next_connection += 1
        arrived: asyncio.Future[None] = loop.create_future()
        loop.call_at(loop.time() + self._draw_delay(), _settle, arrived)
        await arrived
        while host in self._paused or client_host in self._paused:
            held: asyncio.Future[None] = loop.create_future()
            self._held_connects.append(held)
            await held  # across a partition a connection waits (nats-py's connect_timeout)
        server_factory = self._listeners.get((host, port))
        if server_factory is None or host in self._down or client_host in self._down:
            why = "nothing listens there" if server_factory is None else "its host is down"
            if client_host in self._down:
                why = f"{client_host} is down"
            _note(loop, f"net c{number} refused {host}:{port}")
            raise ConnectionRefusedError(f"connection to {host}:{port} refused: {why}")
        protocol = protocol_factory()
        if not isinstance(protocol, asyncio.Protocol):
            raise TypeError(
                f"refused a {type(protocol).__name__} for {host}:{port}: "
                "the simulated network delivers to asyncio.Protocol only"
            )
        client_port = self._next_client_port
        self._next_client_port += 1
        server_protocol = server_factory()
        connection = _Connection(
            self,
            loop,
            number,
            client=(client_host, client_port),
            server=(host, port),
            client_protocol=protocol,
            server_protocol=server_protocol,
        )
        self._connections[number] = connection
        _note(loop, f"net c{number} connect {client_host} to {host}:{port}")
        server_protocol.connection_made(connection.server)
        protocol.connection_made(connection.client)
        return connection.client, protocol

    def abandon(self) -> None:
        """Close every connection still open, telling no protocol: for a finished run, whose
        loop is closed. A crashed or paused process's client may still hold a transport that
        nobody closed; asyncio's `StreamWriter.__del__` warns of one that is open when the
        garbage collector takes it, at a moment of its choosing, perhaps in the next run."""
        connections, self._connections = list(self._connections.values()), {}
        for connection in connections:
            connection.client.abandon()
            connection.server.abandon()

    def _forget(self, connection: _Connection) -> None:
        """Drop a connection whose ends have both seen `connection_lost`."""
        self._connections.pop(connection.number, None)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _note(loop: asyncio.AbstractEventLoop, text: str) -> None:
    note = getattr(loop, "note", None)
    if callable(note):
        note(text)


class _Connection:
    """One connection's two ends and what they share."""

    def __init__(
        self,
        network: Network,
        loop: asyncio.AbstractEventLoop,
        number: int,
        *,
        client: tuple[str, int],
        server: tuple[str, int],
        client_protocol: asyncio.Protocol,
        server_protocol: asyncio.Protocol,
    ) -> None:
        self.network = network
        self.loop = loop
        self.number = number
        self.client_host = client[0]
        self.server_host = server[0]
        self.client = _End(self, client_protocol, sockname=client, peername=server, arrow="<")
        self.server = _End(self, server_protocol, sockname=server, peername=client, arrow=">")
        self.client.peer = self.server
        self.server.peer = self.client

    def reset(self, why: str) -> None:
        """Lose both ends at once, dropping what is in flight."""
        _note(self.loop, f"net c{self.number} reset")
        if self.network.on_reset is not None and not self.client.lost:
            self.network.on_reset(self.client_host)
        for end in (self.client, self.server):
            end.lose(ConnectionResetError(f"connection {self.number} reset: {why}"))

    def rearm(self) -> None:
        """Start delivering again after a pause."""
        self.client.arm()
        self.server.arm()

    def check_forgotten(self) -> None:
        if self.client.lost and self.server.lost:
            self.network._forget(self)


class _End(asyncio.Transport):
    """One end of a connection: the transport its protocol writes to, and the queue of what
    is in flight towards it."""

    def __init__(
        self,
        connection: _Connection,
        protocol: asyncio.Protocol,
        *,
        sockname: tuple[str, int],
        peername: tuple[str, int],
        arrow: str,
    ) -> None:
        super().__init__({"peername": peername, "sockname": sockname, "socket": None})
        self._connection = connection
        self._protocol = protocol
        self._arrow = arrow  # how the trace shows the direction towards this end
        self.peer: _End = self
        self.lost = False
        self._closing = False
        self._eof_written = False
        self._reading = True
        self._inbound: collections.deque[tuple[float, bytes | _Signal]] = collections.deque()
        self._due = 0.0  # when the last thing in flight towards this end arrives
        self._timer: asyncio.TimerHandle | None = None
        self._write_limits = (16 * 1024, 64 * 1024)

    # Writing: what this end sends travels to the peer's queue.

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof_written:
            raise RuntimeError("cannot write after write_eof()")
        if self._closing or self.lost or not data:
            return
        self.peer.receive(bytes(data))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if self._eof_written or self._closing or self.lost:
            return
        self._eof_written = True
        self.peer.receive(_Signal.EOF)

    def get_write_buffer_size(self) -> int:
        # What was written is in flight, not buffered here: a writer never has to wait.
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._write_limits

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        high = 64 * 1024 if high is None else high
        low = high // 4 if low is None else low
        self._write_limits = (low, high)

    # Closing.

    def is_closing(self) -> bool:
        return self._closing or self.lost

    def close(self) -> None:
        if self._closing or self.lost:
            return
        self._closing = True
        if not self._eof_written:
            self.peer.receive(_Signal.EOF)
        self.lose(None)

    def abort(self) -> None:
        if self.lost:
            return
        self._closing = True
        self.peer.receive(_Signal.RESET)
        self.lose(None)

    def abandon(self) -> None:
        """Closed, with nothing in flight and no callback: the run is over."""
        self.lost = self._closing = True
        self._inbound.clear()
        self._timer = None

    def lose(self, exc: Exception | None) -> None:
        """Drop what is in flight towards this end; its protocol sees `connection_lost`."""
        if self.lost:
            return
        self.lost = True
        self._closing = True
        self._inbound.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        connection = self._connection
        connection.loop.call_soon(
            self._protocol.connection_lost, exc, context=connection.network.context
        )
        connection.check_forgotten()

    # Reading: what the peer sent arrives here.

    def is_reading(self) -> bool:
        return self._reading and not self.lost

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        if not self._reading:
            self._reading = True
            self.arm()

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        if not isinstance(protocol, asyncio.Protocol):
            raise TypeError(
                f"refused a {type(protocol).__name__}: "
                "the simulated network delivers to asyncio.Protocol only"
            )
        self._protocol = protocol

    def receive(self, item: bytes | _Signal) -> None:
        """Put `item` in flight towards this end, behind everything already in flight."""
        if self.lost:
            return
        loop = self._connection.loop
        self._due = max(self._due, loop.time() + self._connection.network._draw_delay())
        self._inbound.append((self._due, item))
        self.arm()

    def arm(self) -> None:
        """Make sure a callback will deliver the head of the queue when it is due."""
        if self._timer is not None or not self._inbound or self.lost:
            return
        connection = self._connection
        self._timer = connection.loop.call_at(
            self._inbound[0][0], self._arrive, context=connection.network.context
        )

    def _arrive(self) -> None:
        self._timer = None
        if self.lost or not self._inbound:
            return
        connection = self._connection
        if not self._reading or connection.network._is_paused(connection):
            return  # resume_reading or resume re-arms
        due, item = self._inbound[0]
        if due > connection.loop.time():
            self.arm()
            return
        self._inbound.popleft()
        self.arm()  # first, so what follows still arrives if this protocol raises
        tag = f"net c{connection.number} {self._arrow}"
        if isinstance(item, bytes):
            _note(connection.loop, f"{tag} {len(item)} {zlib.crc32(item):08x}")
            self._protocol.data_received(item)
        elif item is _Signal.EOF:
            _note(connection.loop, f"{tag} eof")
            if not self._protocol.eof_received():
                self.close()
        else:
            _note(connection.loop, f"{tag} reset")
            self.lose(ConnectionResetError(f"connection {connection.number} reset by peer"))
