"""A step that a stop (a signal) abandons: `unless_stopped`.

A worker that is told to stop while it waits on NATS (a connect that is not answered, a
JetStream request that waits out its timeout) must exit promptly, and leave nothing half made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_CANCEL_AGAIN_S = 0.05


async def unless_stopped(stop: asyncio.Event, step: Coroutine[Any, Any, T]) -> T | None:
    """The result of `step` (or its error), or None if `stop` is set first: then `step` is
    cancelled, and waited for."""
    task = asyncio.ensure_future(step)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        await cancel_until_done(task)
    # A step that finished anyway hands over what it made (a connection, a subscription), so that it
    # is closed or released like any other.
    return None if task.cancelled() else task.result()


async def cancel_until_done(task: asyncio.Future[Any]) -> None:
    """Cancel `task` unless it is done, and wait until it is (cancelled, or finished anyway)."""
    while not task.done():
        # Python 3.11's wait_for (nats-py waits on every request and connect with it) drops a
        # cancellation that coincides with what it waits for: cancel until it takes.
        task.cancel()
        await asyncio.wait([task], timeout=_CANCEL_AGAIN_S)
