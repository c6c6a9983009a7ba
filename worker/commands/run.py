"""`kvhandoff run`: the worker, until SIGTERM or SIGINT, which drain it (exit 0).

Every worker is one worker of a partitioned tier (worker.tier.service, worker.tier.membership):
alone, on the embedded default, it is the only worker of a tier of one partition, whose log is
`--db`. With `--partitions P --data-dir DIR` each partition it owns has its log at
`DIR/partition-<p>.db`.

Start-up goes: take the writer lock of `--db` (or of DIR, `DIR/worker.lock`), and exit 2 at
once if another worker holds it; connect to NATS (retried until it answers); set up the streams,
the consumers and the membership (retried while JetStream cannot answer: a tier starts with its
cluster); announce itself and claim its share. A second worker on the same stream, with its own
log, is a member of the tier like any other: at P = 1 it stands by and takes the partition over
once the first stops or dies (worker.tier.membership). A signal at any of these steps stops the
worker promptly with exit 0. Exit 2 when it cannot start as configured: the configuration cannot
work, another worker holds the log, NATS refuses our credentials or TLS, the input stream was made
with another partition count (or for a single worker of an earlier version), or a partition it
claims holds an open handoff that this build's coordinator does not re-derive. Exit 1 when it
stops on an error it cannot serve through.
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

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.config import WorkerConfig, add_worker_arguments, worker_config
from kvhandoff.worker.errors import (
    BusError,
    BusRefused,
    ConfigError,
    LogDiverges,
    NewerLogVersion,
    StoreError,
    StoreLocked,
    StreamMismatch,
)
from kvhandoff.worker.log.store import EventLog, WriterLock
from kvhandoff.worker.logging_setup import configure_logging
from kvhandoff.worker.stoppable import cancel_until_done, unless_stopped
from kvhandoff.worker.tier.metrics import Metrics, MetricsServer
from kvhandoff.worker.tier.service import Worker, tier_settings

logger = logging.getLogger("kvhandoff.worker.run")

_COMPACT_EVERY_S = 3600.0


def configure(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser)


def execute(args: argparse.Namespace) -> int:
    try:
        config = worker_config(args)
        config.make_data_dir()
    except ConfigError as exc:
        print(f"kvhandoff run: {exc}", file=sys.stderr)
        return 2
    # One worker per log: `--db`, or a data directory (two workers on one directory would
    # claim partitions from each other and then fail to open the partition's file).
    try:
        lock = WriterLock.acquire(config.locked_path)
    except StoreError as exc:
        print(f"kvhandoff run: {exc}", file=sys.stderr)
        # A log in use is refused like a setting that cannot work; anything else is the log
        # failing, as it would later.
        return 2 if isinstance(exc, StoreLocked) else 1
    configure_logging(config.log_level, config.log_format)
    # Held until the process ends: the OS releases it if the process dies first.
    with lock:
        try:
            return asyncio.run(serve(config))
        except (BusRefused, ConfigError, LogDiverges, NewerLogVersion, StreamMismatch) as exc:
            logger.error("cannot start: %s", exc)
            return 2
        except (StoreError, BusError) as exc:
            logger.error("worker stopped: %s", exc)
            return 1


async def serve(config: WorkerConfig) -> int:
    """One worker of the tier until SIGTERM or SIGINT; every partition is handed over."""
    settings = tier_settings(config)  # its timings are checked before anything connects
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    bus = await unless_stopped(stop, Bus.connect(config.nats, name="kvhandoff-worker"))
    if bus is None:
        return 0
    try:
        metrics = Metrics()
        worker = Worker(
            config,
            settings,
            bus,
            metrics,
            label=f"{socket.gethostname()}:{os.getpid()}",
        )
        beside = _beside(
            config,
            metrics,
            healthy=lambda: worker.healthy,
            retention_s=config.tier_retention_s,
            logs=worker.logs,
            stop=stop,
        )
        async with beside:
            logger.info(
                "serving %d partitions of %s as %s; logs %s",
                config.tier.partitions,
                config.tier.stream,
                worker.tier.owner_name,
                config.partition_file(0) if config.data_dir is None else config.data_dir,
            )
            await worker.run(stop)
        return 0
    finally:
        await bus.close()


@contextlib.asynccontextmanager
async def _beside(
    config: WorkerConfig,
    metrics: Metrics,
    *,
    healthy: Callable[[], bool],
    retention_s: float,
    logs: Callable[[], Iterable[EventLog]],
    stop: asyncio.Event,
) -> AsyncIterator[None]:
    """What runs beside a worker while it runs: its metrics endpoint (unless the port is 0)
    and its retention loop."""
    server = None
    if config.metrics_port:
        server = MetricsServer(metrics, healthy, config.metrics_host, config.metrics_port)
    retention = asyncio.create_task(_retain(retention_s, logs, stop))
    try:
        yield
    finally:
        await cancel_until_done(retention)
        if server is not None:
            server.close()


async def _retain(
    retention_s: float, logs: Callable[[], Iterable[EventLog]], stop: asyncio.Event
) -> None:
    """Delete completed handoffs and rejections older than the retention from the logs (the
    partition files the worker has open), at start and then hourly."""
    while not stop.is_set():
        cutoff_ms = int((time.time() - retention_s) * 1000)
        for log in logs():
            try:
                removed = await log.compact(cutoff_ms)
                logger.info(
                    "retention: removed %d completed handoffs and %d rejections from %s",
                    removed.handoffs,
                    removed.rejections,
                    log.path,
                )
            except StoreError as exc:
                logger.warning("retention: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _COMPACT_EVERY_S)
