"""`kvhandoff run`: the worker, until SIGTERM or SIGINT, which drain it (exit 0).

Start-up goes: open the event log, connect to NATS (retried until it answers), (re)create the
consumer, recover, consume. A signal at any of these steps stops the worker promptly with exit
0. Exit 2 when NATS refuses our credentials or TLS. Exit 1 when it stops on an error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from events.subjects import Subjects
from worker.bus import Bus
from worker.config import WorkerConfig, add_worker_arguments, worker_config
from worker.errors import BusError, BusRefused, ConfigError, StoreError
from worker.logs import configure_logging
from worker.metrics import Metrics, MetricsServer
from worker.service import Worker
from worker.store import EventLog

logger = logging.getLogger("worker.run")

_COMPACT_EVERY_S = 3600.0
_CANCEL_AGAIN_S = 0.05

T = TypeVar("T")


def configure(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser)


def execute(args: argparse.Namespace) -> int:
    try:
        config = worker_config(args)
    except ConfigError as exc:
        print(f"kvhandoff run: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    try:
        return asyncio.run(serve(config))
    except BusRefused as exc:
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

    log = await EventLog.open(config.db_path, config.synchronous)
    try:
        bus = await _unless_stopped(stop, Bus.connect(config.nats, name="kvhandoff-worker"))
        if bus is None:
            return 0
        try:
            await _consume(config, log, bus, stop)
        finally:
            await bus.close()
    finally:
        await log.close()
    return 0


async def _consume(config: WorkerConfig, log: EventLog, bus: Bus, stop: asyncio.Event) -> None:
    """Set up the consumer, then run the worker until stopped."""
    metrics = Metrics()
    worker = Worker(config, log, bus, metrics)
    server = None
    if config.metrics_port:
        server = MetricsServer(
            metrics, lambda: worker.healthy, config.metrics_host, config.metrics_port
        )
    retention = asyncio.create_task(_retain(config, log, stop))
    try:
        await _unless_stopped(
            stop,
            bus.open_inbox(
                config.stream,
                Subjects(config.nats.subject_prefix).inputs,
                config.consumer,
                config.ack_wait_s,
                max_pending=max(4 * config.batch_size, 1024),
            ),
        )
        if not stop.is_set():
            logger.info("consuming %s as %s; log %s", config.stream, config.consumer, log.path)
            await worker.run(stop)
    finally:
        retention.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await retention
        if server is not None:
            server.close()


async def _unless_stopped(stop: asyncio.Event, step: Coroutine[Any, Any, T]) -> T | None:
    """The result of `step`, or None if `stop` is set first: then `step` is cancelled."""
    task = asyncio.ensure_future(step)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        while not task.done():
            # Python 3.11's wait_for (nats-py waits on every request with it) drops a
            # cancellation that coincides with the answer: cancel until it takes.
            task.cancel()
            await asyncio.wait([task], timeout=_CANCEL_AGAIN_S)
    # A step that finished anyway hands over what it made (a connection), so that it is
    # closed like any other.
    return None if task.cancelled() else task.result()


async def _retain(config: WorkerConfig, log: EventLog, stop: asyncio.Event) -> None:
    """Delete completed handoffs older than the retention, at start and then hourly."""
    if config.retention_s is None:
        return
    while not stop.is_set():
        cutoff_ms = int((time.time() - config.retention_s) * 1000)
        try:
            removed = await log.compact(cutoff_ms)
            logger.info("retention: removed %d completed handoffs", removed)
        except StoreError as exc:
            logger.warning("retention: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _COMPACT_EVERY_S)
