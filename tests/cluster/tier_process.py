"""A worker of the tier (`worker.tier.membership.Tier`) as a real process that the tests can
SIGKILL.

Run as `python -m tests.cluster.tier_process URL NAME STATUS_FILE`. It owns its share of the
partitions; its record of a batch is the stream sequences of its inputs, and it acts by
publishing, after each append, the stream sequence of every input it applied to
`kvhandoff.acted.<NAME>`. Once stopped by SIGTERM (every partition handed over) it writes what
each of its partition owners did to STATUS_FILE, as JSON, and exits 0.

At a claim it publishes the partition's last record again, as the real coordinator republishes
its outbox at a claim (worker.tier.partition): an owner acts on a batch only after appending it,
and appends the next only after acting, so the previous owner may have died (SIGKILL) between
its last append and its publishes. The new owner skips those inputs, which the log says were
applied, so without this they would never be acted on. Acting is at least once; the log says
what was applied, exactly once.

For the test of that: with `KVHANDOFF_TEST_KILL_BEFORE_ACTING=N` in its environment, it
SIGKILLs itself after appending the batch that brings the inputs it applied to N or more, before
acting on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Inbound
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.bus.streams import wait_jetstream
from kvhandoff.worker.tier.membership import Tier, TierSettings
from kvhandoff.worker.tier.owner import Decided
from kvhandoff.worker.tier.ownership import CaughtUp
from tests.cluster.stand_in import StandIn

PARTITIONS = 4
# No snapshots: the stand-in coordinator has no state to sum up.
SETTINGS = TierSettings(partitions=PARTITIONS, snapshots=None)
KILL_BEFORE_ACTING = "KVHANDOFF_TEST_KILL_BEFORE_ACTING"


async def serve(url: str, name: str) -> Tier:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    bus = await Bus.connect(NatsSettings(url=url), f"tier-{name}")
    try:
        await wait_jetstream(bus, 30)

        async def publish_acted(inputs: Sequence[int]) -> None:
            for seq in inputs:
                await bus.publish(f"{SETTINGS.prefix}.acted.{name}", b"%d" % seq)
            await bus.flush()

        async def decide(batch: Sequence[Inbound]) -> Decided:
            return Decided(json.dumps([inbound.stream_seq for inbound in batch]).encode())

        kill_at = int(os.environ.get(KILL_BEFORE_ACTING, "0"))
        applied = 0

        async def act(batch: Sequence[Inbound]) -> None:
            nonlocal applied
            applied += len(batch)
            if kill_at and applied >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # appended, and dies before acting
            await publish_acted([inbound.stream_seq for inbound in batch])

        async def on_claim(caught: CaughtUp) -> None:
            # Only the last record can have been appended and not acted on (see above).
            if caught.records:
                await publish_acted(json.loads(caught.records[-1]))

        tier = Tier(bus, SETTINGS, lambda _: StandIn(decide, act, on_claim), label=name)
        print(f"worker {name} serving", flush=True)
        await tier.run(stop)
        return tier
    finally:
        await bus.close()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    url, name, status = sys.argv[1:4]
    tier = asyncio.run(serve(url, name))
    owners = [
        {
            "partition": partition,
            "claims": owner.claims,
            "applied": owner.applied,
            "skipped": owner.skipped,
            "orphans": owner.orphans,
            "held": owner.held,
            "fenced": owner.fenced,
            "handed_over": owner.handed_over,
        }
        for partition, owner in tier.owners
    ]
    Path(status).write_text(json.dumps({"rounds": tier.rounds, "owners": owners}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
