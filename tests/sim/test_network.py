"""The simulated network (worker.sim.network), on asyncio's own loop with a virtual clock.

`VirtualLoop` is asyncio's `BaseEventLoop` whose selector, when nothing is ready, moves the
clock to the next timer instead of waiting: the network reads only `loop.time()` and
schedules only with `call_at`/`call_soon`, so it runs on it as on the simulation's loop, and
arrival times can be checked exactly. The loop's `note` records what the network notes, with
the time.
"""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from kvhandoff.worker.sim.network import Network


class VirtualLoop(asyncio.BaseEventLoop):
    """asyncio's loop, with a clock that jumps to the next timer whenever nothing is ready."""

    def __init__(self, network: Network) -> None:
        super().__init__()
        self._now = 0.0
        self._selector = self
        self.notes: list[tuple[float, str]] = []
        self.create_connection = network.create_connection  # type: ignore[method-assign,assignment]

    def time(self) -> float:
        return self._now

    def select(self, timeout: float | None) -> list[Any]:
        if timeout is None:
            raise RuntimeError("the test is stuck: nothing is ready and no timer is set")
        self._now += timeout
        return []

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass

    def note(self, text: str) -> None:
        self.notes.append((self._now, text))


def run(network: Network, main: Callable[[VirtualLoop], Coroutine[Any, Any, None]]) -> VirtualLoop:
    """Run `main` to its end on a fresh virtual loop; the loop, for what it noted."""
    loop = VirtualLoop(network)
    try:
        loop.run_until_complete(main(loop))
    finally:
        loop.close()
    return loop


