"""`tests.eventually.until`, the tests' one polling helper: sync and async conditions, its
bound, its guard and its context."""

from __future__ import annotations

import pytest

from tests.eventually import until


async def test_a_sync_condition_is_checked_until_it_holds() -> None:
    checks = iter([False, False, True])
    assert await until(lambda: next(checks), "the third check", every=0) >= 0


async def test_an_async_condition_is_awaited() -> None:
    answers = iter([False, True])

    async def read() -> bool:
        return next(answers)

    await until(read, "the second read", every=0)


async def test_a_condition_that_never_holds_fails_with_what_and_the_context() -> None:
    with pytest.raises(AssertionError, match=r"not within 0s: the impossible\nlast read: 7"):
        await until(lambda: False, "the impossible", within=0, context=lambda: "last read: 7")


async def test_a_failing_guard_ends_the_wait_at_once() -> None:
    def dead() -> None:
        raise AssertionError("the child died")

    with pytest.raises(AssertionError, match="the child died"):
        await until(lambda: False, "anything", guard=dead)
