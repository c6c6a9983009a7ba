"""A partition's coordinator made of plain functions (`worker.tier.owner.Steps`), for the tests
that drive owners and tiers without the real one (worker.tier.partition)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvhandoff.worker.bus.pull import Inbound
from kvhandoff.worker.tier.owner import Decided
from kvhandoff.worker.tier.ownership import CaughtUp


@dataclass
class StandIn:
    """`decide` and `act` as given; `claimed` calls `on_claim`, if given; it takes no
    snapshots (its owners are given no `SnapshotPolicy`), and a release changes nothing."""

    decide_with: Callable[[Sequence[Inbound]], Awaitable[Decided]]
    act_with: Callable[[Sequence[Inbound]], Awaitable[None]]
    on_claim: Callable[[CaughtUp], Awaitable[None]] | None = None

    async def claimed(self, caught: CaughtUp) -> None:
        if self.on_claim is not None:
            await self.on_claim(caught)

    async def decide(self, batch: Sequence[Inbound]) -> Decided:
        return await self.decide_with(batch)

    async def act(self, batch: Sequence[Inbound]) -> None:
        await self.act_with(batch)

    async def snapshot(self) -> bytes:
        raise AssertionError("a stand-in's owner is given no snapshot policy")

    def released(self) -> None:
        """Nothing of a stand-in acts between batches."""
