"""A durable publish (`Bus.publish_durable`, as the engines, frontends and load generator send
every input) on the real three-node cluster, through its own attempt still being replicated.

A stream's leader that cannot reach its followers holds a publish "in process": the attempt
gets no answer within its time, and the next attempt, under the same `Nats-Msg-Id`, is refused
with err_code 10158 ("duplicate message id is in process") for as long as the first is not
committed. The publish must carry on through that and store the message once, as the
partition log's appends do (the same `_store` loop); it used to give up at the first 10158,
which failed a load on the container cluster on a busy machine.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import nats.js.errors
import pytest
from nats.js import JetStreamContext

from kvhandoff.worker.bus import Bus
from kvhandoff.worker.config import NatsSettings
from kvhandoff.worker.natsserver import EmbeddedNats, NatsCluster
from tests.cluster.conftest import WITHIN_S, publish

STREAM = "DURABLE"
IN_PROCESS = 10158


@pytest.fixture
async def leader(nats_cluster: NatsCluster, js: JetStreamContext) -> EmbeddedNats:
    """The leader of a three-replica stream `DURABLE` that answers on every node."""
    await js.add_stream(name=STREAM, subjects=["durable.>"], num_replicas=3)
    await publish(js, "durable.ready", b"")
    node = nats_cluster.stream_leader(STREAM)
    assert node is not None
    return node


@pytest.fixture
async def leader_bus(leader: EmbeddedNats) -> AsyncIterator[Bus]:
    """A Bus connected to the stream's leader only, which stays up while its followers stop."""
    bus = await Bus.connect(NatsSettings(url=leader.url), "test-durable")
    yield bus
    await bus.close()


async def test_a_durable_publish_carries_on_while_its_first_attempt_is_being_replicated(
    nats_cluster: NatsCluster, leader: EmbeddedNats, leader_bus: Bus, js: JetStreamContext,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    refused = asyncio.Event()
    publish_once = leader_bus._js.publish

    async def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            return await publish_once(*args, **kwargs)
        except nats.js.errors.APIError as exc:
            if exc.err_code == IN_PROCESS:
                refused.set()
            raise

    monkeypatch.setattr(leader_bus._js, "publish", watched)
    followers = [node for node in nats_cluster.nodes if node is not leader]
    for node in followers:
        assert node.pid is not None
        os.kill(node.pid, signal.SIGSTOP)  # the leader cannot commit: the attempt stays staged
    try:
        publishing = asyncio.create_task(
            leader_bus.publish_durable("durable.x", b"x", give_up_after_s=4 * WITHIN_S)
        )
        await asyncio.wait_for(refused.wait(), WITHIN_S)  # an attempt got 10158
        assert not publishing.done(), publishing
    finally:
        for node in followers:
            assert node.pid is not None
            os.kill(node.pid, signal.SIGCONT)
    await asyncio.wait_for(publishing, 2 * WITHIN_S)
    info = await js.stream_info(STREAM)
    assert info.state.messages == 2  # the ready message, and this one once
