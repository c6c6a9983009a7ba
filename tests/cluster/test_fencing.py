"""The fence (see "Fencing" in worker.bus.publish): compare-and-set appends to a partition's subject
of the replicated log stream, on the real three-node cluster. Of two writers that both read the same
last sequence, exactly one appends; the other gets `Fenced`. A new owner's ownership record fences
the old owner's next append. A retried append (same `Nats-Msg-Id`) is not fenced by its own first
attempt. The chain survives the death of the stream's leader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.js import JetStreamContext

from kvhandoff.events.subjects import partition_log_subject
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.bus.streams import last_sequence
from kvhandoff.worker.errors import Fenced
from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.tier.streams import open_partition_log
from tests.cluster.conftest import WITHIN_S

PREFIX = "kvhandoff"
LOG_STREAM = "KVHANDOFF_LOG"
SUBJECT = partition_log_subject(PREFIX, 3)
ROUNDS = 20


@pytest.fixture
async def log_bus(bus: Bus) -> Bus:
    await open_partition_log(bus, LOG_STREAM, PREFIX)
    return bus


@pytest.fixture
async def rival(nats_cluster: NatsCluster, log_bus: Bus) -> AsyncIterator[Bus]:
    """Another worker's connection, to another node when the client picks one at random."""
    bus = await Bus.connect(NatsSettings(url=nats_cluster.url), "test-rival")
    yield bus
    await bus.close()


async def test_an_append_returns_its_sequence_and_a_stale_one_is_fenced(
    log_bus: Bus, js: JetStreamContext
) -> None:
    info = await js.stream_info(LOG_STREAM)
    assert info.config.num_replicas == 3
    assert await last_sequence(log_bus, LOG_STREAM, SUBJECT) == 0
    first = await log_bus.append_expecting(
        SUBJECT, b"epoch 1", last_seq=0, give_up_after_s=WITHIN_S
    )
    second = await log_bus.append_expecting(SUBJECT, b"r", last_seq=first, give_up_after_s=WITHIN_S)
    assert second > first
    assert await last_sequence(log_bus, LOG_STREAM, SUBJECT) == second
    with pytest.raises(Fenced, match=rf"{SUBJECT} expecting last sequence {first} was refused"):
        await log_bus.append_expecting(SUBJECT, b"late", last_seq=first)
    # Another partition's subject is a chain of its own.
    other = partition_log_subject(PREFIX, 4)
    assert await log_bus.append_expecting(other, b"epoch 1", last_seq=0) > second


async def test_of_two_concurrent_appends_at_one_sequence_exactly_one_succeeds(
    log_bus: Bus, rival: Bus, js: JetStreamContext
) -> None:
    last = 0
    for round_ in range(ROUNDS):
        results = await asyncio.gather(
            log_bus.append_expecting(SUBJECT, b"a%d" % round_, last, give_up_after_s=WITHIN_S),
            rival.append_expecting(SUBJECT, b"b%d" % round_, last, give_up_after_s=WITHIN_S),
            return_exceptions=True,
        )
        won = [r for r in results if isinstance(r, int)]
        fenced = [r for r in results if isinstance(r, Fenced)]
        assert len(won) == 1 and len(fenced) == 1, results
        last = won[0]
    # The log holds one record per round, in round order, and nothing else.
    info = await js.stream_info(LOG_STREAM)
    assert info.state.messages == ROUNDS
    rounds = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        data = (await js.get_msg(LOG_STREAM, seq)).data
        assert data is not None
        rounds.append(int(data[1:]))
    assert rounds == list(range(ROUNDS))


async def test_a_new_owners_ownership_record_fences_the_old_owner(log_bus: Bus, rival: Bus) -> None:
    old_owner, new_owner = log_bus, rival
    at = await old_owner.append_expecting(SUBJECT, b"owner old, epoch 1", last_seq=0)
    at = await old_owner.append_expecting(SUBJECT, b"record", last_seq=at)
    # The new owner reads where the log is, and appends its ownership record there.
    seen = await last_sequence(new_owner, LOG_STREAM, SUBJECT)
    assert seen == at
    await new_owner.append_expecting(SUBJECT, b"owner new, epoch 2", last_seq=seen)
    # The old owner, paused meanwhile, wakes and appends where it left off: refused.
    with pytest.raises(Fenced):
        await old_owner.append_expecting(SUBJECT, b"zombie record", last_seq=at)


async def test_a_retried_append_is_not_fenced_by_its_own_first_attempt(
    log_bus: Bus, js: JetStreamContext
) -> None:
    # What `append_expecting` relies on when it retries after a lost acknowledgement: the
    # stream checks the message id before the expected sequence.
    headers = {"Nats-Msg-Id": "one-append", "Nats-Expected-Last-Subject-Sequence": "0"}
    first = await js.publish(SUBJECT, b"x", headers=headers)
    again = await js.publish(SUBJECT, b"x", headers=headers)
    assert again.duplicate and again.seq == first.seq


async def test_appends_go_on_across_the_death_of_the_stream_leader(
    nats_cluster: NatsCluster, log_bus: Bus, js: JetStreamContext
) -> None:
    last = 0
    for n in range(50):
        last = await log_bus.append_expecting(SUBJECT, b"%d" % n, last, give_up_after_s=WITHIN_S)
    info = await js.stream_info(LOG_STREAM)
    assert info.cluster is not None and info.cluster.leader
    nats_cluster.node(info.cluster.leader).stop(kill=True)
    for n in range(50, 100):
        last = await log_bus.append_expecting(SUBJECT, b"%d" % n, last, give_up_after_s=WITHIN_S)
    assert await last_sequence(log_bus, LOG_STREAM, SUBJECT) == last
    info = await js.stream_info(LOG_STREAM)
    assert info.state.messages == 100  # each once: no retry stored a record twice
