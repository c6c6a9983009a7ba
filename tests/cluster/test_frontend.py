"""The frontend client (client.frontend) on the three-node cluster: a wait whose read of the
completion stream fails (the stream has lost its quorum: two nodes down) reads it again until it
can, and returns the completion, instead of ending the wait with the bus's error."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from kvhandoff.client import Connection, Frontend
from kvhandoff.events.codec import encode
from kvhandoff.events.messages import Complete, HandoffCompletion
from kvhandoff.events.subjects import DEFAULT_DONE_STREAM, Subjects
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.tier.streams import open_completions
from tests import eventually
from tests.cluster.conftest import WITHIN_S, until


async def test_a_wait_reads_the_completion_stream_again_until_it_answers(
    nats_cluster: NatsCluster, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    subjects = Subjects()
    await open_completions(bus, DEFAULT_DONE_STREAM, subjects.completions, 3600)
    handoff_id = uuid.uuid4()
    complete = Complete(handoff_id, 7, HandoffCompletion.SUCCESS)
    await bus.publish_stored(subjects.done(handoff_id), encode(complete))
    await bus.flush()
    # The survivor must not lead the stream: a leader answers reads for a while after it lost
    # its quorum, until it notices and steps down.
    await until(
        lambda: nats_cluster.stream_leader(DEFAULT_DONE_STREAM) is not None, "a stream leader"
    )
    leader = nats_cluster.stream_leader(DEFAULT_DONE_STREAM)
    assert leader is not None
    survivor, other = [node for node in nats_cluster.nodes if node is not leader]
    down = [leader, other]
    for node in down:
        node.stop(kill=True)
    connection = await Connection.open(NatsSettings(url=survivor.url), "test-frontend")
    caplog.set_level(logging.WARNING, logger="kvhandoff.client.frontend")
    try:
        frontend = await Frontend.open(connection)
        # Started elsewhere: the wait reads the stream, which has no leader now.
        waiting = asyncio.create_task(frontend.wait(handoff_id, timeout_s=4 * WITHIN_S))
        await eventually.until(
            lambda: "reading it again" in caplog.text,
            "the frontend reads the stream again",
            within=2 * WITHIN_S,
            guard=eventually.still_running(waiting),
        )
        for node in down:
            await asyncio.to_thread(nats_cluster.restart, node, WITHIN_S)
        assert await waiting == complete
    finally:
        await connection.close()
