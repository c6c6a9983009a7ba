"""Membership (see "Membership" in worker.tier.members): workers announce themselves in the
replicated KV bucket `KVHANDOFF_MEMBERS`, with a TTL; a worker that keeps its announcement stays
listed, one that stops refreshing (dead, or paused) drops out after the TTL, one that leaves drops
out at once. Real three-node cluster; waits are bounded polls of the bucket."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from nats.js import JetStreamContext

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.tier.members import MEMBER_TTL_S, MEMBERS_BUCKET, Member, announce, members
from tests.cluster.conftest import WITHIN_S
from tests.eventually import until

TIER = "KVHANDOFF_IN"  # the tier's input stream


async def listed(bus: Bus) -> set[str]:
    return {member.instance for member in await members(bus, TIER)}


def in_a_row(holds: Callable[[set[str]], bool], times: int = 5) -> Callable[[set[str]], bool]:
    """`holds`, once it held for `times` listings in a row."""
    streak = 0

    def held(now: set[str]) -> bool:
        nonlocal streak
        streak = streak + 1 if holds(now) else 0
        return streak >= times

    return held


async def until_listed(bus: Bus, holds: Callable[[set[str]], bool], what: str) -> float:
    """Poll the bucket until `holds(listed instances)`; how long that took."""

    async def check() -> bool:
        return holds(await listed(bus))

    return await until(check, what, within=WITHIN_S, every=0.1)


async def test_members_are_listed_oldest_first_and_one_that_leaves_goes_at_once(
    bus: Bus, js: JetStreamContext
) -> None:
    assert await members(bus, TIER) == []
    first, second = Member.this_process(), Member.this_process()
    one = await announce(bus, first, TIER)
    two = await announce(bus, second, TIER)
    await until_listed(bus, in_a_row(lambda now: now == {first.instance, second.instance}), "both")
    assert await members(bus, TIER) == sorted(
        [first, second], key=lambda m: (m.since_ms, m.instance)
    )
    status = await js.find_stream_name_by_subject(f"$KV.{MEMBERS_BUCKET}.x")
    info = await js.stream_info(status)
    assert info.config.num_replicas == 3 and info.config.max_age == MEMBER_TTL_S

    # Another tier's worker in the same bucket is not one of this tier's.
    elsewhere = await announce(bus, Member.this_process(), "OTHER_IN")
    assert {m.instance for m in await members(bus, "OTHER_IN")} == {elsewhere.member.instance}
    assert await members(bus, TIER) == sorted(
        [first, second], key=lambda m: (m.since_ms, m.instance)
    )
    await elsewhere.leave()

    await one.leave()
    await until_listed(bus, in_a_row(lambda now: now == {second.instance}), "one left")
    await two.leave()
    await until_listed(bus, in_a_row(lambda now: now == set()), "both left")


async def test_a_kept_member_outlives_the_ttl_and_a_silent_one_expires(
    nats_cluster: NatsCluster, bus: Bus
) -> None:
    kept = await announce(bus, Member.this_process(), TIER)
    keeper = asyncio.create_task(kept.keep())
    other = await Bus.connect(NatsSettings(url=nats_cluster.url), "test-silent")
    silent = await announce(other, Member.this_process(), TIER)
    await other.close()  # dead without leaving: nobody refreshes its key
    try:
        both = {kept.member.instance, silent.member.instance}
        # Reads may be served by any replica of the bucket, one that has not applied the latest
        # put yet, or (around the TTL) one that has not expired a key yet that another has: so
        # a listing is waited for, until it holds a few times in a row.
        await until_listed(bus, in_a_row(lambda now: now == both), "both listed")
        expired_s = await until_listed(
            bus, in_a_row(lambda now: now == {kept.member.instance}), "the silent one expired"
        )
        print(
            f"a silent member dropped out {expired_s:.1f}s after it stopped (TTL {MEMBER_TTL_S}s)"
        )
        outlived = time.monotonic() + MEMBER_TTL_S
        while time.monotonic() < outlived:
            assert kept.member.instance in await listed(bus)
            await asyncio.sleep(0.5)  # a bounded poll of the bucket, for one more TTL
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        await kept.leave()
