"""`client.lease.Lease` against a connection that stores or times out as told: every attempt at
a fresh lease carries one incarnation until one is stored, so that an attempt given up on and
stored later (nats-py sends what it buffered while disconnected once it reconnects) is the same
incarnation as the lease the engine goes on with, not one that the next replaces."""

from __future__ import annotations

import asyncio
from typing import cast

import msgspec

from kvhandoff.client.connection import Connection
from kvhandoff.client.errors import BusUnavailable
from kvhandoff.client.lease import Lease
from kvhandoff.events.leases import EngineLease

ENGINE = "prefill-0"


class FlakyConnection:
    """Records the incarnation of every attempt; fails those made while `cut` is set."""

    def __init__(self) -> None:
        self.cut = False
        self.attempts: list[tuple[str, bool]] = []  # (incarnation, stored)
        self.attempted = asyncio.Condition()

    async def put_lease(
        self, engine_id: str, value: bytes, ttl_s: float, *, give_up_after_s: float
    ) -> None:
        incarnation = msgspec.json.decode(value, type=EngineLease).incarnation
        async with self.attempted:
            self.attempts.append((incarnation, not self.cut))
            self.attempted.notify_all()
        if self.cut:
            raise BusUnavailable(f"{engine_id}: renewing its lease: nats: timeout")

    async def until(self, attempts: int) -> None:
        async with self.attempted:
            await self.attempted.wait_for(lambda: len(self.attempts) >= attempts)


async def test_a_fenced_engine_tries_one_new_incarnation_until_it_is_stored() -> None:
    connection = FlakyConnection()
    fences: list[str | None] = []
    lease = Lease(cast(Connection, connection), ENGINE, 1.0, lambda: fences.append(None))
    await lease.acquire()
    first = lease.incarnation
    renewing = asyncio.create_task(lease.run())
    try:
        connection.cut = True
        await asyncio.wait_for(connection.until(8), 30.0)  # past the lease: fenced meanwhile
        connection.cut = False
        await asyncio.wait_for(connection.until(9), 30.0)
    finally:
        renewing.cancel()
    assert len(fences) == 1 and lease.incarnation not in (None, first)
    fresh = [incarnation for incarnation, _ in connection.attempts if incarnation != first]
    assert fresh and set(fresh) == {lease.incarnation}, connection.attempts
    assert connection.attempts[-1] == (lease.incarnation, True)


async def test_the_first_lease_keeps_its_incarnation_across_attempts() -> None:
    connection = FlakyConnection()
    connection.cut = True
    lease = Lease(cast(Connection, connection), ENGINE, 1.0, lambda: None)
    acquiring = asyncio.create_task(lease.acquire())
    await asyncio.wait_for(connection.until(2), 30.0)
    connection.cut = False
    await asyncio.wait_for(acquiring, 30.0)
    assert {incarnation for incarnation, _ in connection.attempts} == {lease.incarnation}
    assert [stored for _, stored in connection.attempts][-1]
