"""Contracts of key-value buckets: the members' bucket (a bucket TTL) and the engines' lease
bucket (a TTL per message, expiries a watch sees), through worker.bus.kv.

    contract                                        tier code that relies on it
    a bucket opens once and again; puts, gets,      tier.members (announce, members, leave)
      deletes; lists its keys by pattern, a
      deleted one too (its marker), without value
    a key expires the bucket's TTL after its last   tier.members (a dead worker drops out;
      put, not before; a put again keeps it           `keep` refreshes)
    an expiring bucket opens once and again; a      client.connection (acquire, renew),
      watch reads every key's last value, then        tier.leases (the watch)
      each put in order, then a delete marker
      (None) once a put's own TTL ran out, not
      before; a put again restarts the TTL            client.lease's renewals
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.kv import (
    Bucket,
    open_bucket,
    open_expiring_bucket,
    put_expiring,
    watch_bucket,
)
from tests.eventually import until
from tests.sim.contract.backend import Backend, contract, now
from tests.sim.contract.observe import WITHIN_S


async def _members(bus: Bus, name: str, ttl_s: float) -> Bucket:
    """The bucket as tier.members opens it."""
    return await open_bucket(bus, name, description="members", history=1, ttl_s=ttl_s, direct=False)


@contract
async def test_a_bucket_puts_gets_deletes_and_lists_its_live_keys(backend: Backend) -> None:
    name = backend.fresh("MEMBERS")
    bucket = await _members(await backend.connect("member"), name, 60.0)
    again = await _members(await backend.connect("other"), name, 60.0)  # opened, not made
    assert await again.ttl_s() == 60.0
    assert await bucket.get("tier.a") is None
    assert await bucket.keys("tier.*") == []
    await bucket.put("tier.a", b"worker a")
    await again.put("tier.b", b"worker b")
    await bucket.put("other.c", b"another tier's")
    await bucket.put("tier.a", b"worker a, refreshed")
    assert await again.get("tier.a") == b"worker a, refreshed"
    assert sorted(await again.keys("tier.*")) == ["tier.a", "tier.b"]
    assert sorted(await again.keys(">")) == ["other.c", "tier.a", "tier.b"]
    await again.delete("tier.a", WITHIN_S)
    assert await bucket.get("tier.a") is None
    # A delete is a message too (a `KV-Operation: DEL` marker): its key is still listed,
    # without a value, which is why tier.members.members gets each key it lists.
    assert sorted(await bucket.keys("tier.*")) == ["tier.a", "tier.b"]
    assert await bucket.get("tier.b") == b"worker b"


@contract
async def test_a_key_expires_the_bucket_ttl_after_its_last_put(backend: Backend) -> None:
    ttl_s = 1.0
    bucket = await _members(await backend.connect("member"), backend.fresh("MEMBERS"), ttl_s)
    assert await bucket.ttl_s() == ttl_s
    put_at = now()
    await bucket.put("tier.dead", b"a worker that stops")
    await bucket.put("tier.live", b"a worker that keeps its key")
    await backend.advance(ttl_s * 0.6)
    await bucket.put("tier.live", b"a worker that keeps its key")

    async def dead_gone() -> bool:
        return await bucket.get("tier.dead") is None

    await until(dead_gone, "the dead worker's key expired", within=WITHIN_S, every=0.02)
    assert now() - put_at >= ttl_s
    assert await bucket.keys("tier.*") == ["tier.live"]
    assert await bucket.get("tier.live") == b"a worker that keeps its key"


@contract
async def test_a_watch_reads_the_last_values_then_each_put_then_each_expiry(
    backend: Backend,
) -> None:
    bus, engine = await backend.connect("worker"), await backend.connect("engine")
    bucket = backend.fresh("LEASES")
    await open_expiring_bucket(engine, bucket, marker_ttl_s=60.0)
    await open_expiring_bucket(bus, bucket, marker_ttl_s=60.0)  # opened again: kept
    await put_expiring(engine, bucket, "e1", b"first", 60.0, give_up_after_s=5.0)
    await put_expiring(engine, bucket, "e1", b"renewed", 60.0, give_up_after_s=5.0)
    await put_expiring(engine, bucket, "e2", b"other", 60.0, give_up_after_s=5.0)

    seen: list[tuple[str, bytes | None]] = []
    watch = await watch_bucket(bus, bucket, lambda key, value: seen.append((key, value)))
    # Returned once it read each key's last message.
    assert seen == [("e1", b"renewed"), ("e2", b"other")]

    ttl_s = 1.0
    put_at = now()
    await put_expiring(engine, bucket, "e3", b"short", ttl_s, give_up_after_s=5.0)
    await until(lambda: ("e3", None) in seen, "e3's expiry was watched", within=WITHIN_S)
    assert now() - put_at >= ttl_s
    assert seen[2:] == [("e3", b"short"), ("e3", None)]
    await watch.unsubscribe()


@contract
async def test_a_put_again_restarts_a_keys_own_ttl(backend: Backend) -> None:
    bus, engine = await backend.connect("worker"), await backend.connect("engine")
    bucket = backend.fresh("LEASES")
    await open_expiring_bucket(engine, bucket, marker_ttl_s=60.0)
    seen: list[tuple[str, bytes | None]] = []
    await watch_bucket(bus, bucket, lambda key, value: seen.append((key, value)))

    ttl_s = 1.0
    await put_expiring(engine, bucket, "e", b"lease", ttl_s, give_up_after_s=5.0)
    await backend.advance(ttl_s * 0.6)
    renewed_at = now()
    await put_expiring(engine, bucket, "e", b"renewed", ttl_s, give_up_after_s=5.0)
    await until(lambda: ("e", None) in seen, "the renewed lease expired", within=WITHIN_S)
    assert now() - renewed_at >= ttl_s
    assert seen == [("e", b"lease"), ("e", b"renewed"), ("e", None)]


@contract
async def test_a_watch_resumes_at_once_after_a_reconnect_from_its_last_message(
    backend: Backend,
) -> None:
    await watch_across_a_restart(backend)


async def watch_across_a_restart(
    backend: Backend, before_restart: Callable[[], None] = lambda: None
) -> float:
    """A watch across a restart of the server (`before_restart` runs just before it): the put
    after it is watched well before nats-py would notice on its own. Returns when that put was
    stored."""
    bus, engine = await backend.connect("worker"), await backend.connect("engine")
    bucket = backend.fresh("LEASES")
    await open_expiring_bucket(engine, bucket, marker_ttl_s=60.0)
    await put_expiring(engine, bucket, "e1", b"before", 60.0, give_up_after_s=5.0)
    seen: list[tuple[str, bytes | None]] = []
    watch = await watch_bucket(bus, bucket, lambda key, value: seen.append((key, value)))
    reconnected = asyncio.Event()
    bus.on_reconnect(reconnected.set)

    before_restart()
    await backend.restart_server()
    await until(reconnected.is_set, "the watcher reconnected", within=WITHIN_S)
    await put_expiring(engine, bucket, "e2", b"after", 60.0, give_up_after_s=WITHIN_S)
    stored_at = now()
    # Sooner than nats-py's ordered consumer notices on its own a consumer gone or messages
    # lost (two idle heartbeats, 10 s): the watch started it again on the reconnect.
    await until(lambda: ("e2", b"after") in seen, "the put after the restart", within=WITHIN_S)
    assert now() - stored_at < 5.0  # half of the 10 s: a busy machine is slow, not that slow
    assert seen == [("e1", b"before"), ("e2", b"after")]
    await watch.unsubscribe()
    return stored_at
