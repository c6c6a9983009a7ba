"""The balance rule of the tier (worker.tier.balance), without NATS: property-based over the
partition count and the set of live workers. Every partition has exactly one worker; every
worker gets floor(P / live) or ceil(P / live); every worker computes the same assignment from
the same set, in whatever order it read it; a worker's moves lead exactly to its share.
Then, against a real server, `partition_of` is the partition the stream's transform chooses.
"""

from __future__ import annotations

import uuid
from random import Random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js import JetStreamContext

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.tier.balance import assign, fair_share, partition_of, rebalance
from kvhandoff.worker.tier.streams import open_partitions
from tests.cluster.conftest import publish

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
workers = st.sets(names, min_size=1, max_size=12)
counts = st.integers(min_value=1, max_value=128)


@given(counts, workers)
def test_every_partition_has_one_worker_and_every_worker_a_fair_share(
    partitions: int, live: set[str]
) -> None:
    owners = assign(partitions, live)
    assert sorted(owners) == list(range(partitions))
    assert set(owners.values()) <= live
    loads = [sum(1 for w in owners.values() if w == name) for name in live]
    floor = partitions // len(live)
    assert all(floor <= load <= fair_share(partitions, len(live)) for load in loads), loads
    assert sum(loads) == partitions


@given(counts, workers, st.randoms(use_true_random=False))
def test_every_worker_computes_the_same_assignment_from_the_same_set(
    partitions: int, live: set[str], rng: Random
) -> None:
    shuffled = sorted(live)
    rng.shuffle(shuffled)
    assert assign(partitions, shuffled) == assign(partitions, sorted(live))
    assert assign(partitions, [*shuffled, *shuffled]) == assign(partitions, live)


@given(counts, workers, names, st.sets(st.integers(min_value=0, max_value=127)))
def test_a_workers_moves_lead_exactly_to_its_share(
    partitions: int, live: set[str], me: str, owned: set[int]
) -> None:
    owned = {p for p in owned if p < partitions}
    moves = rebalance(partitions, live, me, owned)
    target = {p for p, name in assign(partitions, live | {me}).items() if name == me}
    assert (owned | moves.take) - moves.hand_over == target
    assert moves.take.isdisjoint(owned) and moves.hand_over <= owned
    # It counts itself live even when the bucket does not list it (its key lapsed).
    assert rebalance(partitions, live - {me}, me, owned) == moves


def test_one_worker_owns_everything_and_a_second_takes_about_half() -> None:
    assert assign(16, ["a"]) == dict.fromkeys(range(16), "a")
    moves = rebalance(16, ["a", "b"], "a", range(16))
    assert moves.take == frozenset() and len(moves.hand_over) == 8


@pytest.mark.parametrize("bad", [(0, 1), (1, 0), (-1, 3)])
def test_nonsense_counts_are_refused(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="partitions over"):
        fair_share(*bad)


async def test_partition_of_is_the_partition_the_stream_chooses(
    bus: Bus, js: JetStreamContext
) -> None:
    partitions = 7
    await open_partitions(bus, "KVHANDOFF_IN", "kvhandoff", partitions)
    for _ in range(50):
        handoff = uuid.uuid4()
        seq = await publish(js, f"kvhandoff.in.{handoff}", b"x")
        subject = (await js.get_msg("KVHANDOFF_IN", seq)).subject
        assert subject == f"kvhandoff.inp.{partition_of(handoff, partitions)}.{handoff}"
