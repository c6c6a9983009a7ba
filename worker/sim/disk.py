"""A simulated worker's disk, which the full-disk and slow-disk faults break (worker.sim.faults).

Why. A worker's partition files are real SQLite files in the run's directory, and the tier's
answer to a full disk (a failed commit halts its group, the partition is given up and claimed
again from the replicated log) or a slow one (appends queue behind a commit) runs only when the
disk misbehaves. These faults make it misbehave through SQLite's and the loop's own paths, so
the store's error handling is the one that runs on a real full disk (tests/worker/test_disk_full
mounts a small tmpfs for the same).

Theory of operation.

- *Full.* Every SQLite connection a simulated process opens is handed to its disk as it opens:
  an audit hook (`sqlite3.connect/handle`, raised inside `sqlite3.connect`) sees it, in the
  context of the process that opened it (`ambient.current()`). While the disk is full, each of
  its open connections is capped at the pages its file has (`PRAGMA max_page_count`), so SQLite
  refuses a write that needs another page with SQLITE_FULL, "database or disk is full", as on a
  disk with no room left, while one that rewrites pages it has still succeeds. A connection
  cannot be used inside `sqlite3.connect`, so one opened meanwhile is capped at the process's
  next executor call (`catch_up`, which the loop makes before each): the store's own threads
  are where it writes, and the call that opens a new file may still write its layout.
  Healing lifts every cap. The cap is a setting of the connection, not of the file: nothing of
  it is stored, and a file opened elsewhere (the checks, `verify`) is not capped.
- *Slow.* While the disk is slow, the loop runs each of the process's executor calls (the
  store's threads: `worker.sim.loop.SimLoop.run_in_executor`) not inline but `latency_s` after
  the previous one ended, one at a time, as a disk that serves one request at a time would.

Invariants: only processes whose disk is broken see anything of it; the audit hook, which
cannot be removed once added, is added once per interpreter and does nothing for a connection
opened outside a simulated process; a connection found closed is forgotten (a connection takes
no weak reference, so the disk holds each until then).
"""

from __future__ import annotations

import functools
import sqlite3
import sys
from typing import Any

from kvhandoff.worker import ambient

_UNCAPPED = 0  # `max_page_count` as SQLite had it: kept per connection below


class SimDisk:
    """One worker's disk, across its incarnations: healthy, full or slow."""

    def __init__(self) -> None:
        _install_hook()
        self.full = False
        self.latency_s = 0.0
        self._busy_until = 0.0
        # By id: each connection opened, and its max_page_count before a cap (0: not capped).
        self._connections: dict[int, tuple[sqlite3.Connection, int]] = {}

    def opened(self, connection: sqlite3.Connection) -> None:
        self._connections[id(connection)] = (connection, _UNCAPPED)

    def catch_up(self) -> None:
        """Cap the connections opened since the disk filled, if it is full."""
        if self.full:
            self.fill()

    def fill(self) -> None:
        """No room left: writes that need a page fail from now on."""
        self.full = True
        for connection, uncapped in list(self._connections.values()):
            if uncapped == _UNCAPPED:
                self._cap(connection)

    def slow_down(self, latency_s: float) -> None:
        """Each executor call waits for the one before, and then `latency_s`."""
        self.latency_s = latency_s

    def heal(self) -> None:
        """Room again, and calls inline again."""
        self.latency_s = 0.0
        self.empty()

    def empty(self) -> None:
        """Room again: every cap lifted."""
        self.full = False
        for key, (connection, uncapped) in list(self._connections.items()):
            if uncapped != _UNCAPPED:
                self._connections[key] = (connection, _UNCAPPED)
                if _pragma(connection, f"max_page_count = {uncapped}") is None:
                    del self._connections[key]

    def next_slot(self, now: float) -> float:
        """When a call made now runs on a slow disk: after the one before it, one latency
        later."""
        self._busy_until = max(now, self._busy_until) + self.latency_s
        return self._busy_until

    def _cap(self, connection: sqlite3.Connection) -> None:
        uncapped = _pragma(connection, "max_page_count")
        pages = _pragma(connection, "page_count")
        if uncapped is None or pages is None:
            del self._connections[id(connection)]  # closed: nothing more goes through it
            return
        # 0 would read the setting rather than set it; a new file's layout needs more than one.
        _pragma(connection, f"max_page_count = {max(1, pages)}")
        self._connections[id(connection)] = (connection, uncapped)


def _pragma(connection: sqlite3.Connection, pragma: str) -> int | None:
    """The pragma's value, or None if the connection was closed."""
    try:
        row = connection.execute(f"PRAGMA {pragma}").fetchone()
    except sqlite3.ProgrammingError:
        return None
    return None if row is None else int(row[0])


def _on_audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "sqlite3.connect/handle":
        return
    disk = getattr(ambient.current(), "disk", None)
    if isinstance(disk, SimDisk):
        disk.opened(args[0])


@functools.cache  # once per interpreter
def _install_hook() -> None:
    sys.addaudithook(_on_audit)
