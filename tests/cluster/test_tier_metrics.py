"""The tier's metrics (worker.tier.metrics.TierMetrics), scraped from the /metrics of real
`kvhandoff run --partitions 4` children on the real three-node cluster, while the real mock
engines (`kvhandoff engines`) and load generator (`kvhandoff load`) run the handoffs; every
process is given all three nodes' URLs, comma-separated.

One worker owns every partition and claims each (at its first input, or vacant); a second
joins, and the first hands it two partitions over, which the second claims as a hand-over; the
first is killed with SIGKILL, and the survivor takes its partitions over, claims them as a
takeover after catching up on their logs, and owns all four. Each load ends every handoff, with
no leak.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvhandoff.worker.harness.child import Child
from kvhandoff.worker.harness.natsserver import NatsCluster
from tests.cluster.conftest import PARTITIONS, WITHIN_S, TierWorker, until

HANDOFFS = 40  # per load: every partition gets inputs (a miss is 4 * 0.75**40, 4e-5)
CLI = [sys.executable, "-m", "kvhandoff.worker.cli"]


def sample(worker: TierWorker, name: str, **labels: str) -> float:
    """The sum of `name`'s samples with these labels in the worker's /metrics."""
    return sum(
        s.value
        for family in text_string_to_metric_families(worker.metrics())
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def owned(worker: TierWorker) -> int:
    return int(sample(worker, "kvhandoff_owned_partitions"))


def claims(worker: TierWorker, after: str | None = None) -> int:
    labels = {} if after is None else {"after": after}
    return int(sample(worker, "kvhandoff_partition_claims_total", **labels))


def load(url: str, tmp: Path, name: str) -> Child:
    """`kvhandoff load` of HANDOFFS handoffs, once every engine of its roster listens."""
    child = Child(
        [
            *CLI,
            "load",
            "--nats-url",
            url,
            "--handoffs",
            str(HANDOFFS),
            "--concurrency",
            "8",
            "--wait-for-engines",
            "60s",
            "--quiet",
            "--json",
            str(tmp / f"{name}.json"),
        ],
        tmp / f"{name}.log",
    )
    child.launch()
    return child


async def ended_well(child: Child) -> None:
    """The load exits 0: every handoff ended with a Complete, and no engine leaks."""
    assert child.process is not None
    code = await asyncio.to_thread(child.process.wait, 6 * WITHIN_S)
    assert code == 0, f"{child.name} exited {code}: {child.logs()}"


async def test_owned_partitions_claims_handovers_and_a_takeover_show_in_the_metrics(
    nats_cluster: NatsCluster, tmp_path: Path
) -> None:
    url = nats_cluster.url
    assert url.count(",") == 2, url
    w1, w2 = TierWorker(url, "w1", tmp_path), TierWorker(url, "w2", tmp_path)
    engines = Child([*CLI, "engines", "--nats-url", url, "--speedup", "10"], tmp_path / "e.log")
    with engines, w1, w2:
        w1.start(timeout_s=2 * WITHIN_S)
        engines.launch()
        await until(lambda: owned(w1) == PARTITIONS, "w1 owns every partition")
        await ended_well(load(url, tmp_path, "load-1"))
        assert claims(w1, "nothing") == PARTITIONS, w1.metrics()

        w2.start(timeout_s=2 * WITHIN_S)
        await until(lambda: owned(w1) == owned(w2) == PARTITIONS // 2, "w1 hands w2 its share")
        # The gauge drops once the owners it stopped have handed over.
        assert sample(w1, "kvhandoff_partition_handovers_total") == PARTITIONS // 2
        await ended_well(load(url, tmp_path, "load-2"))
        assert claims(w2, "handover") == claims(w2) == PARTITIONS // 2, w2.metrics()

        w1.kill()
        last = load(url, tmp_path, "load-3")
        await until(
            lambda: claims(w2, "takeover") == PARTITIONS // 2,
            "w2 takes w1's partitions over",
        )
        assert owned(w2) == PARTITIONS
        await ended_well(last)
        # Each claim read its partition's log; those taken over held what w1 appended.
        assert sample(w2, "kvhandoff_catch_up_seconds_count") == claims(w2) == PARTITIONS
        assert sample(w2, "kvhandoff_catch_up_entries_total") > 0
        assert sample(w2, "kvhandoff_fenced_appends_total") == 0
        assert await asyncio.to_thread(w2.terminate, 2 * WITHIN_S) == 0, w2.logs()
        assert await asyncio.to_thread(engines.terminate) == 0, engines.logs()
