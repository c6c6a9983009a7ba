"""Waiting in a test for state that nothing announces: `until`, the one polling helper.

Much of what these tests wait for lives in another process or on the server: a consumer's
acknowledgement floor, a child's log file, a bucket's keys, a metric. None of it can notify the
test, so the test asks again until it holds, within a bound. `until` is that loop, written once:
the condition decides when the wait ends, and the pause between two checks is only a pause (it
orders nothing, so a slow machine makes a test slower, never wrong). It pauses on the event loop,
so the tasks under test (a bus's reader, an engine, a frontend) run meanwhile.

The condition may be a plain function or a coroutine function (a read over the bus, of a
child's file through a thread). `guard` runs before each check and may fail the wait at once (a
watched child died: waiting the whole bound would only hide why). `context` adds what to print
when the wait fails (a child's logs, the last state read).

Where the state can announce itself (an `asyncio.Event`, a condition variable, a watch), wait on
that instead: tests/worker/scripted_engine.py's `until` waits on the messages it sees.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

WITHIN_S = 30.0  # the default bound: generous, since every wait here is on another process
EVERY_S = 0.05  # the default pause between two checks

Condition = Callable[[], bool | Awaitable[bool]]


async def until(
    condition: Condition,
    what: str,
    *,
    within: float = WITHIN_S,
    every: float = EVERY_S,
    guard: Callable[[], None] | None = None,
    context: Callable[[], object] | None = None,
) -> float:
    """Return once `condition()` holds (awaited if it returns an awaitable), with how long that
    took; fail with `what` (and `context()`) if it does not within `within` seconds, or at once
    if `guard()` fails."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        if guard is not None:
            guard()
        held = condition()
        if await held if inspect.isawaitable(held) else held:
            return loop.time() - started
        if loop.time() - started >= within:
            more = "" if context is None else f"\n{context()}"
            raise AssertionError(f"not within {within:g}s: {what}{more}")
        await asyncio.sleep(every)  # the pause between two checks, not a synchronisation


def still_running(task: asyncio.Future[Any]) -> Callable[[], None]:
    """A `guard`: fail at once if `task` (the code under test, run beside the wait) ended."""

    def guard() -> None:
        assert not task.done(), task

    return guard
