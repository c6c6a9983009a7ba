"""End-to-end handoffs per second and latency: `kvhandoff run` driven by the mock engines and
the load generator, at several concurrency levels.

Run from the repository root as `python bench/load.py [--handoffs N] [--levels 8,32,128]
[--speedup S] [--cancel-share F]`. It starts its own nats-server and one worker process (its
SQLite log in a temporary directory, default settings), runs the mock engines in process (the
default roster: vLLM, SGLang and TRT-LLM, two sources and two destinations each), and then,
per level, one closed-loop `run_load` of `--handoffs` handoffs after an untimed warm-up of 100.

Engine times are divided by `--speedup` (default 1000: prefill, transfer and decode take well
under a millisecond), so the figures are the worker's and the bus's: each handoff is six
actions, each a round trip engine -> JetStream -> worker (group commit) -> engine. A level's
row is the load generator's report: handoffs per second from the first start to the last
Complete, end-to-end latency percentiles of the successful handoffs, and the leak count (which
must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

# Runnable from a checkout (`python bench/load.py`) without installing: the repository root
# holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvhandoff.client import Connection
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.engines import EngineModel, EnginesConfig, MockEngines
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.loadgen.generator import LoadConfig, LoadReport, run_load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handoffs", type=int, default=2000)
    parser.add_argument("--levels", default="8,32,128")
    parser.add_argument("--speedup", type=float, default=1000.0)
    parser.add_argument("--cancel-share", type=float, default=0.0)
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    reports = asyncio.run(bench(args.handoffs, levels, args.speedup, args.cancel_share))
    print(
        f"{'concurrency':>11} {'handoffs/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
        f"{'completed':>9} {'canceled':>8} {'leaks':>5}"
    )
    for level, report in zip(levels, reports, strict=True):
        latency = report.latency_ms
        print(
            f"{level:>11} {report.throughput_per_s:>10.0f} {latency.p50 or 0:>8.1f} "
            f"{latency.p90 or 0:>8.1f} {latency.p99 or 0:>8.1f} {report.completed:>9} "
            f"{report.canceled:>8} {report.leaks:>5}"
        )


async def bench(
    handoffs: int, levels: list[int], speedup: float, cancel_share: float
) -> list[LoadReport]:
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-") as tmp, EmbeddedNats() as server:
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvhandoff.worker.cli",
            "run",
            "--nats-url",
            server.url,
            "--db",
            str(Path(tmp) / "kvhandoff.db"),
            "--metrics-port",
            "0",
            "--log-level",
            "WARNING",
        )
        settings = NatsSettings(url=server.url)
        connection = await Connection.open(settings, "bench-engines")
        engines = MockEngines(connection, EnginesConfig(model=EngineModel(speedup=speedup)))
        try:
            await engines.start()
            # The load generator waits for the worker's input stream, so this also waits for
            # the worker to start.
            await run_load(LoadConfig(nats=settings, handoffs=100, concurrency=8))
            reports = []
            for level in levels:
                config = LoadConfig(
                    nats=settings, handoffs=handoffs, concurrency=level, cancel_share=cancel_share
                )
                reports.append(await run_load(config))
            return reports
        finally:
            await engines.stop()
            await connection.close()
            worker.terminate()
            await asyncio.wait_for(worker.wait(), 30)


if __name__ == "__main__":
    main()
