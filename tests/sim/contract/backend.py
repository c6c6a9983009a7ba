"""What a contract asks of a backend, and the backend that is a real nats-server.

A backend is a NATS server the contracts talk to through the tier's own `Bus`, and the event
loop they run on. `run` takes a contract (an `async def` of the backend) and runs it to its
end on that loop, then closes every `Bus` the contract connected: the real backend runs it
on a fresh asyncio loop of the machine (`asyncio.run`), the model's (`ModelBackend`) runs it
on the simulation's deterministic loop (worker.sim.loop), with virtual time. So a contract
never assumes whose loop it is on: it reads time from the running loop (`now`), lets time
pass only through `advance`, and waits for a condition only through the bus's own awaits (a
fetch's timeout, a flush) or `tests.eventually.until`, all of which count the running loop's
time.

Names. Every contract makes its own streams, buckets and subject prefixes with `fresh`, so
contracts share nothing but the server, which the real backend starts once per session.

Adding a backend is a subclass of `Backend` with its server's `url`, `run` and
`restart_server`, and its name in tests/sim/contract/conftest.py's `BACKENDS`.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import random
from collections.abc import Awaitable, Callable

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.sim import loop as simloop
from kvhandoff.worker.sim import natspy
from kvhandoff.worker.sim.nats.cluster import SimCluster

Contract = Callable[["Backend"], Awaitable[None]]


def contract(body: Contract) -> Callable[[Backend], None]:
    """Make the contract `body` a pytest test of the `backend` fixture: a plain function, so
    that pytest-asyncio's loop plays no part and the backend chooses the loop."""

    def test(backend: Backend) -> None:
        backend.run(body)

    test.__name__ = body.__name__
    test.__qualname__ = body.__qualname__
    test.__doc__ = body.__doc__
    test.__module__ = body.__module__
    return test


def now() -> float:
    """The running loop's clock, in seconds: the machine's monotonic clock on the real
    backend, virtual on the model's."""
    return asyncio.get_running_loop().time()


_NAMES = itertools.count(1)  # per session, for every real backend: they share the server


class Backend(abc.ABC):
    """A server for the contracts, and the loop they run on. What the backends share is here:
    the buses a contract connected, closed after its run, names fresh for the session, and time
    that passes on the running loop; a backend adds its server (`url`, `restart_server`) and
    its loop (`run`)."""

    name: str  # "real", "model": the test's id

    def __init__(self) -> None:
        self._buses: list[Bus] = []

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The server's address, while a contract runs."""

    @abc.abstractmethod
    def run(self, contract: Contract) -> None:
        """Run `contract` with this backend to its end on the backend's loop (through `_run`,
        which closes every `Bus` it connected); the contract's failure is raised here."""

    @abc.abstractmethod
    async def restart_server(self) -> None:
        """Kill the server without a word to its clients (SIGKILL) and start it again on the
        same address with the same store; return once it accepts connections. What it
        acknowledged as stored survives; open connections break and reconnect."""

    async def _run(self, contract: Contract) -> None:
        try:
            await contract(self)
        finally:
            buses, self._buses = self._buses, []
            for bus in reversed(buses):
                await bus.close()

    def fresh(self, stem: str) -> str:
        """`stem` made into a name no other contract of this session uses (for a stream, a
        bucket, a consumer or a subject prefix: letters, digits and `_` only)."""
        return f"{stem}_{next(_NAMES)}"

    async def connect(self, name: str) -> Bus:
        """A new connection to the server, as a worker or an engine makes one
        (`Bus.connect`); closed when the contract ends."""
        bus = await Bus.connect(NatsSettings(url=self.url), name)
        self._buses.append(bus)
        return bus

    async def advance(self, seconds: float) -> None:
        """Let `seconds` pass: the one place where a contract waits for time and not for a
        condition. The real backend sleeps; the model's loop moves its virtual clock."""
        await asyncio.sleep(seconds)


class RealBackend(Backend):
    """A real single `nats-server -js` (`EmbeddedNats`), shared by the session's contracts and
    writing through to disk, so that a restart loses nothing it acknowledged."""

    name = "real"
    SERVER_CONFIG = "jetstream { sync_interval: always }"

    def __init__(self, server: EmbeddedNats) -> None:
        super().__init__()
        self._server = server

    @property
    def url(self) -> str:
        return self._server.url

    def run(self, contract: Contract) -> None:
        asyncio.run(self._run(contract))

    async def restart_server(self) -> None:
        # The harness waits for the process synchronously: off the loop, so that the
        # contract's clients notice the loss meanwhile as they would.
        await asyncio.to_thread(self._server.stop, True)
        await asyncio.to_thread(self._server.start)


class ModelBackend(Backend):
    """The model of the server (worker.sim.nats) as one node, as the real backend's server is
    one, run on the simulation's loop from `seed`: each contract gets a new model, so it
    needs no fresh names, and virtual time, so `advance` takes no wall time."""

    name = "model"

    def __init__(self, seed: int) -> None:
        super().__init__()
        self._seed = seed
        self._cluster: SimCluster | None = None

    @property
    def cluster(self) -> SimCluster:
        if self._cluster is None:
            raise RuntimeError("the model backend has no server outside a contract's run")
        return self._cluster

    @property
    def url(self) -> str:
        return self.cluster.url

    def run(self, contract: Contract) -> None:
        self._cluster = SimCluster(random.Random(self._seed), nodes=1)
        with natspy.pinned():
            simloop.run(
                lambda: self._run(contract),
                self._seed,
                connect=self._cluster.network.create_connection,
            )

    async def restart_server(self) -> None:
        # What it stored survives (the model keeps its state); its connections break.
        for host in self.cluster.hosts:
            self.cluster.node_down(host)
            self.cluster.node_up(host)
