"""The ambient port (`worker.ambient`): the tier, the bus, the engines, the load generator and
the client read the clock, chance and new ids through it and nowhere else, and what it returns
follows the context it is read in.

Why the rule. The deterministic simulation (`worker.sim`) runs this code, many workers in one
process, on a virtual clock with one seed per run, giving each simulated process its own
`Ambient`. One read of the machine behind the port's back breaks that silently: `time.time()`
or `time.monotonic()` makes a simulated timer wait real seconds, or two runs of one seed
diverge; `uuid4()`, `random.*`, `secrets`, `os.urandom` draw from the machine's entropy, so
message ids, incarnations and jitter differ run to run; `datetime.now()` is the wall clock
again. So the scanned packages may not import `time`, `random` (but `from random import Random`,
called with a seed: a generator built from an explicit seed reads nothing of the machine),
`uuid` (but `from uuid import UUID`, the type), `secrets`, nor reach `os.urandom`,
`os.getrandom`, `datetime.now`/`utcnow`/`today`, nor ask which machine this is
(`socket.gethostname`, `os.getpid`: every simulated process is its own host). The rule is
read from the source with `ast`, so it holds for imports inside functions that no test runs.

Out of scope, on purpose: `worker.log` (the local file; the lock file's "since" stamp and the
commit's duration measure the machine, and stamp no record), the harness, the commands and
logging, which the simulation does not run.

Why the behaviour. `using` must hold for every task created in its block, also once the block
has ended (asyncio copies the context at `create_task`), and for nothing created outside it:
that is how two simulated workers in one loop each read their own clock and ids.
"""

from __future__ import annotations

import ast
import asyncio
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvhandoff.worker import ambient

ROOT = Path(__file__).resolve().parents[1]
# What the simulation runs: the tier and its transport, the mock engines and the load
# generator (the simulation's engines and frontends), and the client they are written with.
SCANNED = ("worker/tier", "worker/bus", "worker/engines", "worker/loadgen", "client")

_WHY = {
    "time": "read the clocks through worker.ambient (monotonic_s, wall_s, now_ms)",
    "random": "draw from worker.ambient.chance(), or a Random built from an explicit seed",
    "uuid": "make ids with worker.ambient.new_id/new_uuid (only the type UUID may be imported)",
    "secrets": "draw from worker.ambient.chance() or make ids with worker.ambient.new_id",
    "os": "os.urandom/getrandom are the machine's entropy: use worker.ambient",
    "datetime": "datetime.now/utcnow/today read the wall clock: use worker.ambient.now_ms",
    "host": "the host's name and the process id are the machine's: use worker.ambient.host/pid",
}
# The one name each module may import, and why it is harmless.
_HARMLESS = {"uuid": {"UUID"}, "random": {"Random"}}
_ENTROPY_OF_OS = {"urandom", "getrandom"}
# Which machine this is: in the simulation every process is its own host.
_IDENTITY = {"os": {"getpid"}, "socket": {"gethostname"}}
_CLOCK_OF_DATETIME = {"now", "utcnow", "today"}


@dataclass(frozen=True)
class Breach:
    """One read of the machine that bypasses the port."""

    where: str  # path:line
    what: str
    module: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}; {_WHY[self.module]}"


def _dotted(node: ast.expr) -> str:
    """`a.b.c` for a chain of attributes on a name, else ''."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def breaches(source: str, name: str) -> Iterator[Breach]:
    """Every way `source` (the text of the file `name`) reads the machine behind the port."""
    tree = ast.parse(source, name)
    seeded_names: set[str] = set()  # what `from random import Random [as X]` bound
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root in ("time", "random", "uuid", "secrets"):
                    yield Breach(where, f"import {alias.name}", root)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            root = node.module.split(".")[0]
            for alias in node.names:
                if root in ("time", "secrets") or (
                    root in _HARMLESS and alias.name not in _HARMLESS[root]
                ):
                    yield Breach(where, f"from {node.module} import {alias.name}", root)
                elif root == "random":
                    seeded_names.add(alias.asname or alias.name)
                elif root == "os" and alias.name in _ENTROPY_OF_OS:
                    yield Breach(where, f"from os import {alias.name}", "os")
                elif alias.name in _IDENTITY.get(root, ()):
                    yield Breach(where, f"from {root} import {alias.name}", "host")
        elif isinstance(node, ast.Attribute):
            base = _dotted(node.value)
            if base == "os" and node.attr in _ENTROPY_OF_OS:
                yield Breach(where, f"os.{node.attr}", "os")
            if node.attr in _IDENTITY.get(base, ()):
                yield Breach(where, f"{base}.{node.attr}", "host")
            if base.split(".")[-1] in ("datetime", "date") and node.attr in _CLOCK_OF_DATETIME:
                yield Breach(where, f"{base}.{node.attr}", "datetime")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in seeded_names
            and not (node.args or node.keywords)
        ):
            yield Breach(f"{name}:{node.lineno}", f"{node.func.id}() without a seed", "random")


def scanned_files() -> list[Path]:
    return sorted(path for folder in SCANNED for path in (ROOT / folder).rglob("*.py"))


def test_the_scanned_packages_read_the_machine_only_through_the_port() -> None:
    files = scanned_files()
    # A renamed folder must not empty the scan and pass it vacuously.
    for expected in ("worker/tier/timers.py", "worker/bus/pull.py", "client/lease.py"):
        assert ROOT / expected in files
    found = [
        str(breach)
        for path in files
        for breach in breaches(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not found, "reads of the machine that bypass worker.ambient:\n" + "\n".join(found)


def test_the_scan_finds_every_forbidden_form_and_spares_the_harmless_ones() -> None:
    source = """
