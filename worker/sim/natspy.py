"""What the simulation pins in nats-py: its clock, its shuffles and the randomness of its ids.

The tier reaches NATS through nats-py, which runs unchanged in the simulation (worker.sim's
layers). But nats-py reads the machine behind its callers' backs: `time.monotonic()` to space
its reconnect attempts, `random.shuffle` on its server pool and `secrets` for its inbox names
(`nats.nuid`) and request tokens. Each would make two runs of one seed differ, and the machine's
clock would mix wall time into a loop whose timers are virtual. `pinned()` replaces those names
in nats-py's modules for the length of a simulation, with readers of the current
`kvhandoff.worker.ambient.Ambient`: the simulated process's (it is read when nats-py calls, in
the calling task's context). Outside the block nats-py is as it was.

The names patched are the ones nats-py 2.16 imports (its version is pinned, and
tests/sim/test_natspy.py fails if one of them moves).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, MutableSequence
from typing import Any

import nats.aio.client
import nats.nuid

from kvhandoff.worker import ambient


def _shuffle(items: MutableSequence[Any]) -> None:
    ambient.chance().shuffle(items)


def _token_hex(nbytes: int) -> str:
    return ambient.chance().randbytes(nbytes).hex()


def _token_bytes(nbytes: int) -> bytes:
    return ambient.chance().randbytes(nbytes)


def _randbelow(n: int) -> int:
    return ambient.chance().randrange(n)


# nats-py's client reads only `time.monotonic` of the time module.
_TIME = types.SimpleNamespace(monotonic=ambient.monotonic_s)

# (module, name, replacement): every read of the machine that nats-py makes.
PINS: tuple[tuple[types.ModuleType, str, object], ...] = (
    (nats.aio.client, "time", _TIME),
    (nats.aio.client, "shuffle", _shuffle),
    (nats.aio.client, "token_hex", _token_hex),
    (nats.nuid, "token_bytes", _token_bytes),
    (nats.nuid, "randbelow", _randbelow),
)


@contextlib.contextmanager
def pinned() -> Iterator[None]:
    """nats-py reads the current `Ambient` instead of the machine until the block ends."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in PINS]
    try:
        for module, name, replacement in PINS:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
