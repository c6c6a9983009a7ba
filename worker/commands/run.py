"""`kvhandoff run`: the worker, until SIGTERM or SIGINT, which drain it (exit 0).

Start-up goes: take the log's `WriterLock` (exit 2 at once if another worker holds it), open the
event log (migrating a log of layout 1 to layout 2, see `worker.store`), connect to NATS
(retried until it answers), take the lease on the input stream's consumer, (re)create the
consumer, recover, consume. A signal at any of these steps stops the worker promptly with exit
0. Exit 2 when it cannot start as configured: the configuration cannot work, another worker
holds the log, NATS refuses our credentials or TLS, another worker holds the lease, or this
build's coordinator does not re-derive an open handoff's log. Exit 1 when it stops on an error,
which includes losing the lease while running: it stops fetching at once, finishes the batch in
hand and exits, because another worker now consumes the stream.

With `--partitions P --data-dir DIR` it runs as one worker of a partitioned tier instead
(`worker.partitioned`): no lease and no `--db`; each owned partition's log is
`DIR/partition-<p>.db` under its own writer lock, and DIR itself is locked (`DIR/worker.lock`):
exit 2 if another worker uses it, or if the input stream was made with another partition count,
and when a partition it claims holds an open handoff that this build does not re-derive.
A tier starts with its cluster: its set-up (the streams, the consumers, the membership) keeps
trying while JetStream cannot answer (worker.tier).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable

from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus import Bus, Lease, LeaseHolder
from kvhandoff.worker.config import WorkerConfig, add_worker_arguments, worker_config
from kvhandoff.worker.errors import (
    BusError,
    BusRefused,
    ConfigError,
    LeaseHeld,
    LogDiverges,
    PartitionsMismatch,
    StoreError,
    StoreLocked,
)
from kvhandoff.worker.logs import configure_logging
from kvhandoff.worker.metrics import Metrics, MetricsServer
from kvhandoff.worker.partitioned import PartitionedWorker
from kvhandoff.worker.service import Worker
from kvhandoff.worker.stoppable import unless_stopped
from kvhandoff.worker.store import EventLog, WriterLock
from kvhandoff.worker.tier import TierSettings

logger = logging.getLogger("kvhandoff.worker.run")

_COMPACT_EVERY_S = 3600.0


def configure(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser)


def execute(args: argparse.Namespace) -> int:
    try:
        config = worker_config(args)
    except ConfigError as exc:
        print(f"kvhandoff run: {exc}", file=sys.stderr)
        return 2
    # One worker per log: the single worker's file, or a tier worker's data directory (two
    # workers on one directory would claim partitions from each other and then fail to open
    # the partition's file).
    locked = config.db_path if config.data_dir is None else config.data_dir / "worker"
    try:
        lock = WriterLock.acquire(locked)
    except StoreError as exc:
        print(f"kvhandoff run: {exc}", file=sys.stderr)
        # A log in use is refused like a setting that cannot work; anything else is the log
        # failing, as it would later.
        return 2 if isinstance(exc, StoreLocked) else 1
    configure_logging(config.log_level, config.log_format)
    # Held until the process ends: the OS releases it if the process dies first.
    with lock:
        try:
            return asyncio.run(serve(config) if config.partitions is None else serve_tier(config))
        except (BusRefused, ConfigError, LeaseHeld, LogDiverges, PartitionsMismatch) as exc:
            logger.error("cannot start: %s", exc)
            return 2
        except (StoreError, BusError) as exc:
            logger.error("worker stopped: %s", exc)
            return 1


async def serve(config: WorkerConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    log = await EventLog.open(config.db_path, config.synchronous, migrate=True)
    try:
        bus = await unless_stopped(stop, Bus.connect(config.nats, name="kvhandoff-worker"))
        if bus is None:
            return 0
        try:
            holder = LeaseHolder.this_process(config.db_path)
            lease = await unless_stopped(
                stop, bus.acquire_lease(config.stream, config.consumer, holder)
            )
            if lease is None:
                return 0
            return await _consume(config, log, bus, lease, stop)
        finally:
            await bus.close()
    finally:
        await log.close()


async def serve_tier(config: WorkerConfig) -> int:
    """One worker of the tier until SIGTERM or SIGINT; every partition is handed over."""
    assert config.partitions is not None and config.data_dir is not None  # validated
    settings = TierSettings(
        partitions=config.partitions, prefix=config.nats.subject_prefix,
        stream=config.stream, consumer=config.consumer,
        log_max_age_s=config.tier_retention_s, done_stream=config.done_stream,
        completion_ttl_s=config.completion_ttl_s, priority_timeout_s=config.priority_timeout_s,
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    bus = await unless_stopped(stop, Bus.connect(config.nats, name="kvhandoff-worker"))
    if bus is None:
        return 0
    try:
        metrics = Metrics()
        worker = PartitionedWorker(
            config, settings, bus, metrics, label=f"{socket.gethostname()}:{os.getpid()}"
        )
        beside = _beside(
            config, metrics, healthy=lambda: worker.healthy,
            retention_s=config.tier_retention_s, logs=worker.logs, stop=stop,
        )  # fmt: skip
        async with beside:
            logger.info(
                "serving %d partitions of %s as %s; logs in %s",
                config.partitions, config.stream, worker.tier.owner_name, config.data_dir,
            )  # fmt: skip
            await worker.run(stop)
        return 0
    finally:
        await bus.close()


async def _consume(
    config: WorkerConfig, log: EventLog, bus: Bus, lease: Lease, stop: asyncio.Event
) -> int:
    """Hold the lease while the worker runs; 1 if it was lost, 0 once stopped."""
    keeper = asyncio.create_task(lease.keep(), name="kvhandoff-lease")
    # The keeper ends only when the lease is lost: stop fetching at once.
    keeper.add_done_callback(lambda _: stop.set())
    metrics = Metrics()
    worker = Worker(config, log, bus, metrics)
    beside = _beside(
        config, metrics, healthy=lambda: worker.healthy,
        retention_s=config.retention_s, logs=lambda: [log], stop=stop,
    )  # fmt: skip
    try:
        async with beside:
            # Only now, with the stream to ourselves, may the consumer be re-created.
            await unless_stopped(
                stop,
                bus.open_inbox(
                    config.stream,
                    Subjects(config.nats.subject_prefix).inputs,
                    config.consumer,
                    config.ack_wait_s,
                    max_pending=max(4 * config.batch_size, 1024),
                ),
            )
            await unless_stopped(
                stop,
                bus.open_completions(
                    config.done_stream,
                    Subjects(config.nats.subject_prefix).completions,
                    config.completion_ttl_s,
                ),
            )
            if not stop.is_set():
                logger.info("consuming %s as %s; log %s", config.stream, config.consumer, log.path)
                await worker.run(stop)
    finally:
        lost = keeper.exception() if keeper.done() else None
        if lost is None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            await lease.release()
    if lost is not None:
        logger.error("stopped consuming %s: %s", config.stream, lost)
        return 1
    return 0


@contextlib.asynccontextmanager
async def _beside(
    config: WorkerConfig, metrics: Metrics, *, healthy: Callable[[], bool],
    retention_s: float | None, logs: Callable[[], Iterable[EventLog]], stop: asyncio.Event,
) -> AsyncIterator[None]:  # fmt: skip
    """What runs beside a worker while it runs: its metrics endpoint (unless the port is 0)
    and its retention loop."""
    server = None
    if config.metrics_port:
        server = MetricsServer(metrics, healthy, config.metrics_host, config.metrics_port)
    retention = asyncio.create_task(_retain(retention_s, logs, stop))
    try:
        yield
    finally:
        retention.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await retention
        if server is not None:
            server.close()


async def _retain(
    retention_s: float | None, logs: Callable[[], Iterable[EventLog]], stop: asyncio.Event
) -> None:
    """Delete completed handoffs and rejections older than the retention from the logs (the
    worker's, or the partition files the tier worker has open), at start and then hourly."""
    if retention_s is None:
        return
    while not stop.is_set():
        cutoff_ms = int((time.time() - retention_s) * 1000)
        for log in logs():
            try:
                removed = await log.compact(cutoff_ms)
                logger.info(
                    "retention: removed %d completed handoffs and %d rejections from %s",
                    removed.handoffs, removed.rejections, log.path,
                )  # fmt: skip
            except StoreError as exc:
                logger.warning("retention: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _COMPACT_EVERY_S)
