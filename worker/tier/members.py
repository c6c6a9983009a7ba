"""Who is in the tier: each worker's announcement in a replicated KV bucket, and the listing.

Membership. Workers announce themselves in the KV bucket `KVHANDOFF_MEMBERS`: one key per worker
instance, `<tier>.<instance>` (the tier named by its input stream, so that tiers of other
streams on the same account count apart), one revision kept, dropped after `MEMBER_TTL_S`
without a refresh; `Membership.keep` refreshes it every third of that. `members` lists who is
live, read from the bucket's leader (no direct gets: a replica may answer from before the latest
refresh). Membership says who is *probably* alive, to size each worker's share (ceil(P / live));
it never decides who owns a partition. A paused worker stays listed until its TTL passes.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from kvhandoff.worker import ambient
from kvhandoff.worker.ambient import new_id, now_ms
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.kv import Bucket, open_bucket
from kvhandoff.worker.errors import BusError

logger = logging.getLogger(__name__)

MEMBERS_BUCKET = "KVHANDOFF_MEMBERS"
MEMBER_TTL_S = 5.0  # a dead worker counts as live this long, in every other worker's share
_KV_RETRY_S = 0.5  # after a refresh of a bucket's key that failed because NATS did not answer
_KV_DELETE_TIMEOUT_S = 2.0
_ANNOUNCE_GIVE_UP_S = 15.0


class Member(msgspec.Struct, frozen=True):
    """A worker of the tier, as it announces itself in `MEMBERS_BUCKET`: the value, as JSON.
    The key is `<tier>.<instance>` (`member_key`): `instance` is unique per start, and the tier
    is its input stream's name, so that tiers of several streams share one bucket apart."""

    host: str
    pid: int
    instance: str
    since_ms: int

    @classmethod
    def this_process(cls) -> Member:
        return cls(
            host=ambient.host(),
            pid=ambient.pid(),
            instance=new_id(),
            since_ms=now_ms(),
        )


def member_key(tier: str, instance: str) -> str:
    """A member's key in `MEMBERS_BUCKET`."""
    return f"{tier}.{instance}"


_MEMBER_ENCODER = msgspec.json.Encoder()
_MEMBER_DECODER = msgspec.json.Decoder(Member)


class Membership:
    """This worker's key in `MEMBERS_BUCKET`, refreshed by `keep` until `leave`."""

    def __init__(self, bus: Bus, bucket: Bucket, tier: str, member: Member, ttl_s: float) -> None:
        self._bus = bus
        self._bucket = bucket
        self.member = member
        self._key = member_key(tier, member.instance)
        self._value = _MEMBER_ENCODER.encode(member)
        self.ttl_s = ttl_s

    async def keep(self) -> None:
        """Refresh the announcement every third of the TTL, until cancelled. A refresh that
        NATS does not answer is retried sooner; one that lands after the key expired simply
        announces the worker again (the key is this instance's alone)."""
        wait = self.ttl_s / 3
        while True:
            await asyncio.sleep(wait)
            try:
                await self._bucket.put(self._key, self._value)
                wait = self.ttl_s / 3
            except BusError as exc:
                logger.warning(
                    "membership %s: refresh failed, retrying: %s", self.member.instance, exc
                )
                wait = _KV_RETRY_S

    async def leave(self) -> None:
        """Withdraw the announcement, so the others need not wait for the TTL."""
        problem = "no connection"
        if self._bus.is_connected:
            try:
                await self._bucket.delete(self._key, _KV_DELETE_TIMEOUT_S)
                return
            except BusError as exc:
                problem = str(exc)
        logger.warning(
            "membership %s not withdrawn (%s); it expires in %.0fs",
            self.member.instance,
            problem,
            self.ttl_s,
        )


async def _members_bucket(bus: Bus, give_up_after_s: float = 0.0) -> Bucket:
    return await open_bucket(
        bus,
        MEMBERS_BUCKET,
        description="kvhandoff: the live workers of the tier",
        history=1,
        ttl_s=MEMBER_TTL_S,
        # Reads from the stream's leader only: a replica's direct get may answer from before
        # the latest refresh, or after its own clock expired the key, and a live worker would
        # drop out of a listing now and then.
        direct=False,
        give_up_after_s=give_up_after_s,
    )


async def announce(bus: Bus, member: Member, tier: str) -> Membership:
    """Announce `member` of `tier` in `MEMBERS_BUCKET` (created if absent); keep it with
    `keep`. Asked again for `_ANNOUNCE_GIVE_UP_S` while no stream answers: a bucket that
    another worker just made in a cluster answers on every node only once its interest
    spread."""
    clock = asyncio.get_running_loop().time
    give_up = clock() + _ANNOUNCE_GIVE_UP_S
    what = f"cannot announce {member.instance} in {MEMBERS_BUCKET}"
    try:
        bucket = await _members_bucket(bus, _ANNOUNCE_GIVE_UP_S)
        ttl_s = await bucket.ttl_s()
    except BusError as exc:
        raise BusError(f"{what}: {exc}") from exc
    if ttl_s is None:
        raise BusError(
            f"member bucket {MEMBERS_BUCKET} has no TTL, so a dead worker would "
            "count as live for ever; delete the bucket and let the worker create it"
        )
    key, value = member_key(tier, member.instance), _MEMBER_ENCODER.encode(member)
    try:
        await bucket.put(key, value, give_up_after_s=max(0.0, give_up - clock()))
    except BusError as exc:
        raise BusError(f"{what}: {exc}") from exc
    return Membership(bus, bucket, tier, member, ttl_s)


async def members(bus: Bus, tier: str) -> list[Member]:
    """The workers of `tier` announced and not expired, oldest first; values that are not
    a `Member` (written by something else) are skipped with a warning."""
    found: list[Member] = []
    try:
        bucket = await _members_bucket(bus)
        for key in await bucket.keys(member_key(tier, "*")):
            value = await bucket.get(key)
            if value is None:
                continue  # it expired or left between the two requests
            try:
                found.append(_MEMBER_DECODER.decode(value))
            except msgspec.DecodeError as exc:
                logger.warning("ignored key %s of %s: %s", key, MEMBERS_BUCKET, exc)
    except BusError as exc:
        raise BusError(f"cannot list the members in {MEMBERS_BUCKET}: {exc}") from exc
    return sorted(found, key=lambda m: (m.since_ms, m.instance))
