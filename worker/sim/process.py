"""A simulated process: the `Ambient` its code reads, on the simulation's clock and seed.

Every worker, engine host and frontend of a simulation is a `SimProcess`: its tasks run in a
context where `kvhandoff.worker.ambient` reads this object (`ambient.using`), so each reads its
own wall clock (the simulation's virtual time since `EPOCH_S`, plus its own skew, the clock
skew fault) and draws ids and chance from its own stream of the seed, and the network names its
connections after it (`name`), so that crashing a process's host resets them. A worker's
process has its machine's disk (`disk`, worker.sim.disk), which a fault may fill or slow down.
"""

from __future__ import annotations

import asyncio
import random
import uuid

from kvhandoff.worker.ambient import Ambient
from kvhandoff.worker.sim.disk import SimDisk

# Where the simulated wall clock starts: 2026-01-01T00:00:00Z. A fixed date, so that a run's
# records (which carry wall time) are the same in every run of its seed.
EPOCH_S = 1_767_225_600


class SimProcess(Ambient):
    """One simulated process's clocks, ids and chance."""

    def __init__(
        self,
        name: str,
        chance: random.Random,
        *,
        pid: int = 1,
        skew_s: float = 0.0,
        disk: SimDisk | None = None,
    ) -> None:
        self.name = name
        self.disk = disk
        self._pid = pid
        self.skew_s = skew_s
        self._chance = chance

    def wall_ns(self) -> int:
        virtual_s = asyncio.get_running_loop().time()
        return round((EPOCH_S + virtual_s + self.skew_s) * 1e9)

    def new_uuid(self) -> uuid.UUID:
        return uuid.UUID(int=self._chance.getrandbits(128), version=4)

    def chance(self) -> random.Random:
        return self._chance

    def host(self) -> str:
        return self.name

    def pid(self) -> int:
        return self._pid