class Recorder(asyncio.Protocol):
    """Records what its transport delivers, with the loop's time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.events: list[tuple[float, str, bytes]] = []
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.events.append((asyncio.get_running_loop().time(), "data", data))

    def eof_received(self) -> bool:
        self.events.append((asyncio.get_running_loop().time(), "eof", b""))
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append((asyncio.get_running_loop().time(), "lost", b""))
        self.lost.set_result(exc)

    @property
    def out(self) -> asyncio.Transport:
        """Its transport, once the connection is made."""
        assert self.transport is not None
        return self.transport

    def received(self) -> bytes:
        return b"".join(data for _, kind, data in self.events if kind == "data")


class Servers:
    """The server-side protocols a listener made, in order."""

    def __init__(self) -> None:
        self.made: list[Recorder] = []

    def __call__(self) -> Recorder:
        self.made.append(Recorder())
        return self.made[-1]


@pytest.fixture
def network() -> Network:
    """The network most tests run on: seed 1, the default delays."""
    return Network(random.Random(1))


def listen(network: Network, *hosts: str) -> Servers:
    """Each of `hosts` listening on port 4222; the protocols they accept, in order."""
    servers = Servers()
    for host in hosts:
        network.listen(host, 4222, servers)
    return servers


async def connect(loop: VirtualLoop, host: str, port: int = 4222) -> Recorder:
    _, protocol = await loop.create_connection(Recorder, host, port)
    assert isinstance(protocol, Recorder)
    return protocol


def test_bytes_arrive_in_the_order_written_each_after_a_delay_in_bounds() -> None:
    network = Network(random.Random(1), min_delay_s=0.001, max_delay_s=0.010)
    servers = listen(network, "sim-a")
    writes: list[tuple[float, bytes]] = []

    async def main(loop: VirtualLoop) -> None:
        client = await connect(loop, "sim-a")
        pace = random.Random(2)
        for n in range(300):
            chunk = f"<{n}>".encode()
            writes.append((loop.time(), chunk))
            client.out.write(chunk)
            if pace.random() < 0.7:  # often a write while earlier ones are still in flight
                await asyncio.sleep(pace.uniform(0, 0.004))
        await asyncio.sleep(0.1)

    run(network, main)
    arrivals = [(t, data) for t, kind, data in servers.made[0].events if kind == "data"]
    assert [data for _, data in arrivals] == [chunk for _, chunk in writes]
    previous = 0.0
    for (written, _), (arrived, _) in zip(writes, arrivals, strict=True):
        assert arrived >= written + 0.001 and arrived >= previous
        assert arrived <= max(previous, written + 0.010)
        previous = arrived


def test_a_connection_to_an_address_nobody_listens_on_or_to_a_host_down_is_refused(
    network: Network,
) -> None:
    listen(network, "sim-a")

    async def main(loop: VirtualLoop) -> None:
        with pytest.raises(ConnectionRefusedError, match=r"sim-a:4223 refused: nothing listens"):
            await connect(loop, "sim-a", 4223)
        with pytest.raises(ConnectionRefusedError, match=r"sim-z:4222"):
            await connect(loop, "sim-z")
        network.down("sim-a")
        with pytest.raises(ConnectionRefusedError, match=r"sim-a:4222 refused: its host is down"):
            await connect(loop, "sim-a")
        network.up("sim-a")
        assert (await connect(loop, "sim-a")).transport is not None

    run(network, main)


def test_a_host_going_down_resets_its_connections_and_drops_the_bytes_in_flight(
    network: Network,
) -> None:
    servers = listen(network, "sim-a", "sim-b")

    async def main(loop: VirtualLoop) -> None:
        to_a = await connect(loop, "sim-a")
        to_b = await connect(loop, "sim-b")
        to_a.out.write(b"delivered")
        await asyncio.sleep(0.01)
        to_a.out.write(b"in flight")
        servers.made[0].out.write(b"in flight back")
        network.down("sim-a")
        client_saw = await to_a.lost
        server_saw = await servers.made[0].lost
        assert isinstance(client_saw, ConnectionResetError)
        assert isinstance(server_saw, ConnectionResetError)
        assert "sim-a went down" in str(client_saw)
        await asyncio.sleep(0.01)
        assert to_a.received() == b""
        assert servers.made[0].received() == b"delivered"
        to_b.out.write(b"still up")
        await asyncio.sleep(0.01)
        assert servers.made[1].received() == b"still up"
        assert not to_b.lost.done()

    run(network, main)


def test_a_client_host_going_down_loses_its_connections_too() -> None:
    origin = ["worker-1"]
    network = Network(random.Random(1), origin=lambda: origin[0])
    servers = listen(network, "sim-a")

    async def main(loop: VirtualLoop) -> None:
        worker_1 = await connect(loop, "sim-a")
        origin[0] = "worker-2"
        worker_2 = await connect(loop, "sim-a")
        assert servers.made[0].out.get_extra_info("peername") == ("worker-1", 49152)
        network.down("worker-1")
        assert isinstance(await servers.made[0].lost, ConnectionResetError)
        assert isinstance(await worker_1.lost, ConnectionResetError)
        assert not worker_2.lost.done()
        origin[0] = "worker-1"
        with pytest.raises(ConnectionRefusedError, match="worker-1 is down"):
            await connect(loop, "sim-a")

    run(network, main)


def test_a_paused_host_gets_nothing_until_it_resumes_then_all_of_it_in_order(
    network: Network,
) -> None:
    servers = listen(network, "sim-a")

    async def main(loop: VirtualLoop) -> None:
        client = await connect(loop, "sim-a")
        network.pause("sim-a")
        for n in range(5):
            client.out.write(b"%d" % n)
        await asyncio.sleep(5)
        assert servers.made[0].received() == b""
        resumed_at = loop.time()
        network.resume("sim-a")
        await asyncio.sleep(0.01)
        assert servers.made[0].received() == b"01234"
        assert all(t == resumed_at for t, _, _ in servers.made[0].events)

    run(network, main)


def test_a_connection_to_a_paused_host_waits_until_it_resumes(network: Network) -> None:
    servers = listen(network, "sim-a")

    async def main(loop: VirtualLoop) -> None:
        network.pause("sim-a")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(connect(loop, "sim-a"), 2)
        held = asyncio.ensure_future(connect(loop, "sim-a"))
        await asyncio.sleep(3)
        assert not held.done() and servers.made == []
        network.resume("sim-a")
        client = await held
        assert client.transport is not None and len(servers.made) == 1

    run(network, main)


def test_close_ends_the_stream_after_the_bytes_in_flight_and_abort_resets_it(
    network: Network,
) -> None:
    servers = listen(network, "sim-a")

    async def main(loop: VirtualLoop) -> None:
        closing = await connect(loop, "sim-a")
        closing.out.write(b"last words")
        closing.out.close()
        assert closing.out.is_closing()
        assert await closing.lost is None
        assert await servers.made[0].lost is None  # it closed on the end of stream
        assert [kind for _, kind, _ in servers.made[0].events] == ["data", "eof", "lost"]
        assert servers.made[0].received() == b"last words"

        aborting = await connect(loop, "sim-a")
        aborting.out.abort()
        assert await aborting.lost is None
        assert isinstance(await servers.made[1].lost, ConnectionResetError)

    run(network, main)


def test_streams_work_over_it_with_flow_control() -> None:
    """asyncio's streams (what nats-py reads and writes through) on both ends: a server that
    echoes, and a client whose small read limit makes the stream pause and resume reading."""
    network = Network(random.Random(3))

    async def main(loop: VirtualLoop) -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(1000):
                writer.write(data)
            writer.close()

        def serve() -> asyncio.StreamReaderProtocol:
            return asyncio.StreamReaderProtocol(asyncio.StreamReader(), echo)

        network.listen("sim-a", 4222, serve)
        reader, writer = await asyncio.open_connection("sim-a", 4222, limit=64)
        assert writer.get_extra_info("peername") == ("sim-a", 4222)
        sent = b"".join(b"line %d\n" % n for n in range(500))
        for start in range(0, len(sent), 700):
            writer.write(sent[start : start + 700])
            await writer.drain()
        await asyncio.sleep(1)  # every chunk has been echoed: the reader's buffer is full
        transport = writer.transport
        assert isinstance(transport, asyncio.ReadTransport)
        assert not transport.is_reading()
        writer.write_eof()
        got = b""
        while data := await reader.read(16):
            got += data
        assert got == sent
        writer.close()
        await writer.wait_closed()

    run(network, main)


def test_a_finished_run_abandons_the_connections_left_open(network: Network) -> None:
    """A crashed process's client may still hold a StreamWriter nobody closed: once its loop
    is closed, asyncio warns when the garbage collector takes it. Abandoned, it is closed, and
    no protocol hears of it (the loop that would run the callback is gone)."""
    servers = listen(network, "sim-a")
    writers: list[asyncio.StreamWriter] = []

    async def main(loop: VirtualLoop) -> None:
        _, writer = await asyncio.open_connection("sim-a", 4222)
        writers.append(writer)

    run(network, main)
    (writer,) = writers
    assert not writer.transport.is_closing()
    network.abandon()
    assert writer.transport.is_closing()
    assert [kind for _, kind, _ in servers.made[0].events] == []


def test_each_arrival_is_noted_with_its_connection_size_and_checksum(network: Network) -> None:
    servers = listen(network, "sim-a")

    async def main(loop: VirtualLoop) -> None:
        client = await connect(loop, "sim-a")
        client.out.write(b"hello")
        servers.made[0].out.write(b"hi!")
        await asyncio.sleep(0.01)

    loop = run(network, main)
    texts = [text for _, text in loop.notes]
    assert texts[0] == "net c1 connect client to sim-a:4222"
    assert sorted(texts[1:]) == [
        f"net c1 < 3 {zlib.crc32(b'hi!'):08x}",
        f"net c1 > 5 {zlib.crc32(b'hello'):08x}",
    ]


def converse(seed: int) -> list[tuple[float, str]]:
    """Three clients and two hosts trading random bytes at random times; what was noted."""
    network = Network(random.Random(seed))
    servers = listen(network, "sim-a", "sim-b")

    async def talk(loop: VirtualLoop, host: str, pace: random.Random) -> None:
        client = await connect(loop, host)
        address = client.out.get_extra_info("sockname")
        [server] = [s for s in servers.made if s.out.get_extra_info("peername") == address]
        for _ in range(40):
            end = client if pace.random() < 0.5 else server
            end.out.write(pace.randbytes(pace.randint(1, 50)))
            await asyncio.sleep(pace.uniform(0, 0.003))

    async def main(loop: VirtualLoop) -> None:
        await asyncio.gather(
            *(
                talk(loop, host, random.Random(n))
                for n, host in enumerate(["sim-a", "sim-a", "sim-b"])
            )
        )
        await asyncio.sleep(0.1)

    return run(network, main).notes


def test_the_same_seed_gives_the_same_arrivals_at_the_same_times() -> None:
    first = converse(5)
    assert len([text for _, text in first if " > " in text or " < " in text]) == 3 * 40
    assert converse(5) == first
    assert converse(6) != first
