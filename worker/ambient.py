"""What the tier and the client read from the world besides the bus: clocks, ids, chance, host.

Why a port. The deterministic simulation (worker.sim) runs the tier's own code, many workers
in one process, under a virtual clock and one seed. That only works if nothing the tier runs
reads the machine's clock, `random` or `uuid4` behind its back: each would make two runs of one
seed differ, or a simulated hour take an hour. So they are read here and nowhere else in
`worker/tier`, `worker/bus`, `worker/engines`, `worker/loadgen` and `client`
(tests/test_ambient.py holds them to it).

How it is swapped. The functions below read the `Ambient` of the current context
(`contextvars`), the machine's by default. A simulated worker runs in a context whose `Ambient`
is the simulation's (`using`): asyncio copies the context into every task it creates, so the
worker's tasks, and the tasks theirs create, read that one, its skewed wall clock and its own
stream of ids, while the next worker in the same loop reads its own. The same object tells the
simulation's loop whose code a callback is (`in_context`), so that it can crash or pause one
simulated process among many.

The monotonic clock is the running loop's when there is one: asyncio times `sleep`,
`wait_for` and `call_later` by `loop.time()`, so a deadline computed from `monotonic_s` and
one asyncio keeps agree, on the machine's loop (where `loop.time()` is `time.monotonic()`) and
on the simulation's (where it is virtual).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import random
import socket
import time
import uuid
from collections.abc import Iterator


class Ambient:
    """The machine's clocks, ids and chance. The simulation subclasses it."""

    def wall_ns(self) -> int:
        """Nanoseconds since the epoch, by the wall clock."""
        return time.time_ns()

    def monotonic_s(self) -> float:
        """Seconds on a clock that never goes back: the running loop's, if any."""
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return time.monotonic()

    def new_uuid(self) -> uuid.UUID:
        """A new random (version 4) UUID."""
        return uuid.uuid4()

    def chance(self) -> random.Random:
        """The source of randomness, for jitter and for load generation."""
        return _MACHINE_RANDOM

    def host(self) -> str:
        """The name of the host this process runs on."""
        return socket.gethostname()

    def pid(self) -> int:
        """This process's id."""
        return os.getpid()


_MACHINE_RANDOM = random.Random()
_MACHINE = Ambient()
_current: contextvars.ContextVar[Ambient | None] = contextvars.ContextVar(
    "kvhandoff_ambient", default=None
)


@contextlib.contextmanager
def using(ambient: Ambient) -> Iterator[None]:
    """Read `ambient` in this context and in the tasks created in it, until the block ends."""
    token = _current.set(ambient)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> Ambient:
    """The `Ambient` this context reads."""
    return _current.get() or _MACHINE


def in_context(context: contextvars.Context) -> Ambient | None:
    """The `Ambient` code run in `context` reads, or None if it reads the machine's default."""
    return context.get(_current)


def now_ms() -> int:
    """Milliseconds since the epoch, by the wall clock."""
    return current().wall_ns() // 1_000_000


def wall_s() -> float:
    """Seconds since the epoch, by the wall clock."""
    return current().wall_ns() / 1e9


def monotonic_s() -> float:
    """Seconds on a clock that never goes back (`Ambient.monotonic_s`)."""
    return current().monotonic_s()


def new_uuid() -> uuid.UUID:
    """A new random UUID."""
    return current().new_uuid()


def new_id() -> str:
    """A new random id, as 32 hex digits (message ids, instance names, incarnations)."""
    return current().new_uuid().hex


def chance() -> random.Random:
    """The current source of randomness."""
    return current().chance()


def host() -> str:
    """The name of the host this process runs on (worker membership records, engine hosts)."""
    return current().host()


def pid() -> int:
    """This process's id."""
    return current().pid()
