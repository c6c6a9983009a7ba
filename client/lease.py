"""The engine's half of a lease (`events.leases`): hold it, renew it, and fence the engine when
it cannot.

Theory of operation
-------------------
`Lease.acquire` stores a fresh `EngineLease` (a new incarnation) under the engine id with a TTL
of `ttl_s`, and `run` stores it again every `ttl_s / RENEWALS_PER_TTL`. The lease is *valid*
until `ttl_s` after the moment the last renewal that the stream stored was *sent*: the server
starts the TTL when it stores the message, which is later, so the engine's idea of its lease
ends before the tier's. `FENCE_MARGIN` of the TTL is kept back besides, for the clock rates of
two machines and the time a message already sent takes to arrive.

Once the lease is no longer valid (the renewals failed: NATS cut off; or the process was paused
and woke past it), the engine must assume that the tier has answered for it: `check` (called
before the engine handles or publishes anything) and the renewal task both call `on_fence` once.
The next renewal that succeeds takes a new incarnation, so that the tier tells what the engine
held before the fence from what it takes after. Every attempt at a fresh lease carries the same
new incarnation until one is stored: an attempt given up on may still be stored later (nats-py
sends what it buffered while disconnected once it reconnects), and a next attempt under another
incarnation would then replace it, which the tier reads as the engine gone once more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from kvhandoff.client.connection import Connection
from kvhandoff.client.errors import BusUnavailable, Refused
from kvhandoff.events.leases import EngineLease
from kvhandoff.worker.ambient import monotonic_s, new_id

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 5.0
RENEWALS_PER_TTL = 4  # vLLM renews a sixth of its TTL, SGLang misses two beats of five seconds
FENCE_MARGIN = 0.2  # of the TTL: the engine's lease ends this much before the tier's
ACQUIRE_GIVE_UP_S = 30.0
_ACQUIRE_RETRY_S = 0.5  # between attempts at the first lease, while NATS cannot answer
_ENCODER = msgspec.json.Encoder()


class Lease:
    """One engine id's lease on one connection; `acquire`, then `run` until cancelled."""

    def __init__(
        self, connection: Connection, engine_id: str, ttl_s: float, on_fence: Callable[[], None]
    ) -> None:
        if ttl_s < 1.0:
            raise ValueError(f"lease_ttl_s must be at least 1 s (NATS's TTL), got {ttl_s}")
        self.engine_id = engine_id
        self.ttl_s = ttl_s
        self.incarnation: str | None = None
        self._connection = connection
        self._on_fence = on_fence
        self._valid_until = 0.0  # by monotonic_s
        self._fresh: str | None = None  # the incarnation the next fresh lease takes
        self.fences = 0

    def valid(self) -> bool:
        """Whether the engine may still act for what it holds."""
        return self.incarnation is not None and monotonic_s() < self._valid_until

    def check(self) -> bool:
        """Fence now if the lease lapsed unnoticed (a paused process that just woke); whether
        it is valid."""
        if self.incarnation is not None and not self.valid():
            self._fence()
        return self.valid()

    async def acquire(self) -> None:
        """Take a lease with a fresh incarnation; `BusUnavailable` if NATS does not store it
        within `ACQUIRE_GIVE_UP_S` (the first one may create the bucket, and wait for a
        cluster to elect its leader: each attempt that times out meanwhile is made again)."""
        give_up_at = monotonic_s() + ACQUIRE_GIVE_UP_S
        while True:
            left_s = give_up_at - monotonic_s()
            try:
                await self._renew(
                    self._fresh_incarnation(), give_up_s=max(left_s, _ACQUIRE_RETRY_S)
                )
                return
            except Refused:
                raise  # no later attempt would be let in
            except BusUnavailable:
                if monotonic_s() + _ACQUIRE_RETRY_S >= give_up_at:
                    raise
            await asyncio.sleep(_ACQUIRE_RETRY_S)

    async def run(self) -> None:
        """Renew until cancelled; fence once a renewal comes too late."""
        period_s = self.ttl_s / RENEWALS_PER_TTL
        while True:
            await asyncio.sleep(period_s)
            self.check()
            fresh = self.incarnation is None
            incarnation = self.incarnation or self._fresh_incarnation()
            try:
                await self._renew(incarnation)
            except BusUnavailable as exc:
                logger.warning("%s: lease not renewed: %s", self.engine_id, exc)
                self.check()
                continue
            if fresh and self.incarnation == incarnation:
                logger.info("%s: lease taken again, incarnation %s", self.engine_id, incarnation)

    async def _renew(self, incarnation: str, *, give_up_s: float | None = None) -> None:
        sent = monotonic_s()
        value = _ENCODER.encode(EngineLease(self.engine_id, incarnation, round(self.ttl_s * 1000)))
        if give_up_s is None:
            # No longer than the lease has left: a renewal stored later would extend a lease
            # that the tier may already have seen expire.
            give_up_s = max(self._valid_until - sent, self.ttl_s / RENEWALS_PER_TTL)
        await self._connection.put_lease(
            self.engine_id, value, self.ttl_s, give_up_after_s=give_up_s
        )
        if self.incarnation is not None and incarnation == self.incarnation and not self.valid():
            # Stored, but after the lease lapsed: the tier may have answered for this
            # incarnation already, so it must not go on.
            self._fence()
            return
        self.incarnation = incarnation
        self._fresh = None
        self._valid_until = sent + self.ttl_s * (1.0 - FENCE_MARGIN)

    def _fresh_incarnation(self) -> str:
        if self._fresh is None:
            self._fresh = new_id()
        return self._fresh

    def _fence(self) -> None:
        logger.error(
            "%s: lease (incarnation %s) not renewed in time: fencing the engine",
            self.engine_id,
            self.incarnation,
        )
        self.incarnation = None
        self.fences += 1
        self._on_fence()
