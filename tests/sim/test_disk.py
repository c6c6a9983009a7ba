"""worker.sim.disk: a simulated worker's disk, full or slow. Full, SQLite refuses each write that
needs room with its own error, on the connections of that disk's processes only, and takes
them again once the disk is emptied; slow, the loop runs that process's executor calls one
after another, each a latency after the one before, and everyone else's inline."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
from pathlib import Path

import pytest

from kvhandoff.worker import ambient
from kvhandoff.worker.errors import StoreError
from kvhandoff.worker.log.store import EventLog
from kvhandoff.worker.sim import world
from kvhandoff.worker.sim.disk import SimDisk
from kvhandoff.worker.sim.loop import run
from kvhandoff.worker.sim.process import SimProcess

FULL = "database or disk is full"


def _process(disk: SimDisk, name: str = "worker-0") -> SimProcess:
    return SimProcess(name, random.Random(1), disk=disk)


def _connect(path: Path, process: SimProcess | None = None) -> sqlite3.Connection:
    """A connection opened as `process` would (or outside any process)."""
    with ambient.using(process) if process is not None else contextlib.nullcontext():
        return sqlite3.connect(path, isolation_level=None)


def _grow(connection: sqlite3.Connection) -> None:
    """A write that needs pages the file does not have."""
    connection.execute("INSERT INTO t VALUES (?)", (b"x" * 8192,))


def test_a_full_disk_refuses_a_write_that_needs_room_until_it_is_emptied(tmp_path: Path) -> None:
    disk = SimDisk()
    connection = _connect(tmp_path / "a.db", _process(disk))
    connection.execute("CREATE TABLE t (x BLOB)")
    disk.fill()
    with pytest.raises(sqlite3.OperationalError, match=FULL):
        _grow(connection)
    disk.empty()
    _grow(connection)
    assert connection.execute("SELECT count(*) FROM t").fetchone() == (1,)


def test_a_connection_opened_on_a_full_disk_is_full_from_its_next_call(tmp_path: Path) -> None:
    disk = SimDisk()
    disk.fill()
    connection = _connect(tmp_path / "b.db", _process(disk))
    connection.execute("CREATE TABLE t (x BLOB)")  # in the call that opened it, as a layout
    disk.catch_up()  # what the loop does before each of the process's executor calls
    with pytest.raises(sqlite3.OperationalError, match=FULL):
        _grow(connection)


def test_only_the_processes_of_the_full_disk_see_it(tmp_path: Path) -> None:
    full = SimDisk()
    full.fill()
    other = _connect(tmp_path / "c.db", _process(SimDisk(), "worker-1"))
    outside = _connect(tmp_path / "d.db")  # the checks, `verify`: no simulated process
    for connection in (other, outside):
        connection.execute("CREATE TABLE t (x BLOB)")
        _grow(connection)


def test_a_connection_closed_before_the_disk_fills_is_forgotten(tmp_path: Path) -> None:
    disk = SimDisk()
    _connect(tmp_path / "e.db", _process(disk)).close()
    disk.fill()
    disk.empty()  # neither touches the closed connection
    live = _connect(tmp_path / "e.db", _process(disk))
    live.execute("CREATE TABLE t (x BLOB)")


def test_a_slow_disk_runs_its_process_calls_one_after_another() -> None:
    disk = SimDisk()
    disk.slow_down(0.25)

    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        ran: list[tuple[str, float]] = []

        def work(name: str) -> str:
            ran.append((name, loop.time()))
            return name

        with ambient.using(_process(disk)):
            slow = [loop.run_in_executor(None, work, name) for name in ("a", "b")]
        inline = loop.run_in_executor(None, work, "machine")
        assert await asyncio.gather(*slow, inline) == ["a", "b", "machine"]
        disk.slow_down(0.0)
        with ambient.using(_process(disk)):
            await loop.run_in_executor(None, work, "healed")
        return ran

    assert run(main, seed=1).result == [("machine", 0.0), ("a", 0.25), ("b", 0.5), ("healed", 0.5)]


def test_a_run_whose_disks_fill_breaks_no_invariant() -> None:
    """With only full disks forced on: some of the tier's commits fail, through the store's own
    path, and the tier converges all the same."""
    failed: list[str] = []
    commit_error = EventLog._commit_error

    def failing(log: EventLog, exc: sqlite3.Error) -> StoreError:
        failed.append(str(exc))
        return commit_error(log, exc)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EventLog, "_commit_error", failing)
        outcome = world.simulate(world.Scenario(1, fault_kinds=("full",)))
    assert outcome.violations == []
    assert FULL in failed


def test_a_run_whose_disks_slow_down_breaks_no_invariant() -> None:
    delayed: list[float] = []
    next_slot = SimDisk.next_slot

    def delaying(disk: SimDisk, now: float) -> float:
        delayed.append(now)
        return next_slot(disk, now)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SimDisk, "next_slot", delaying)
        outcome = world.simulate(world.Scenario(1, fault_kinds=("slow",)))
    assert outcome.violations == []
    assert delayed
