"""`kvhandoff run` that dies, as a SIGKILL would, at the pipeline's most delicate point: right
after batch k committed, before k's actions are published or its inputs acknowledged, while
batch k+1 is already fetched and planned (its effects in memory, nothing of it written).

Run as `python -m tests.worker.crashing_worker run ...`; it crashes at the first commit after
KVHANDOFF_CRASH_AFTER_COMMITS commits, once a later batch is planned, and prints
`crashing: commit N with batch M planned` first. It waits for that plan rather than hope for it:
a commit that is quicker than the next fetch and plan would otherwise never see one.
"""

from __future__ import annotations

import asyncio
import os
import sys
from uuid import UUID

from kvhandoff.worker import service
from kvhandoff.worker.bus import Inbound
from kvhandoff.worker.cli import main
from kvhandoff.worker.planner import Decoded, Plan
from kvhandoff.worker.store import Batch

_AFTER = int(os.environ.get("KVHANDOFF_CRASH_AFTER_COMMITS", "3"))
_seen = {"plans": 0, "commits": 0}
_planned = asyncio.Event()
_plan = service.Worker._plan
_commit = service.Worker._commit


async def _counting_plan(
    self: service.Worker,
    deliveries: list[Inbound],
    decoded: Decoded,
    missing: list[UUID],
    into: Batch | None = None,
) -> Plan:
    plan = await _plan(self, deliveries, decoded, missing, into)
    if into is None:  # a batch of its own, not a top-up of one
        _seen["plans"] += 1
        _planned.set()
    return plan


async def _crashing_commit(self: service.Worker, batch: Batch, *, every_mark: bool = False) -> None:
    await _commit(self, batch, every_mark=every_mark)
    if batch.events:
        _seen["commits"] += 1
        if _seen["commits"] >= _AFTER:
            # The loop fetches and plans the next batch while this one is carried out.
            while _seen["plans"] <= _seen["commits"]:
                _planned.clear()
                await asyncio.wait_for(_planned.wait(), 30)
            print(f"crashing: commit {_seen['commits']} with batch {_seen['plans']} planned")
            sys.stdout.flush()
            os._exit(137)


service.Worker._plan = _counting_plan  # type: ignore[method-assign]
service.Worker._commit = _crashing_commit  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
