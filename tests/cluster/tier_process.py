"""A worker of the tier (`worker.tier.Tier`) as a real process that the tests can SIGKILL.

Run as `python -m tests.cluster.tier_process URL NAME STATUS_FILE`. It owns its share of the
partitions; its records are the inputs' payloads, and it acts by publishing, after each append,
the stream sequence of every input it applied to `kvhandoff.acted.<NAME>`. Once stopped by
SIGTERM (every partition handed over) it writes what each of its partition owners did to
STATUS_FILE, as JSON, and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvhandoff.worker.bus import Bus, Inbound
from kvhandoff.worker.config import NatsSettings
from kvhandoff.worker.tier import Tier, TierSettings

PARTITIONS = 4
SETTINGS = TierSettings(partitions=PARTITIONS)


async def serve(url: str, name: str) -> Tier:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    bus = await Bus.connect(NatsSettings(url=url), f"tier-{name}")
    try:
        await bus.wait_jetstream(30)

        async def decide(batch: Sequence[Inbound]) -> bytes:
            return json.dumps([inbound.data.decode() for inbound in batch]).encode()

        async def act(batch: Sequence[Inbound]) -> None:
            for inbound in batch:
                await bus.publish(f"{SETTINGS.prefix}.acted.{name}", b"%d" % inbound.stream_seq)
            await bus.flush()

        tier = Tier(bus, SETTINGS, decide, act, label=name)
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
