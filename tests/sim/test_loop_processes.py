"""`SimLoop.crash`, `pause` and `resume`: a simulated process (the `Ambient` its tasks run under)
stops between two callbacks; crashed, nothing of it ever runs again, not even its `finally`
blocks when the run ends; paused, its callbacks wait and run at resume in the order they became
ready; the other processes and the machine's callbacks go on; one seed still gives one trace."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import random
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

from kvhandoff.worker import ambient
from kvhandoff.worker.sim.loop import SimLoop, SimStalled, run
from kvhandoff.worker.sim.network import Network
from kvhandoff.worker.sim.process import SimProcess


def sim_loop() -> SimLoop:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, SimLoop)
    return loop


def context_of(process: SimProcess) -> contextvars.Context:
    """A context whose code runs as `process`."""
    with ambient.using(process):
        return contextvars.copy_context()


def start(process: SimProcess, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """A task of `process`, created as the simulation would: inside `ambient.using`."""
    with ambient.using(process):
        return asyncio.create_task(coro)


async def tick(name: str, first_s: float, ticks: list[tuple[str, float]], ended: list[str]) -> None:
    """Tick every second from `first_s` on, forever; say so if ever ended."""
    loop = asyncio.get_running_loop()
    try:
        await asyncio.sleep(first_s)
        while True:
            ticks.append((name, loop.time()))
            await asyncio.sleep(1)
    finally:
        ended.append(name)


def test_in_context_reads_the_process_a_context_runs_as() -> None:
    a = SimProcess("a", random.Random(1))
    assert ambient.in_context(contextvars.copy_context()) is None
    assert ambient.in_context(context_of(a)) is a


def test_a_crashed_process_never_runs_again_not_even_its_finally_at_finish() -> None:
    a, b = SimProcess("a", random.Random(1)), SimProcess("b", random.Random(2))
    ticks: list[tuple[str, float]] = []
    ended: list[str] = []

    async def main() -> asyncio.Task[None]:
        victim = start(a, tick("a", 1.0, ticks, ended))
        start(b, tick("b", 1.5, ticks, ended))
        await asyncio.sleep(3.25)
        sim_loop().crash(a)
        await asyncio.sleep(3)
        assert ended == []
        return victim

    finished = run(main, 5, keep_trace=True)
    assert [time for name, time in ticks if name == "a"] == [1.0, 2.0, 3.0]
    assert [time for name, time in ticks if name == "b"] == [1.5, 2.5, 3.5, 4.5, 5.5]
    assert ended == ["b"]  # finish cancelled b's task, and left a's pending
    assert not finished.result.done()
    lines = finished.loop.trace_lines()
    assert "3250000000 note crash a" in lines
    # Its timer due at 4.0 was dropped uncounted: every step is a run line, and the only runs
    # at 4.0 are none.
    assert finished.loop.steps == sum(" run " in line for line in lines)
    assert not any(line.startswith("4000000000 run") for line in lines)
    assert finished.loop.errors == []


def test_a_paused_process_runs_its_held_ticks_at_resume_in_order_none_lost_none_early() -> None:
    a, b = SimProcess("a", random.Random(1)), SimProcess("b", random.Random(2))
    ticks: list[tuple[str, float]] = []
    ended: list[str] = []

    async def main() -> None:
        loop = sim_loop()
        for name, first_s in (("a1", 1.0), ("a2", 1.25), ("a3", 1.75)):
            start(a, tick(name, first_s, ticks, ended))
        start(b, tick("b", 0.6, ticks, ended))
        await asyncio.sleep(2.5)
        loop.pause(a)
        await asyncio.sleep(3)
        loop.resume(a)
        await asyncio.sleep(0.5)

    run(main, 5)
    assert [(name, time) for name, time in ticks if name != "b"] == [
        ("a1", 1.0),
        ("a2", 1.25),
        ("a3", 1.75),
        ("a1", 2.0),
        ("a2", 2.25),
        # Due at 2.75, 3.0 and 3.25 while paused: held in that order, run at the resume.
        ("a3", 5.5),
        ("a1", 5.5),
        ("a2", 5.5),
    ]
    assert [time for name, time in ticks if name == "b"] == [0.6, 1.6, 2.6, 3.6, 4.6, 5.6]
    assert sorted(ended) == ["a1", "a2", "a3", "b"]  # resumed, a is cancelled at finish


def mark(log: list[tuple[str, float]], label: str) -> None:
    log.append((label, asyncio.get_running_loop().time()))


def test_held_callbacks_run_at_resume_in_the_order_they_became_ready() -> None:
    a, b = SimProcess("a", random.Random(1)), SimProcess("b", random.Random(2))
    log: list[tuple[str, float]] = []

    async def main() -> None:
        loop = sim_loop()
        as_a, as_b = context_of(a), context_of(b)
        loop.pause(a)
        for number in range(3):
            loop.call_soon(mark, log, f"a soon {number}", context=as_a)
            loop.call_soon(mark, log, f"b soon {number}", context=as_b)
        for delay_s in (2.0, 1.0, 3.0):
            loop.call_later(delay_s, mark, log, f"a timer {delay_s}", context=as_a)
        loop.call_later(1.5, mark, log, "b timer", context=as_b)
        await asyncio.sleep(5)
        # Queued while a is still paused, not yet come up when it resumes: it became ready
        # after everything a held, and b's before it.
        loop.call_soon(mark, log, "b before resume", context=as_b)
        loop.call_soon(mark, log, "a queued before resume", context=as_a)
        loop.resume(a)
        loop.call_soon(mark, log, "a after resume", context=as_a)
        await asyncio.sleep(1)

    finished = run(main, 5, keep_trace=True)
    assert log == [
        ("b soon 0", 0.0),
        ("b soon 1", 0.0),
        ("b soon 2", 0.0),
        ("b timer", 1.5),
        ("b before resume", 5.0),
        ("a soon 0", 5.0),
        ("a soon 1", 5.0),
        ("a soon 2", 5.0),
        ("a timer 1.0", 5.0),
        ("a timer 2.0", 5.0),
        ("a timer 3.0", 5.0),
        ("a queued before resume", 5.0),
        ("a after resume", 5.0),
    ]
    lines = finished.loop.trace_lines()
    resumed = lines.index("5000000000 note resume a")
    assert lines[resumed + 1 : resumed + 10] == [f"5000000000 run {mark.__qualname__}"] * 9


def test_a_crashed_task_woken_by_another_process_never_wakes() -> None:
    a, b = SimProcess("a", random.Random(1)), SimProcess("b", random.Random(2))
    log: list[str] = []

    async def wait(signal: asyncio.Future[str]) -> None:
        try:
            log.append(f"a woke: {await signal}")
        finally:
            log.append("a finally")

    async def complete(signal: asyncio.Future[str]) -> None:
        await asyncio.sleep(2)
        signal.set_result("go")
        log.append("b completed")
        await asyncio.sleep(1)
        log.append("b went on")

    async def main() -> asyncio.Task[None]:
        loop = sim_loop()
        signal: asyncio.Future[str] = loop.create_future()
        waiter = start(a, wait(signal))
        completer = start(b, complete(signal))
        await asyncio.sleep(1)
        loop.crash(a)
        await completer
        return waiter

    finished = run(main, 5)
    assert log == ["b completed", "b went on"]
    assert not finished.result.done()


def test_a_timer_due_while_paused_runs_at_resume_and_a_crash_drops_what_was_held() -> None:
    a = SimProcess("a", random.Random(1))
    log: list[tuple[str, float]] = []

    async def main() -> None:
        loop = sim_loop()
        as_a = context_of(a)
        loop.call_later(1, mark, log, "a timer", context=as_a)
        loop.pause(a)
        await asyncio.sleep(4)
        loop.resume(a)
        await asyncio.sleep(0.5)
        loop.call_later(1, mark, log, "a held, then killed", context=as_a)
        loop.pause(a)
        await asyncio.sleep(2)
        loop.crash(a)
        loop.call_soon(mark, log, "a after the crash", context=as_a)
        await asyncio.sleep(1)

    run(main, 5)
    assert log == [("a timer", 4.0)]


async def workload() -> None:
    """Three processes of two ticking tasks each, tied to the instant: one paused a while, one
    crashed; what ticked when is noted in the trace."""
    loop = sim_loop()
    processes = [SimProcess(f"w{n}", random.Random(n)) for n in range(3)]
    ticks: list[tuple[str, float]] = []
    ended: list[str] = []
    for process in processes:
        for task in range(2):
            start(process, tick(f"{process.name}.{task}", 0.1 * task, ticks, ended))
    await asyncio.sleep(2.3)
    loop.pause(processes[0])
    loop.crash(processes[1])
    await asyncio.sleep(1.9)
    loop.resume(processes[0])
    await asyncio.sleep(1.4)
    loop.note(" ".join(f"{name}@{time:.6f}" for name, time in ticks))


def test_one_seed_gives_one_trace_with_crashes_and_pauses() -> None:
    first = run(workload, 13, keep_trace=True, timer_jitter_s=0.05)
    second = run(workload, 13, keep_trace=True, timer_jitter_s=0.05)
    assert first.loop.trace_lines() == second.loop.trace_lines()
    assert first.loop.trace_hash() == second.loop.trace_hash()
    notes = [line.split(" ", 2)[2] for line in first.loop.trace_lines() if " note " in line]
    assert notes[:3] == ["pause w0", "crash w1", "resume w0"]
    assert first.loop.steps == sum(" run " in line for line in first.loop.trace_lines())


def test_crashed_tasks_waiting_forever_are_no_stall_but_waiting_on_them_is() -> None:
    a = SimProcess("a", random.Random(1))
    ended: list[str] = []

    async def wait_forever() -> None:
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            ended.append("a")

    async def supervise(task: asyncio.Task[None]) -> None:
        try:
            await task
        finally:
            ended.append("supervisor")

    async def main() -> asyncio.Task[None]:
        victim = start(a, wait_forever())
        supervisor = asyncio.create_task(supervise(victim))
        await asyncio.sleep(1)
        sim_loop().crash(a)
        await asyncio.sleep(1)
        return supervisor

    finished = run(main, 5, keep_trace=True)
    # The supervisor was cancelled, and its cancellation went to a's task, which never runs.
    assert ended == []
    assert not finished.result.done()
    assert "2000000000 note finish leaves 1 tasks waiting on stopped processes" in (
        finished.loop.trace_lines()
    )

    async def wait_on_crashed() -> None:
        victim = start(a, wait_forever())
        await asyncio.sleep(1)
        sim_loop().crash(a)
        await victim

    with pytest.raises(SimStalled, match=r"Tasks of stopped processes: .* of a, crashed"):
        run(wait_on_crashed, 5)


def test_finish_leaves_a_stopped_process_async_generators_open_and_its_tasks_pending() -> None:
    crashed, paused = SimProcess("c", random.Random(1)), SimProcess("p", random.Random(2))
    ended: list[str] = []

    async def numbers(name: str) -> AsyncIterator[int]:
        try:
            for number in itertools.count():
                yield number
        finally:
            ended.append(f"{name} generator")

    async def count(name: str) -> None:
        try:
            async for _ in numbers(name):  # each generator waits at its yield
                await asyncio.sleep(1)
        finally:
            ended.append(f"{name} task")

    async def main() -> None:
        loop = sim_loop()
        start(crashed, count("c"))
        start(paused, count("p"))
        await asyncio.sleep(2.5)
        loop.crash(crashed)
        loop.pause(paused)
        await asyncio.sleep(2)

    finished = run(main, 5)
    assert ended == []
    assert finished.loop.errors == []


def test_a_task_crashed_before_its_first_step_never_runs_and_is_closed_unstarted() -> None:
    a = SimProcess("a", random.Random(1))
    ran: list[str] = []

    async def never() -> None:
        ran.append("a")

    async def main() -> asyncio.Task[None]:
        stillborn = start(a, never())
        sim_loop().crash(a)
        await asyncio.sleep(1)
        return stillborn

    finished = run(main, 5)
    assert ran == []
    assert not finished.result.done()
    # Closed by finish, which runs nothing of a coroutine never started, so that collecting it
    # later warns of no coroutine "never awaited".
    coro = finished.result.get_coro()
    assert inspect.iscoroutine(coro)
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED


def test_a_crash_stops_no_delivery_to_another_process_and_no_server_work() -> None:
    a, b = SimProcess("a", random.Random(1)), SimProcess("b", random.Random(2))
    network = Network(random.Random(3), origin=ambient.host)
    ends: list[asyncio.Transport] = []

    class Broadcast(asyncio.Protocol):
        """What one client sends, every client receives; a dies as its bytes arrive."""

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            ends.append(transport)

        def data_received(self, data: bytes) -> None:
            for end in ends:
                end.write(data)
            if data == b"a;":
                sim_loop().crash(a)

    network.listen("server", 1, Broadcast)
    received: dict[str, list[bytes]] = {"a": [], "b": []}

    async def listen(name: str, says: bytes) -> None:
        reader, writer = await asyncio.open_connection("server", 1)
        try:
            writer.write(says)
            while chunk := await reader.read(100):
                received[name].append(chunk)
        finally:
            writer.close()

    async def main() -> None:
        start(b, listen("b", b""))
        await asyncio.sleep(0.1)
        start(a, listen("a", b"a;"))
        await asyncio.sleep(0.1)
        for end in ends:
            end.write(b"server;")
        await asyncio.sleep(0.1)
        network.down("a")  # the world's half of a crash: a's connection dies

    run(main, 5, connect=network.create_connection)
    # The bytes a sent, delivered to b while a's crash was under way, and the server's own after
    # it, reach b; a's reader is fed too, but a's task never runs to read it.
    assert received == {"a": [], "b": [b"a;", b"server;"]}


def test_a_stop_that_makes_no_sense_is_refused_and_changes_nothing() -> None:
    a = SimProcess("a", random.Random(1))
    log: list[tuple[str, float]] = []

    async def main() -> None:
        loop = sim_loop()
        with pytest.raises(RuntimeError, match="resume of a refused: it is running"):
            loop.resume(a)
        loop.pause(a)
        with pytest.raises(RuntimeError, match="pause of a refused: it is paused"):
            loop.pause(a)
        loop.resume(a)
        loop.call_soon(mark, log, "a ran", context=context_of(a))
        await asyncio.sleep(1)
        loop.crash(a)
        with pytest.raises(RuntimeError, match="crash of a refused: it has crashed already"):
            loop.crash(a)
        with pytest.raises(RuntimeError, match="pause of a refused: it is crashed"):
            loop.pause(a)
        with pytest.raises(RuntimeError, match="resume of a refused: it is crashed"):
            loop.resume(a)

    finished = run(main, 5, keep_trace=True)
    assert log == [("a ran", 0.0)]
    notes = [line.split(" ", 2)[2] for line in finished.loop.trace_lines() if " note " in line]
    assert notes == ["pause a", "resume a", "crash a"]
