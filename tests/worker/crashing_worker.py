"""`kvhandoff run` that dies, as a SIGKILL would, at the pipeline's most delicate point: right
after batch k's rows were appended to the partition's replicated log, before any of them is in
the local file, before k's actions are published or its inputs acknowledged, with batch k+1
decided behind it (its plan made, its append not sent) and the inputs of later batches
delivered and waiting (worker.tier.partition, worker.tier.owner).

Run as `python -m tests.worker.crashing_worker run ...`; it crashes at the first `act` after
KVHANDOFF_CRASH_AFTER_BATCHES batches of rows were acted on that has a later batch decided
behind it, and prints `crashing: appended batch N, acted on none of it, batch N+1 decided`
first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from kvhandoff.worker.bus.pull import Inbound
from kvhandoff.worker.cli import main
from kvhandoff.worker.tier.partition import Partition

_AFTER = int(os.environ.get("KVHANDOFF_CRASH_AFTER_BATCHES", "3"))
_acted = {"batches": 0}
_act = Partition.act


async def _crashing_act(self: Partition, batch: Sequence[Inbound]) -> None:
    _acted["batches"] += 1
    # The worker of this test owns one partition: this one.
    decided = len(self.decided)
    if _acted["batches"] > _AFTER and decided > 1:
        n = _acted["batches"]
        print(f"crashing: appended batch {n}, acted on none of it, batch {n + 1} decided")
        sys.stdout.flush()
        os._exit(137)
    await _act(self, batch)


Partition.act = _crashing_act  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
