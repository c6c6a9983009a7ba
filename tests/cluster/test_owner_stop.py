"""A partition owner (worker.tier.owner) that is asked to stop while idle stops at once:
its fetch is woken (`Pull.wake`), so neither a graceful shutdown nor a hand-over waits out the
fetch's timeout."""

from __future__ import annotations

import pytest

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.tier import owner as owner_module
from tests.cluster.conftest import WITHIN_S
from tests.cluster.test_owner_memory import INPUTS, _owner_of
from tests.eventually import still_running, until


async def test_an_idle_owner_stops_at_once_though_its_fetch_would_wait_an_hour(
    nats_cluster: NatsCluster, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(owner_module, "_FETCH_TIMEOUT_S", 3600.0)
    applied: list[int] = []
    async with _owner_of(bus, applied) as (owner, running):
        await until(
            lambda: len(applied) >= INPUTS,
            "every input applied",
            within=2 * WITHIN_S,
            guard=still_running(running),
        )
    # Every input applied, its fetch waiting for more: leaving `_owner_of` sets the stop and
    # waits WITHIN_S for the owner, then cancels it.
    assert not running.cancelled() and running.exception() is None
    assert owner.handed_over