import time
import uuid as u
from time import monotonic
from uuid import UUID, uuid4
from random import Random, choice
import secrets
from os import urandom
import os
from datetime import datetime, UTC

def f():
    import random
    os.urandom(4)
    datetime.now(UTC)
    Random()
    Random(7)
    os.getpid()
    from socket import gethostname
    return UUID(int=0)
"""
    found = {(b.where, b.what) for b in breaches(source, "m.py")}
    assert found == {
        ("m.py:2", "import time"),
        ("m.py:3", "import uuid"),
        ("m.py:4", "from time import monotonic"),
        ("m.py:5", "from uuid import uuid4"),
        ("m.py:6", "from random import choice"),
        ("m.py:7", "import secrets"),
        ("m.py:8", "from os import urandom"),
        ("m.py:13", "import random"),
        ("m.py:14", "os.urandom"),
        ("m.py:15", "datetime.now"),
        ("m.py:16", "Random() without a seed"),
        ("m.py:18", "os.getpid"),
        ("m.py:19", "from socket import gethostname"),
    }


class FakeAmbient(ambient.Ambient):
    """A simulated process's world: a wall clock in 2001, a monotonic clock stopped at 42 s, ids
    counted up, and a seeded generator."""

    WALL_NS = 1_000_000_000_123_456_789

    def __init__(self) -> None:
        self.ids = 0
        self.random = random.Random(36)

    def wall_ns(self) -> int:
        return self.WALL_NS

    def monotonic_s(self) -> float:
        return 42.0

    def new_uuid(self) -> uuid.UUID:
        self.ids += 1
        return uuid.UUID(int=self.ids)

    def chance(self) -> random.Random:
        return self.random


@dataclass(frozen=True)
class Reading:
    now_ms: int
    wall_s: float
    monotonic_s: float
    new_uuid: uuid.UUID
    new_id: str
    chance: random.Random
    current: ambient.Ambient


def read() -> Reading:
    return Reading(
        ambient.now_ms(),
        ambient.wall_s(),
        ambient.monotonic_s(),
        ambient.new_uuid(),
        ambient.new_id(),
        ambient.chance(),
        ambient.current(),
    )


async def read_in_task() -> Reading:
    await asyncio.sleep(0)  # run once the creator went on: the context is the one copied
    return read()


def assert_reads_the_fake(reading: Reading, fake: FakeAmbient, first_id: int) -> None:
    assert reading.current is fake
    assert reading.now_ms == FakeAmbient.WALL_NS // 1_000_000
    assert reading.wall_s == FakeAmbient.WALL_NS / 1e9
    assert reading.monotonic_s == 42.0
    assert reading.new_uuid == uuid.UUID(int=first_id)
    assert reading.new_id == uuid.UUID(int=first_id + 1).hex
    assert reading.chance is fake.random


def assert_reads_the_machine(reading: Reading, fake: FakeAmbient, loop_from: float) -> None:
    assert reading.current is not fake
    assert abs(reading.wall_s - time.time()) < 60
    assert abs(reading.now_ms / 1000 - time.time()) < 60
    assert loop_from <= reading.monotonic_s <= asyncio.get_running_loop().time()
    assert reading.new_uuid.version == 4
    assert len(reading.new_id) == 32 and reading.new_id != reading.new_uuid.hex
    assert reading.chance is not fake.random


async def test_using_holds_for_the_block_and_the_tasks_created_in_it() -> None:
    fake = FakeAmbient()
    loop_from = asyncio.get_running_loop().time()
    with ambient.using(fake):
        assert_reads_the_fake(read(), fake, first_id=1)
        inside = asyncio.create_task(read_in_task())
    outside = asyncio.create_task(read_in_task())
    # Both run after the block ended: the one created in it still reads the fake.
    assert_reads_the_fake(await inside, fake, first_id=3)
    assert_reads_the_machine(await outside, fake, loop_from)
    assert_reads_the_machine(read(), fake, loop_from)


def test_using_nests_and_restores() -> None:
    outer, inner = FakeAmbient(), FakeAmbient()
    with ambient.using(outer):
        with ambient.using(inner):
            assert ambient.current() is inner
        assert ambient.current() is outer
    assert ambient.current() is not outer


async def test_the_machines_monotonic_clock_is_the_loops_and_time_monotonic() -> None:
    """On the standard loop, `loop.time()` is `time.monotonic()`: a deadline the tier computes
    from `monotonic_s` agrees with asyncio's timeouts, and behaves as before the port."""
    before = time.monotonic()
    read_s = ambient.monotonic_s()
    after = time.monotonic()
    assert before <= read_s <= after


def test_without_a_loop_the_monotonic_clock_is_time_monotonic() -> None:
    before = time.monotonic()
    read_s = ambient.monotonic_s()
    assert before <= read_s <= time.monotonic()
