"""A partition's fenced log (worker.tier.ownership) on the real cluster, in one process: a claim
catches up and counts the epoch on; a later claim fences the earlier owner, whose every later
append is refused, the first by JetStream and the rest by itself; of two racing claimants
exactly one can append; a claimant learns every input applied before it.
"""

from __future__ import annotations

import asyncio

import pytest
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.errors import BusError, Fenced
from kvhandoff.worker.tier.entries import Appended, Claimed, Entry
from kvhandoff.worker.tier.ownership import PartitionLog, read_entries

PREFIX = "kvhandoff"
LOG_STREAM = "KVHANDOFF_LOG"
PARTITION = 2


def log_of(bus: Bus, owner: str) -> PartitionLog:
    return PartitionLog(bus, LOG_STREAM, PREFIX, PARTITION, owner)


async def entries(js: JetStreamContext) -> list[Entry]:
    """The partition's entries in the stream, a snapshot's parts joined."""
    info = await js.stream_info(LOG_STREAM)
    stored = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            data = (await js.get_msg(LOG_STREAM, seq)).data
        except NotFoundError:
            continue  # rolled up by a snapshot
        assert data is not None
        stored.append((seq, data))
    return read_entries(PARTITION, LOG_STREAM, stored)


async def test_a_claim_fences_the_previous_owner_for_good(
    bus: Bus, other: Bus, js: JetStreamContext
) -> None:
    old = log_of(bus, "old")
    caught = await old.claim()
    assert (caught.epoch, caught.previous_owner, caught.applied) == (1, None, set())
    await old.append([10, 11], b"r1")
    await old.append([12], b"r2")

    new = log_of(other, "new")
    caught = await new.claim()
    assert (caught.epoch, caught.previous_owner) == (2, "old")
    assert caught.applied == {10, 11, 12} and caught.records == [b"r1", b"r2"]
    await new.append([13], b"r3")

    with pytest.raises(Fenced, match="another writer appended first"):
        await old.append([13], b"zombie")
    assert old.fenced
    with pytest.raises(Fenced, match="fenced already"):
        await old.append([14], b"zombie again")
    with pytest.raises(BusError, match="once per PartitionLog"):
        await old.claim()
    assert await entries(js) == [
        Claimed(epoch=1, owner="old", at_ms=_at(await entries(js), 0)),
        Appended(epoch=1, inputs=[10, 11], records=b"r1"),
        Appended(epoch=1, inputs=[12], records=b"r2"),
        Claimed(epoch=2, owner="new", at_ms=_at(await entries(js), 3)),
        Appended(epoch=2, inputs=[13], records=b"r3"),
    ]
    # Claimed anew, the old owner learns what happened meanwhile and goes on from there.
    again = old.anew()
    assert (await again.claim()).applied == {10, 11, 12, 13}
    assert again.epoch == 3


def _at(found: list[Entry], index: int) -> int:
    entry = found[index]
    assert isinstance(entry, Claimed)
    return entry.at_ms


async def test_of_two_racing_claimants_exactly_one_owns_the_partition(
    bus: Bus, other: Bus, js: JetStreamContext
) -> None:
    for round_ in range(10):
        first, second = log_of(bus, f"a{round_}"), log_of(other, f"b{round_}")
        # Both may claim (one after the other: the later one owns it), or one claim is refused.
        await asyncio.gather(first.claim(), second.claim(), return_exceptions=True)
        results = await asyncio.gather(
            *(log.append([round_], b"") for log in (first, second) if not log.fenced),
            return_exceptions=True,
        )
        assert [isinstance(r, int) for r in results].count(True) == 1, results
        assert [first.fenced, second.fenced].count(True) == 1
    found = await entries(js)
    claims = [e for e in found if isinstance(e, Claimed)]
    assert [c.epoch for c in claims] == list(range(1, len(claims) + 1))
    # One append per round, each by the owner of the epoch it names: the last claimant.
    appends = [e for e in found if isinstance(e, Appended)]
    assert [a.inputs for a in appends] == [[n] for n in range(10)]
    for position, entry in enumerate(found):
        if isinstance(entry, Appended):
            owner = next(e for e in reversed(found[:position]) if isinstance(e, Claimed))
            assert entry.epoch == owner.epoch


async def test_an_append_before_a_claim_is_refused(bus: Bus, other: Bus) -> None:
    with pytest.raises(BusError, match="append before claim"):
        await log_of(bus, "hasty").append([1], b"")
