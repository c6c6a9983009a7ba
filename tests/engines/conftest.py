"""Fixtures for the mock engine and load generator tests. One real nats-server serves the
session; every test gets its own subject prefix, and so its own input stream, which keeps tests
apart without restarting the server."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import nats
import pytest

from kvhandoff.client import Connection
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.engines import EngineModel, EnginesConfig, Faults, MockEngines, Roster
from kvhandoff.worker.harness.child import WorkerChild
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.client.proxy import proxy  # noqa: F401  # a fixture, shared
from tests.engines.harness import FAST, ONE_PAIR, WorkerSide


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def subjects() -> Subjects:
    return Subjects(f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def worker_side(nats_server: EmbeddedNats, subjects: Subjects) -> AsyncIterator[WorkerSide]:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    stream = f"IN_{subjects.prefix}"
    await js.add_stream(name=stream, subjects=[subjects.inputs])
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "worker-side")
    side = WorkerSide(bus, subjects)
    await side.start()
    yield side
    await bus.close()
    await js.delete_stream(stream)
    await nc.close()


StartEngines = Callable[..., Awaitable[MockEngines]]


@pytest.fixture
async def start_engines(
    nats_server: EmbeddedNats, subjects: Subjects
) -> AsyncIterator[StartEngines]:
    """Starts mock engines on their own connection; stopped at the end of the test."""
    started: list[tuple[Bus, MockEngines]] = []

    async def start(
        model: EngineModel = FAST, faults: Faults | None = None, roster: Roster = ONE_PAIR
    ) -> MockEngines:
        bus = await Bus.connect(NatsSettings(url=nats_server.url), "test-engines")
        config = EnginesConfig(roster=roster, model=model, faults=faults or Faults())
        engines = MockEngines(Connection(bus, subjects), config)
        await engines.start()
        started.append((bus, engines))
        return engines

    yield start
    for bus, engines in started:
        await engines.stop()
        await bus.close()


@pytest.fixture
def worker(nats_server: EmbeddedNats, subjects: Subjects, tmp_path: Path) -> Iterator[Path]:
    """`kvhandoff run` on the test's subjects, up and healthy; yields its log."""
    prefix = subjects.prefix
    log = tmp_path / "worker.log"
    child = WorkerChild(
        nats_server.url,
        tmp_path / "kvhandoff.db",
        "--subject-prefix",
        prefix,
        "--stream",
        f"IN_{prefix}",
        "--consumer",
        f"W_{prefix}",
        "--done-stream",
        f"DONE_{prefix}",
        "--log-stream",
        f"LOG_{prefix}",
        "--retry-interval",
        "0.25s",
        log_path=log,
    )
    child.start()
    yield log
    assert child.terminate() == 0, log.read_text()
