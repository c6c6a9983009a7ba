"""A source and a destination engine written with the client alone, healthy (they answer with
`worker.engines.healthy`'s success path), with what a test needs to steer and watch them: every
handler call is counted, and a gate can hold an action kind until the test opens it. Each may
have a connection of its own and a lease of a given time to live, for the lease tests that cut
one engine off."""

from __future__ import annotations

import asyncio
from collections import Counter

from kvhandoff.client import Connection, Engine, Handlers
from kvhandoff.client.lease import DEFAULT_LEASE_TTL_S
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    SCHEDULED,
    SUBMITTED,
    ActivateDestination,
    CancelDestination,
    CancelSource,
    Outcome,
    ReleaseSource,
    ReserveDestination,
    StartTransfer,
    SubmitPrefill,
)
from kvhandoff.worker.engines.healthy import TIMING

SOURCE = "test-prefill-0"
DESTINATION = "test-decode-0"


class Pair:
    """The two engines, on one connection unless the destination is given its own; `calls`
    counts handler runs by action tag, `fenced` collects the handoffs the source dropped when
    its lease lapsed, and `submitted` is set by the first prefill."""

    def __init__(
        self,
        connection: Connection,
        *,
        destination_connection: Connection | None = None,
        lease_ttl_s: float | None = DEFAULT_LEASE_TTL_S,
        hold_source_held: bool = False,
    ) -> None:
        self.calls: Counter[str] = Counter()
        self.fenced: list[HandoffId] = []
        self.submitted = asyncio.Event()
        # While set, a submitted prefill never reports SourceHeld: the handoff stays open.
        self.hold_source_held = hold_source_held
        self.activations = asyncio.Event()  # opened by default
        self.activations.set()
        self.source = Engine(
            connection,
            SOURCE,
            Handlers(
                submit_prefill=self.submit_prefill,
                start_transfer=self.start_transfer,
                release_source=self.cleanup,
                cancel_source=self.cleanup,
                fenced=self.fenced.extend,
            ),
            lease_ttl_s=lease_ttl_s,
        )
        self.destination = Engine(
            destination_connection or connection,
            DESTINATION,
            Handlers(
                reserve_destination=self.reserve_destination,
                activate_destination=self.activate_destination,
                cancel_destination=self.cleanup,
            ),
            lease_ttl_s=lease_ttl_s,
        )

    async def start(self) -> None:
        await self.source.start()
        await self.destination.start()

    async def stop(self) -> None:
        await self.source.stop()
        await self.destination.stop()

    async def submit_prefill(self, action: SubmitPrefill) -> Outcome:
        self.calls[str(type(action).__struct_config__.tag)] += 1
        self.submitted.set()
        if not self.hold_source_held:
            self.source.spawn(self.source.source_held(action.handoff_id, TIMING))
        return SUBMITTED

    async def start_transfer(self, action: StartTransfer) -> Outcome:
        self.calls[str(type(action).__struct_config__.tag)] += 1
        self.source.spawn(self.source.transfer_completed(action.handoff_id))
        return SCHEDULED

    async def reserve_destination(self, action: ReserveDestination) -> Outcome:
        self.calls[str(type(action).__struct_config__.tag)] += 1
        self.destination.spawn(self.destination.destination_reserved(action.handoff_id, 128))
        return ACCEPTED

    async def activate_destination(self, action: ActivateDestination) -> Outcome:
        self.calls[str(type(action).__struct_config__.tag)] += 1
        await self.activations.wait()
        return APPLIED

    async def cleanup(self, action: ReleaseSource | CancelSource | CancelDestination) -> Outcome:
        self.calls[str(type(action).__struct_config__.tag)] += 1
        return APPLIED
