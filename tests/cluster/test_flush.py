"""The barrier across a reconnect (see "The barrier" in worker.bus.publish): a node killed under a
connection loses what the connection had written and the node had not read, while a barrier
written after the reconnect comes back all the same. So a flush that a reconnect separates from
what it covers fails, and the next one, covering only what came after, proves that again; and a
`confirm` fails for what another caller's flush took across the reconnect.
Real cluster node, killed and restarted; the wait is for the Bus's own reconnect callback.
"""

from __future__ import annotations

import asyncio

import pytest

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.errors import BusError
from kvhandoff.worker.harness.natsserver import NatsCluster
from tests.cluster.conftest import WITHIN_S


async def test_a_flush_across_a_reconnect_fails_and_the_next_one_confirms(
    nats_cluster: NatsCluster,
) -> None:
    node = nats_cluster.nodes[0]
    bus = await Bus.connect(NatsSettings(url=node.url), "test-flush")  # this node only
    try:
        reconnected = asyncio.Event()
        bus.on_reconnect(reconnected.set)
        await bus.publish("kvhandoff.test.flush", b"written to the old connection")
        node.stop(kill=True)
        nats_cluster.restart(node)
        async with asyncio.timeout(2 * WITHIN_S):
            await reconnected.wait()
        with pytest.raises(BusError, match="reconnected"):
            await bus.flush()
        await bus.publish("kvhandoff.test.flush", b"written to the new connection")
        await bus.flush()
    finally:
        await bus.close()


async def test_a_confirm_fails_for_what_another_callers_flush_took_across_a_reconnect(
    nats_cluster: NatsCluster,
) -> None:
    # Two callers on one Bus, as a tier worker's partitions are: the first flush after the
    # reconnect takes (and fails for) what the other caller published, so that caller's own
    # flush proves nothing of it; its confirm, from the count it noted, fails all the same.
    node = nats_cluster.nodes[0]
    bus = await Bus.connect(NatsSettings(url=node.url), "test-confirm")  # this node only
    try:
        reconnected = asyncio.Event()
        bus.on_reconnect(reconnected.set)
        connection = bus.connection
        await bus.publish("kvhandoff.test.confirm", b"the other caller's, to the old connection")
        node.stop(kill=True)
        nats_cluster.restart(node)
        async with asyncio.timeout(2 * WITHIN_S):
            await reconnected.wait()
        with pytest.raises(BusError, match="reconnected"):
            await bus.flush()  # the first caller's: it took the other caller's publish
        with pytest.raises(BusError, match="reconnected"):
            await bus.confirm(connection, [])
        connection = bus.connection
        await bus.publish("kvhandoff.test.confirm", b"written to the new connection")
        await bus.confirm(connection, [])
    finally:
        await bus.close()
