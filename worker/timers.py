"""Keyed deadlines: the worker's handoff deadlines and action retries.

A plain heap with lazy deletion: scheduling a key again replaces its deadline, cancelling
forgets it, and stale heap entries are skipped when they surface. No clock and no asyncio
here; the service asks what is due at the time it reads.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class TimerQueue(Generic[K]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._due: dict[K, float] = {}
        self._tiebreak = itertools.count()  # keys need not be orderable

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, key: K) -> bool:
        return key in self._due

    def schedule(self, key: K, due: float) -> None:
        self._due[key] = due
        heapq.heappush(self._heap, (due, next(self._tiebreak), key))

    def cancel(self, key: K) -> None:
        self._due.pop(key, None)
        # Cancelled entries stay in the heap until they surface; rebuild it when they
        # outnumber the live ones, so memory follows what is scheduled, not what was.
        if len(self._heap) > 2 * len(self._due) + 1024:
            self._heap = [(due, next(self._tiebreak), k) for k, due in self._due.items()]
            heapq.heapify(self._heap)

    def next_due(self) -> float | None:
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[K]:
        """Every key due at or before `now`, earliest first; they are no longer scheduled."""
        fired: list[K] = []
        while True:
            self._drop_stale()
            if not self._heap or self._heap[0][0] > now:
                return fired
            _, _, key = heapq.heappop(self._heap)
            del self._due[key]
            fired.append(key)

    def _drop_stale(self) -> None:
        heap, due = self._heap, self._due
        while heap and due.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
