"""The three-node cluster the scale-out tests run on (`worker.harness.natsserver.NatsCluster`): it
forms a JetStream meta group, every node serves JetStream, and a node killed with SIGKILL while it
leads a replicated stream loses nothing that stream acknowledged, then rejoins on restart.

nats-py plays the client here, so that these tests check the cluster and nothing of ours.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.api import StreamConfig

from kvhandoff.worker.harness.natsserver import CLUSTER_SIZE, NatsCluster
from tests.cluster.conftest import WITHIN_S
from tests.eventually import until

STREAM = "REPLICATED"


async def connect(url: str) -> Client:
    return await nats.connect(
        url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2, connect_timeout=5
    )


async def test_the_cluster_forms_and_every_node_serves_jetstream(
    nats_cluster: NatsCluster,
) -> None:
    leaders = set()
    for node in nats_cluster.nodes:
        nc = await connect(node.url)  # this node alone
        try:
            assert nc._server_info.get("cluster") == "kvhandoff"
            reply = await nc.request("$JS.API.INFO", b"", timeout=WITHIN_S)
            assert "error" not in json.loads(reply.data), reply.data
            # An R3 stream needs all three peers in the meta group: each node can make one.
            info = await nc.jetstream().add_stream(
                StreamConfig(name=f"ON_{node.port}", subjects=[f"on.{node.port}"], num_replicas=3)
            )
            assert info.cluster is not None
            leaders.add(info.cluster.leader)
            assert len(info.cluster.replicas or []) == CLUSTER_SIZE - 1
        finally:
            await nc.close()
    assert leaders <= {"n1", "n2", "n3"}


async def test_killing_the_stream_leader_loses_nothing_acknowledged_and_it_rejoins(
    nats_cluster: NatsCluster,
) -> None:
    nc = await connect(nats_cluster.url)
    js = nc.jetstream()
    try:
        info = await js.add_stream(StreamConfig(name=STREAM, subjects=["rep.>"], num_replicas=3))
        assert info.cluster is not None and info.cluster.leader
        leader = nats_cluster.node(info.cluster.leader)

        acknowledged: list[int] = []
        n = 0

        async def publish_until(count: int) -> None:
            nonlocal n
            deadline = time.monotonic() + WITHIN_S
            while len(acknowledged) < count:
                assert time.monotonic() < deadline, f"{len(acknowledged)} of {count} stored"
                try:
                    await js.publish(f"rep.{n}", str(n).encode(), timeout=2)
                except (nats.errors.Error, TimeoutError):
                    # Not acknowledged (the leader died, an election runs): it may or may not
                    # be stored, and only what was acknowledged must survive.
                    await asyncio.sleep(0.05)  # back-off before the next attempt
                else:
                    acknowledged.append(n)
                n += 1

        await publish_until(200)
        leader.stop(kill=True)
        await publish_until(400)  # the two others elect a new leader and go on

        nats_cluster.restart(leader)
        await publish_until(500)
        info = await js.stream_info(STREAM)
        assert info.cluster is not None
        stored = set()
        for seq in range(1, info.state.last_seq + 1):
            message = await js.get_msg(STREAM, seq)
            assert message.data is not None
            stored.add(int(message.data))
        assert set(acknowledged) <= stored
        # The restarted node caught up: every replica is current again, within a bound.

        async def replicas_current() -> bool:
            nonlocal info
            info = await js.stream_info(STREAM)
            assert info.cluster is not None
            return all(p.current for p in (info.cluster.replicas or []))

        await until(
            replicas_current,
            "every replica current",
            within=WITHIN_S,
            every=0.1,
            context=lambda: info.cluster,
        )
        assert info.cluster is not None
        assert len(info.cluster.replicas or []) == CLUSTER_SIZE - 1
    finally:
        await nc.close()
