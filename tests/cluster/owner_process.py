"""A worker that owns one partition through `worker.tier.owner`, as a real process that the
tests can SIGKILL, SIGSTOP and SIGCONT.

Run as `python -m tests.cluster.owner_process URL NAME PARTITION STATUS_FILE`. It opens the
partitioned input stream, the log stream and the partition's consumer (as every worker of the
tier does, idempotently), then owns the partition: its records are the inputs' payloads, and it
acts by publishing, after each append, the stream sequence of every input it applied to
`kvhandoff.acted.<NAME>`. As worker.tier.partition does with its outbox, it counts an act done only
once `Bus.flush` confirmed its publishes, and each claim publishes again the acts of its own
appended inputs that were not confirmed (a flush that failed as NATS lost a node): at least once,
so a lost act shows up again. At the end it writes what it did to STATUS_FILE, as JSON (its
`worker.tier.metrics.TierMetrics` under "metrics"), and exits 0
once stopped by SIGTERM (after handing the partition over), or 3 once fenced. Its consumer's
priority timeout is 3 s, or KVHANDOFF_PRIORITY_TIMEOUT.

With KVHANDOFF_HANG_AFTER=N in its environment it stops short of acknowledging once it has
applied N inputs: it acts on the batch that reaches N, prints `hanging`, and waits for ever, as
a worker that a SIGKILL hits between its append and its acknowledgements.
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

from prometheus_client import CollectorRegistry

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Inbound
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.bus.streams import wait_jetstream
from kvhandoff.worker.tier.members import Member
from kvhandoff.worker.tier.metrics import TierMetrics
from kvhandoff.worker.tier.owner import Decided, PartitionOwner
from kvhandoff.worker.tier.ownership import CaughtUp, PartitionLog
from kvhandoff.worker.tier.streams import (
    open_partition_consumer,
    open_partition_log,
    open_partitions,
)
from tests.cluster.stand_in import StandIn

PREFIX = "kvhandoff"
STREAM = "KVHANDOFF_IN"
LOG_STREAM = "KVHANDOFF_LOG"
CONSUMER = "kvhandoff-worker"
PARTITIONS = 4
# A new owner is pinned only after the old owner's unacknowledged inputs are due again.
ACK_WAIT_S = 1.0
EXPIRES_S = 1.0
PRIORITY_TIMEOUT_S = float(os.environ.get("KVHANDOFF_PRIORITY_TIMEOUT", "3"))
FENCED_EXIT = 3
_HANG_AFTER = int(os.environ.get("KVHANDOFF_HANG_AFTER", "0"))

logger = logging.getLogger("tests.cluster.owner_process")


async def own(url: str, name: str, partition: int, metrics: TierMetrics) -> PartitionOwner:
    """Own the partition until stopped or fenced; the owner, for its counts."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    bus = await Bus.connect(NatsSettings(url=url), f"owner-{name}")
    try:
        await wait_jetstream(bus, 30)
        await open_partitions(bus, STREAM, PREFIX, PARTITIONS)
        await open_partition_log(bus, LOG_STREAM, PREFIX)
        consumer = await open_partition_consumer(
            bus,
            STREAM,
            PREFIX,
            CONSUMER,
            partition,
            ack_wait_s=ACK_WAIT_S,
            max_pending=1024,
            priority_timeout_s=PRIORITY_TIMEOUT_S,
            partitions=PARTITIONS,
        )
        member = Member.this_process()
        log = PartitionLog(bus, LOG_STREAM, PREFIX, partition, f"{name}/{member.instance}")

        async def decide(batch: Sequence[Inbound]) -> Decided:
            return Decided(json.dumps([inbound.data.decode() for inbound in batch]).encode())

        # Inputs this process appended and acted on, whose publishes no flush confirmed yet.
        unconfirmed: set[int] = set()

        async def publish_acted(seqs: Sequence[int]) -> None:
            unconfirmed.update(seqs)
            for seq in seqs:
                await bus.publish(f"{PREFIX}.acted.{name}", b"%d" % seq)
            await bus.flush()
            unconfirmed.difference_update(seqs)

        async def on_claim(caught: CaughtUp) -> None:
            if again := sorted(unconfirmed & caught.applied):
                logger.warning("publishing again the unconfirmed acts of %s", again)
                await publish_acted(again)

        async def act(batch: Sequence[Inbound]) -> None:
            await publish_acted([inbound.stream_seq for inbound in batch])
            if _HANG_AFTER and owner.applied >= _HANG_AFTER:
                print(f"hanging after {owner.applied} applied, {owner.acked} acked", flush=True)
                await asyncio.Event().wait()  # until SIGKILL: the batch is never acknowledged

        owner = PartitionOwner(
            bus,
            STREAM,
            consumer,
            log,
            StandIn(decide, act, on_claim),
            expires_s=EXPIRES_S,
            heartbeat_s=0.25,
            metrics=metrics,
        )
        print(f"owner {name} pulling partition {partition}", flush=True)
        await owner.run(stop)
        return owner
    finally:
        await bus.close()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    url, name, partition, status = sys.argv[1:5]
    registry = CollectorRegistry()
    owner = asyncio.run(own(url, name, int(partition), TierMetrics(registry)))
    counts = {
        "claims": owner.claims,
        "applied": owner.applied,
        "skipped": owner.skipped,
        "orphans": owner.orphans,
        "acked": owner.acked,
        "refused_pulls": owner.refused_pulls,
        "fenced": owner.fenced,
        "handed_over": owner.handed_over,
        "metrics": {
            "claims": {
                # None: a label never counted
                after: registry.get_sample_value(
                    "kvhandoff_partition_claims_total", {"after": after}
                )
                or 0.0
                for after in ("nothing", "handover", "takeover", "reclaim")
            },
            "fenced": registry.get_sample_value("kvhandoff_fenced_appends_total"),
            "handovers": registry.get_sample_value("kvhandoff_partition_handovers_total"),
        },
    }
    Path(status).write_text(json.dumps(counts))
    return FENCED_EXIT if owner.fenced else 0


if __name__ == "__main__":
    sys.exit(main())
