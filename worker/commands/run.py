"""`kvhandoff run`: the worker, until SIGTERM or SIGINT, which drain it (exit 0).

Exit 2 at once, before NATS or the log is touched, when the configuration cannot work or another
worker holds the log's `WriterLock`; exit 1 when the log or the bus fails later.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time

from events.subjects import Subjects
from worker.bus import Bus
from worker.config import WorkerConfig, add_worker_arguments, worker_config
from worker.errors import BusError, ConfigError, StoreError, StoreLocked
from worker.logs import configure_logging
from worker.metrics import Metrics, MetricsServer
from worker.service import Worker
from worker.store import EventLog, WriterLock

logger = logging.getLogger("worker.run")

_COMPACT_EVERY_S = 3600.0


def configure(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser)


def execute(args: argparse.Namespace) -> int:
    try:
        config = worker_config(args)
    except ConfigError as exc:
        print(f"kvhandoff run: {exc}", file=sys.stderr)
        return 2
    try:
        lock = WriterLock.acquire(config.db_path)
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
        except (StoreError, BusError) as exc:
            logger.error("worker stopped: %s", exc)
            return 1


async def serve(config: WorkerConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    log = await EventLog.open(config.db_path, config.synchronous)
    try:
        bus = await _connect(config, stop)
        if bus is None:
            return 0
        metrics = Metrics()
        worker = Worker(config, log, bus, metrics)
        server = None
        if config.metrics_port:
            server = MetricsServer(
                metrics, lambda: worker.healthy, config.metrics_host, config.metrics_port
            )
        retention = asyncio.create_task(_retain(config, log, stop))
        try:
            await bus.open_inbox(
                config.stream,
                Subjects(config.nats.subject_prefix).inputs,
                config.consumer,
                config.ack_wait_s,
                max_pending=max(4 * config.batch_size, 1024),
            )
            await bus.open_completions(
                config.done_stream,
                Subjects(config.nats.subject_prefix).completions,
                config.completion_ttl_s,
            )
            logger.info("consuming %s as %s; log %s", config.stream, config.consumer, log.path)
            await worker.run(stop)
        finally:
            retention.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await retention
            if server is not None:
                server.close()
            await bus.close()
    finally:
        await log.close()
    return 0


async def _connect(config: WorkerConfig, stop: asyncio.Event) -> Bus | None:
    """Connect, retrying until NATS answers (it may start after us), or None if stopped."""
    delay = 0.25
    while not stop.is_set():
        try:
            return await Bus.connect(config.nats, name="kvhandoff-worker")
        except BusError as exc:
            logger.warning("%s; retrying in %.1fs", exc, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, 5.0)
    return None


async def _retain(config: WorkerConfig, log: EventLog, stop: asyncio.Event) -> None:
    """Delete completed handoffs and rejections older than the retention, at start and then
    hourly."""
    if config.retention_s is None:
        return
    while not stop.is_set():
        cutoff_ms = int((time.time() - config.retention_s) * 1000)
        try:
            removed = await log.compact(cutoff_ms)
            logger.info(
                "retention: removed %d completed handoffs and %d rejections",
                removed.handoffs,
                removed.rejections,
            )
        except StoreError as exc:
            logger.warning("retention: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _COMPACT_EVERY_S)
