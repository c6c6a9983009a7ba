"""Fixtures for the client's tests: the worker's real nats-server and real worker process
(reused from tests/worker/conftest.py), and client connections to that server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kvhandoff.client import Connection
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.client.proxy import proxy  # noqa: F401  # a fixture, shared
from tests.worker.conftest import nats_server, worker  # noqa: F401  # fixtures, reused

Connect = Callable[..., Awaitable[Connection]]


@pytest.fixture
async def connect(nats_server: EmbeddedNats) -> AsyncIterator[Connect]:  # noqa: F811
    """Opens client connections (to the test's server, or to `url`); closed after the test."""
    opened: list[Connection] = []

    async def open_one(url: str | None = None) -> Connection:
        connection = await Connection.open(NatsSettings(url=url or nats_server.url), "test")
        opened.append(connection)
        return connection

    yield open_one
    for connection in opened:
        await connection.close()
