"""One engine's KV blocks and in-flight slots.

Capacity: an engine has `kv_blocks` KV blocks and `max_slots` in-flight slots. A handoff holds
ceil(prompt / block_size) blocks and one slot from the grant of its request until a release, a
cancel, an injected failure or (destination) the end of its decode. Requests are granted
strictly first come, first served.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from kvhandoff.events.ids import HandoffId


class KvCapacity:
    """One engine's KV blocks and in-flight slots, granted strictly first come, first served."""

    def __init__(self, blocks: int, slots: int) -> None:
        self.total_blocks = blocks
        self.total_slots = slots
        self.used_blocks = 0
        self._held: dict[HandoffId, int] = {}
        self._waiting: OrderedDict[HandoffId, tuple[int, asyncio.Future[None]]] = OrderedDict()

    @property
    def used_slots(self) -> int:
        return len(self._held)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def fits(self, blocks: int) -> bool:
        """Whether a request of `blocks` could ever be granted."""
        return blocks <= self.total_blocks

    def held(self, handoff_id: HandoffId) -> int:
        return self._held.get(handoff_id, 0)

    def is_waiting(self, handoff_id: HandoffId) -> bool:
        return handoff_id in self._waiting

    def request(self, handoff_id: HandoffId, blocks: int) -> asyncio.Future[None]:
        """Queue a request for `blocks` blocks and a slot; the future resolves on the grant."""
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[handoff_id] = (blocks, granted)
        self._grant()
        return granted

    def release(self, handoff_id: HandoffId) -> bool:
        """Free what the handoff holds, or withdraw its request. True if there was either."""
        waiting = self._waiting.pop(handoff_id, None)
        if waiting is not None:
            waiting[1].cancel()
        blocks = self._held.pop(handoff_id, None)
        if blocks is not None:
            self.used_blocks -= blocks
            self._grant()
        return waiting is not None or blocks is not None

    def _grant(self) -> None:
        while self._waiting:
            handoff_id, (blocks, granted) = next(iter(self._waiting.items()))
            if granted.cancelled():  # its waiter was cancelled when the engine stopped
                del self._waiting[handoff_id]
                continue
            if self.used_slots >= self.total_slots or self.used_blocks + blocks > self.total_blocks:
                return
            del self._waiting[handoff_id]
            self._held[handoff_id] = blocks
            self.used_blocks += blocks
            granted.set_result(None)
