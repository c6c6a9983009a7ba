"""Owning one partition: pull its inputs while pinned, apply each once, append before acting.

Theory of operation. A `PartitionOwner` pulls the partition's consumer in the priority group
`worker.bus.PRIORITY_GROUP`. The server delivers to one pinned client at a time (see "Pins" in
worker.bus); a pull refused with 423 means another worker holds the pin, and this one keeps
asking, which is how it takes the partition over once the holder stops pulling for the
consumer's `priority_timeout`. The first batch under a pin id it has not claimed under makes it
claim the partition's log (`worker.ownership.PartitionLog.claim`): catch up, append `Claimed`.
Then, batch by batch:

    1. drop the inputs that some owner already applied (their stream sequences are in the log:
       redeliveries of inputs a dead owner appended but did not acknowledge);
    2. `decide` the rest: the records the batch adds to the partition's log;
    3. append them, compare-and-set (`PartitionLog.append`);
    4. only then `act` (publish what the records say) and acknowledge the whole batch.

The fence. If step 3 is refused (`Fenced`), another worker claimed the partition since: this
one stops at once. It neither acts nor acknowledges anything more, closes its pull, and `run`
returns with `fenced` set (a metric and a warning line say so). The inputs it held come back to
the new owner after the consumer's ack wait; those it had appended are dropped there by step 1.
Order. The consumer's ack wait must be shorter than its priority timeout (less the pull's
expiry): then a new owner is pinned only after the old owner's unacknowledged inputs are due
again, and the server hands those out before newer ones (tests/cluster/test_pins.py). But not
in stream order among themselves: when the old owner held many, JetStream redelivers them in
the order their ack waits ran out, and an owner that stays pinned while it stalls is sent its own
redeliveries again, so a handoff's inputs can come to the new owner out of order (measured in
tests/cluster/test_failover.py: some 20 of 90 to 150 inputs). So applying in delivery order is
not enough: the check the issue asks for, that no earlier input of the same handoff is still
pending redelivery, is needed before applying, and is not done here.

What it does not do yet: that check; hand a partition over cleanly (drain, ack, unpin) when the
balance rule (worker.partitions) says so; catch a local SQLite log up from the claimed records;
remember applied inputs in less than a set of every stream sequence since the claim.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from worker.bus import PRIORITY_GROUP, Bus, Inbound, Pull
from worker.errors import Fenced, PinMismatch
from worker.ownership import PartitionLog

logger = logging.getLogger(__name__)

Decide = Callable[[Sequence[Inbound]], bytes]
Act = Callable[[Sequence[Inbound]], Awaitable[None]]

_FETCH_TIMEOUT_S = 0.25  # how long an idle owner waits before noticing a stop request


class PartitionOwner:
    """One worker's hold on one partition (see the module docstring); `run` it."""

    def __init__(
        self,
        bus: Bus,
        stream: str,
        consumer: str,
        log: PartitionLog,
        *,
        batch: int = 64,
        expires_s: float = 2.0,
        heartbeat_s: float = 0.5,
    ) -> None:
        self._bus = bus
        self._stream = stream
        self._consumer = consumer
        self.log = log
        self._batch = batch
        self._expires_s = expires_s
        self._heartbeat_s = heartbeat_s
        self._applied: set[int] = set()
        # What it did, for metrics and tests.
        self.claims = 0
        self.applied = 0  # inputs appended and acted on
        self.skipped = 0  # inputs an owner had applied already (redeliveries)
        self.acked = 0
        self.refused_pulls = 0  # 423: another worker held the pin
        self.fenced = False

    async def run(self, decide: Decide, act: Act, stop: asyncio.Event) -> None:
        """Own the partition until `stop` is set or another worker fences this one."""
        pull = Pull(
            self._bus, self._stream, self._consumer,
            max_ahead=2 * self._batch, expires_s=self._expires_s,
            heartbeat_s=self._heartbeat_s, group=PRIORITY_GROUP,
        )  # fmt: skip
        claimed_under: str | None = None
        async with pull:
            while not stop.is_set():
                try:
                    batch = await pull.fetch(self._batch, timeout_s=_FETCH_TIMEOUT_S)
                except PinMismatch:
                    self.refused_pulls += 1
                    continue  # the Pull asks to be pinned anew
                if not batch:
                    continue
                if pull.pin_id != claimed_under:
                    if claimed_under is not None:
                        # Pinned anew: someone may have owned it between our two pins.
                        self.log = self.log.anew()
                    try:
                        caught = await self.log.claim()
                    except Fenced:
                        self._fenced("its claim")
                        return
                    self.claims += 1
                    self._applied = caught.applied
                    claimed_under = pull.pin_id
                if not await self._handle(batch, decide, act):
                    return

    async def _handle(self, batch: list[Inbound], decide: Decide, act: Act) -> bool:
        """Steps 1-4 for one batch; False once fenced."""
        fresh = [inbound for inbound in batch if inbound.stream_seq not in self._applied]
        self.skipped += len(batch) - len(fresh)
        if fresh:
            inputs = [inbound.stream_seq for inbound in fresh]
            try:
                await self.log.append(inputs, decide(fresh))
            except Fenced:
                self._fenced(f"an append of {len(fresh)} inputs")
                return False
            self._applied.update(inputs)
            self.applied += len(fresh)
            await act(fresh)
        for inbound in batch:
            await inbound.ack()
        self.acked += len(batch)
        return True

    def _fenced(self, what: str) -> None:
        self.fenced = True
        logger.warning(
            "partition %d: %s was refused, another worker owns it now; %s stops acting for it "
            "(applied %d inputs, acknowledged %d)",
            self.log.partition, what, self.log.owner, self.applied, self.acked,
        )  # fmt: skip
