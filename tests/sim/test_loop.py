"""`worker.sim.loop`: the simulation's event loop. One seed gives one trace; the seed orders
timers that tie and nothing asyncio orders itself; virtual time jumps; a loop that can never
make progress says so; errors are kept; and asyncio's own machinery (Runner, wait_for, timeout,
to_thread, open_connection) runs on it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.worker.sim.loop import SimLoop, SimStalled, run


async def workload() -> list[str]:
    """Several tasks that tie on deadlines, share a bounded queue and a lock, time out waiting,
    and are cancelled: what they did, in the order they did it."""
    loop = asyncio.get_running_loop()
    log: list[str] = []
    queue: asyncio.Queue[int] = asyncio.Queue(maxsize=2)
    lock = asyncio.Lock()

    async def producer(name: str) -> None:
        for item in range(4):
            await asyncio.sleep(1)  # both producers wake at the same instants
            await queue.put(item)
            log.append(f"{name} put {item} at {loop.time()}")

    async def consumer() -> None:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=1.5)
            except TimeoutError:
                log.append(f"consumer timed out at {loop.time()}")
                return
            async with lock:
                await asyncio.sleep(0.25)
                log.append(f"consumer took {item} at {loop.time()}")

    async def locker(name: str) -> None:
        for _ in range(3):
            async with lock:
                log.append(f"{name} holds the lock at {loop.time()}")
                await asyncio.sleep(0.5)

    async def doomed() -> None:
        try:
            await asyncio.sleep(100)
        except asyncio.CancelledError:
            log.append(f"doomed cancelled at {loop.time()}")
            raise

    workers = [
        asyncio.create_task(producer("a")),
        asyncio.create_task(producer("b")),
        asyncio.create_task(consumer()),
        asyncio.create_task(locker("x")),
        asyncio.create_task(locker("y")),
    ]
    victim = asyncio.create_task(doomed())
    await asyncio.sleep(2)
    victim.cancel()
    await asyncio.gather(*workers)
    return log


def test_one_seed_gives_one_trace_and_one_outcome() -> None:
    first = run(workload, 11, keep_trace=True)
    second = run(workload, 11, keep_trace=True)
    assert first.loop.trace_hash() == second.loop.trace_hash()
    assert first.loop.trace_lines() == second.loop.trace_lines()
    assert first.result == second.result
    assert first.loop.steps == second.loop.steps == len(first.loop.trace_lines())
    assert "doomed cancelled at 2.0" in first.result
    assert any("consumer timed out" in line for line in first.result)


def test_the_seed_changes_how_the_workload_interleaves() -> None:
    outcomes = {tuple(run(workload, seed).result) for seed in range(8)}
    hashes = {run(workload, seed).loop.trace_hash() for seed in range(8)}
    assert len(outcomes) > 1
    assert len(hashes) > 1


def tie_order(seed: int) -> list[int]:
    """The order in which six timers set for the same instant fire."""
    loop = SimLoop(seed)
    fired: list[int] = []
    for timer in range(6):
        loop.call_at(1.0, fired.append, timer)
    loop.call_at(2.0, loop.stop)
    loop.run_forever()
    loop.close()
    return fired


def test_the_seed_orders_timers_that_fall_due_together() -> None:
    orders = [tie_order(seed) for seed in range(10)]
    assert all(sorted(order) == list(range(6)) for order in orders)
    assert len({tuple(order) for order in orders}) > 1
    assert any(order != list(range(6)) for order in orders)  # not insertion order
    assert tie_order(3) == tie_order(3)


def test_call_soon_runs_in_registration_order_whatever_the_seed() -> None:
    for seed in range(10):
        loop = SimLoop(seed)
        ran: list[str] = []
        loop.call_at(0.0, ran.append, "timer due now")  # joins after what is ready already
        for callback in range(5):
            loop.call_soon(ran.append, f"soon {callback}")
        loop.call_soon(loop.call_soon, ran.append, "scheduled by a callback")
        loop.call_later(1, loop.stop)
        loop.run_forever()
        loop.close()
        assert ran == [
            *(f"soon {callback}" for callback in range(5)),
            "timer due now",
            "scheduled by a callback",
        ]


def test_an_hour_of_sleep_is_an_instant_of_virtual_time() -> None:
    loop = SimLoop(0, keep_trace=True)
    loop.run_until_complete(asyncio.sleep(3600))
    assert loop.time() == 3600.0
    # Four callbacks, no polling: the task's start, the timer, the task's wakeup, the stop.
    assert loop.trace_lines() == [
        "0 run task sleep",
        "3600000000000 run _set_result_unless_cancelled",
        "3600000000000 run task sleep",
        "3600000000000 run _stop_when_done",
    ]
    loop.close()


def test_wait_for_and_timeout_raise_at_the_virtual_instant_they_were_given() -> None:
    async def waits() -> list[float]:
        loop = asyncio.get_running_loop()
        raised_at: list[float] = []
        await asyncio.sleep(0.25)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 1.5)
        raised_at.append(loop.time())
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(2):
                await asyncio.Event().wait()
        raised_at.append(loop.time())
        return raised_at

    assert run(waits, 5).result == [1.75, 3.75]


def test_timers_fire_late_by_at_most_the_jitter_and_never_early() -> None:
    loop = SimLoop(9, timer_jitter_s=0.01)
    fired: list[tuple[float, float]] = []

    def record(when: float) -> None:
        fired.append((when, loop.time()))

    for step in range(50):
        loop.call_at(step * 0.1, record, step * 0.1)
    loop.call_at(10.0, loop.stop)
    loop.run_forever()
    loop.close()
    assert len(fired) == 50
    assert all(0 <= at - when <= 0.01 + 1e-9 for when, at in fired)
    assert any(at > when for when, at in fired)
    assert [at for _, at in fired] == sorted(at for _, at in fired)


def test_a_future_nobody_completes_stalls_the_loop_instead_of_hanging() -> None:
    loop = SimLoop(4)

    async def waits_forever() -> None:
        await loop.create_future()

    with pytest.raises(SimStalled, match=r"waits for .*waits_forever.*nothing is ready"):
        loop.run_until_complete(waits_forever())
    loop.finish()
    assert loop.is_closed()


def test_only_cancelled_timers_left_is_a_stall_and_they_never_fire() -> None:
    loop = SimLoop(2)
    fired: list[int] = []
    survivors = [when for when in range(1, 301) if when % 7 == 0]
    last = loop.create_future()
    for when in range(1, 301):
        timer = loop.call_at(when, fired.append, when)
        if when not in survivors:
            timer.cancel()
    loop.call_at(survivors[-1], last.set_result, None)
    loop.run_until_complete(last)
    assert fired == survivors
    assert loop.time() == survivors[-1]
    with pytest.raises(SimStalled, match="run_forever waits for stop"):
        loop.run_forever()
    assert loop.time() == survivors[-1]  # the cancelled timers after it moved no clock
    loop.close()


def test_callback_errors_are_kept_on_the_loop_and_reach_the_handler() -> None:
    loop = SimLoop(1)
    handled: list[dict[str, Any]] = []

    def boom() -> None:
        raise ValueError("boom")

    loop.call_soon(boom)
    loop.call_soon(loop.set_exception_handler, lambda _, context: handled.append(context))
    loop.call_soon(loop.call_soon, boom)
    loop.call_later(1, loop.stop)
    loop.run_forever()
    loop.close()
    assert [type(context["exception"]) for context in loop.errors] == [ValueError, ValueError]
    assert handled == loop.errors[1:]  # the first went to the default handler, which logs


def test_asyncio_runner_runs_on_the_loop_and_closes_it() -> None:
    closed: list[str] = []

    async def ticker() -> AsyncGenerator[int, None]:
        try:
            yield 1
            yield 2
        finally:
            closed.append("generator")

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            closed.append("task")

    async def main() -> float:
        leftover = asyncio.create_task(forever())  # the runner cancels it
        ticks = ticker()
        assert await anext(ticks) == 1  # left open: the runner closes it
        await asyncio.sleep(5)
        assert not leftover.done()
        return asyncio.get_running_loop().time()

    with asyncio.Runner(loop_factory=lambda: SimLoop(8)) as runner:
        assert runner.run(main()) == 5.0
        loop = runner.get_loop()
        assert isinstance(loop, SimLoop)
    assert loop.is_closed()
    assert not loop.is_running()
    assert sorted(closed) == ["generator", "task"]
    assert loop.errors == []
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()


def test_finish_cancels_leftover_tasks_in_the_order_they_were_created() -> None:
    async def main() -> list[int]:
        cancelled: list[int] = []

        async def idle(number: int) -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(number)
                raise

        idlers = [asyncio.create_task(idle(number)) for number in range(8)]
        await asyncio.sleep(1)
        assert not any(idler.done() for idler in idlers)
        return cancelled  # filled in by `finish`, after main returned

    for seed in range(5):
        assert run(main, seed).result == list(range(8))


def test_task_names_from_the_global_counter_stay_out_of_the_trace() -> None:
    async def named() -> str:
        task = asyncio.create_task(asyncio.sleep(1))
        await task
        return task.get_name()

    first = run(named, 3, keep_trace=True)
    other = SimLoop(0)
    other.run_until_complete(asyncio.sleep(0))  # a task in another loop moves the counter on
    other.close()
    second = run(named, 3, keep_trace=True)
    assert first.result != second.result
    assert first.loop.trace_hash() == second.loop.trace_hash()
    assert first.loop.trace_lines()[0].endswith(" run task " + named.__qualname__)
    assert not any("Task-" in line or "0x" in line for line in first.loop.trace_lines())


def test_executors_run_inline_on_the_loop_thread() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        here = threading.get_ident()
        called: list[int] = []
        future = loop.run_in_executor(None, called.append, here)
        assert future.done()
        assert called == [here]
        await future
        with ThreadPoolExecutor(max_workers=1) as pool:
            assert await loop.run_in_executor(pool, pow, 2, 10) == 1024
        assert await asyncio.to_thread(threading.get_ident) == here
        with pytest.raises(ZeroDivisionError):
            await loop.run_in_executor(None, divmod, 1, 0)

    finished = run(main, 0, keep_trace=True)
    inline = [line for line in finished.loop.trace_lines() if " inline " in line]
    assert inline == [
        "0 inline list.append",
        "0 inline pow",
        "0 inline get_ident",
        "0 inline divmod",
    ]


def test_call_soon_threadsafe_from_another_thread_is_refused() -> None:
    loop = SimLoop(0)
    refused: list[RuntimeError] = []

    def elsewhere() -> None:
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError as exc:
            refused.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert len(refused) == 1
    assert "another thread" in str(refused[0])
    loop.call_soon_threadsafe(loop.stop)  # from its own thread it is call_soon
    loop.run_forever()
    loop.close()


class Recorded(asyncio.Transport):
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


def test_open_connection_goes_through_the_connector() -> None:
    dialled: list[tuple[str, int]] = []
    transports: list[Recorded] = []

    async def connect(
        factory: Callable[[], asyncio.BaseProtocol], host: str, port: int
    ) -> tuple[asyncio.BaseTransport, asyncio.BaseProtocol]:
        dialled.append((host, port))
        protocol, transport = factory(), Recorded()
        transports.append(transport)
        protocol.connection_made(transport)
        assert isinstance(protocol, asyncio.Protocol)
        protocol.data_received(b"INFO {}\r\n")
        return transport, protocol

    async def client() -> bytes:
        reader, writer = await asyncio.open_connection("nats.sim", 4222, limit=1024)
        greeting = await reader.readline()
        writer.write(b"PING\r\n")
        writer.close()
        return greeting

    assert run(client, 0, connect=connect).result == b"INFO {}\r\n"
    assert dialled == [("nats.sim", 4222)]
    assert bytes(transports[0].written) == b"PING\r\n"
    assert transports[0].closing


def test_without_a_connector_connections_are_refused_and_sockets_unsupported() -> None:
    async def dial() -> None:
        await asyncio.open_connection("nats.sim", 4222)

    with pytest.raises(ConnectionRefusedError, match=r"nats.sim:4222 refused.*connector"):
        run(dial, 0)
    loop = SimLoop(0)
    with pytest.raises(NotImplementedError, match=r"SimLoop.add_reader .*no sockets"):
        loop.add_reader(0, print)
    loop.close()


def test_notes_join_the_trace_and_the_lines_are_kept_only_when_asked() -> None:
    loop = SimLoop(0, keep_trace=True)
    loop.call_later(1.5, loop.note, "a -> b PING")
    loop.call_later(2, loop.stop)
    loop.run_forever()
    loop.close()
    assert "1500000000 note a -> b PING" in loop.trace_lines()
    with pytest.raises(ValueError, match="line break"):
        loop.note("two\nlines")
    with pytest.raises(RuntimeError, match="keep_trace"):
        SimLoop(0).trace_lines()


# A program for the property: tasks, each a list of steps over one shared event and lock.
Step = tuple[str, float]
steps = st.tuples(st.sampled_from(["sleep", "wait", "set", "locked"]), st.sampled_from([0, 0.5, 1]))
programs = st.lists(st.lists(steps, max_size=6), min_size=1, max_size=5)


def program_main(program: list[list[Step]]) -> Callable[[], Any]:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        log: list[str] = []
        event = asyncio.Event()
        lock = asyncio.Lock()

        async def actor(number: int, todo: list[Step]) -> None:
            for kind, seconds in todo:
                if kind == "sleep":
                    await asyncio.sleep(seconds)
                elif kind == "wait":
                    try:
                        await asyncio.wait_for(event.wait(), seconds)
                    except TimeoutError:
                        log.append(f"{number} gave up at {loop.time()}")
                elif kind == "set":
                    event.set()
                else:
                    async with lock:
                        await asyncio.sleep(seconds)
                log.append(f"{number} {kind} {seconds} done at {loop.time()}")

        await asyncio.gather(*(actor(number, todo) for number, todo in enumerate(program)))
        return log

    return main


@settings(max_examples=60, deadline=None)
@given(programs, st.integers(0, 2**32), st.sampled_from([0.0, 0.2]))
def test_any_small_program_runs_the_same_twice_from_one_seed(
    program: list[list[Step]], seed: int, jitter: float
) -> None:
    first = run(program_main(program), seed, keep_trace=True, timer_jitter_s=jitter)
    second = run(program_main(program), seed, keep_trace=True, timer_jitter_s=jitter)
    assert first.loop.trace_lines() == second.loop.trace_lines()
    assert first.loop.trace_hash() == second.loop.trace_hash()
    assert first.result == second.result
