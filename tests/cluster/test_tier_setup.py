"""A tier worker (worker.tier.membership) started while the cluster cannot answer JetStream's API
(two of its three nodes down: no meta leader) keeps trying to set up, and owns every partition once
the cluster has its quorum back, rather than exiting and leaving the tier a worker short."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import pytest

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Inbound
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.tier.membership import Tier, TierSettings
from kvhandoff.worker.tier.owner import Decided
from tests.cluster.conftest import WITHIN_S
from tests.cluster.stand_in import StandIn
from tests.eventually import still_running, until


async def _decide(_: Sequence[Inbound]) -> Decided:
    raise AssertionError("no input was published")


async def _act(_: Sequence[Inbound]) -> None:
    raise AssertionError("no input was published")


async def test_a_worker_started_without_a_quorum_sets_up_once_the_cluster_has_one(
    nats_cluster: NatsCluster, caplog: pytest.LogCaptureFixture
) -> None:
    # No snapshots: the stand-in coordinator has no state to sum up.
    settings = TierSettings(partitions=2, rebalance_s=0.2, snapshots=None)
    survivor, *down = nats_cluster.nodes
    for node in down:
        node.stop(kill=True)
    bus = await Bus.connect(NatsSettings(url=survivor.url), "test-tier-setup")
    tier = Tier(bus, settings, lambda _: StandIn(_decide, _act), "w1")
    stop = asyncio.Event()
    caplog.set_level(logging.WARNING, logger="kvhandoff.worker.tier.membership")
    running = asyncio.create_task(tier.run(stop))
    try:
        await until(
            lambda: "cannot set up yet" in caplog.text,
            "the tier waits to set up",
            within=2 * WITHIN_S,
            guard=still_running(running),
        )
        assert tier.owned == set()
        for node in down:
            await asyncio.to_thread(nats_cluster.restart, node, WITHIN_S)
        await until(
            lambda: tier.owned == {0, 1},
            "the tier owns both partitions",
            within=2 * WITHIN_S,
            guard=still_running(running),
        )
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, WITHIN_S)
        await bus.close()
    running.result()  # it stopped cleanly
