"""The simulation's event loop: virtual time, one seed, no selector, no threads, and a trace.

Theory of operation. `SimLoop` is an `asyncio.AbstractEventLoop`, as the loop Temporal's Python
SDK runs each workflow on is: the tier's code and nats-py run on it unchanged, and everything
they schedule goes through it. It keeps a ready queue and a heap of timers and nothing else:

- *Virtual time.* `time()` starts at 0.0 and moves only when nothing is ready: it then jumps to
  the next timer. Callbacks take no virtual time, so `asyncio.sleep(3600)` returns at once. If
  nothing is ready and no timer is pending, nothing can ever happen again (there is no IO and no
  other thread to wake the loop), so a loop that still waits raises `SimStalled`, naming what it
  waited for, instead of hanging.
- *Iterations* are `BaseEventLoop._run_once`'s, less the selector: the timers due by now join
  the ready queue, then the callbacks ready at that moment run (not those they schedule: they
  run in the next iteration); `stop()` takes effect at the end of an iteration.
- *What the seed decides.* asyncio promises that `call_soon` callbacks run in the order they were
  registered, and code relies on it (a Future runs its done callbacks in the order they were
  added; a Task's step follows the wakeup that scheduled it), so the ready queue stays FIFO:
  shuffling it would test programs asyncio never runs. The seed decides instead what a real
  machine leaves to chance: the order of timers that fall due at the same instant (each draws
  its place among its ties when scheduled; insertion order plays no part), and, with
  `timer_jitter_s`, how late each timer fires (up to that much, never early, as real timers are
  late and never early). `loop.chance` (a `random.Random` from the seed) is the one source of
  randomness of a whole simulation: other parts derive their own,
  `random.Random(loop.chance.getrandbits(64))`. The loop draws its timers' chances from a stream
  it derived at construction, so how many timers a run sets does not shift anyone else's draws.
- *The trace.* Each callback run is a line, `<virtual ns> run <name>`; `note(text)` adds
  `<virtual ns> note <text>` (the network notes each message) and an executor call run inline
  adds `<virtual ns> inline <name>`. A name is stable from run to run and process to process:
  for a Task's step, its coroutine's `__qualname__` (not the task's name, which comes from a
  process-wide counter); for any other callback, its `__qualname__`; never an `id()` or an
  address. A running sha256 over the lines (`trace_hash()`) is what two runs of one seed
  compare; the lines themselves are kept only when asked (`keep_trace=True`).
- *Executors run inline.* `run_in_executor` calls the function at once on the loop's thread and
  returns a done future: deterministic, and `asyncio.to_thread` goes through it. On a slow disk
  (the calling process's `disk`, worker.sim.disk) it calls it later, a timer of the caller's.
- *Connections* come from the connector given at construction (`connect=`), which the simulated
  network supplies; nats-py's `asyncio.open_connection` reaches it through `create_connection`.
- *Errors.* What a callback raises reaches `call_exception_handler`, which keeps each context on
  `loop.errors` (so a simulation can fail its seed on them) before handing it to the handler.
- *Processes.* A simulated process is the `Ambient` its code runs under (`ambient.using`,
  worker/sim/process.py). Every callback runs in a context (`call_soon(context=)`, else a copy
  of the caller's); its process is the `Ambient` that context holds when it comes up to run
  (`ambient.in_context`), keyed by identity, or none for the machine's: the simulated servers,
  the network and the loop itself, which nothing stops. `crash(process)` is a SIGKILL: from the
  next callback on, none of the process's callbacks runs again, neither those ready, nor its
  timers, nor those scheduled later (the step of one of its tasks woken by a future another
  process completes is one: asyncio schedules a task's step in the task's context). Each is
  dropped as it comes up: not run, not counted, not traced. `pause(process)` is a SIGSTOP: its
  callbacks are held as they come up, in that order, while time goes on for everyone else;
  `resume(process)` puts them back in the ready queue ahead of any of the process's callbacks
  queued since, so they run in the order they became ready and before anything the process
  schedules afterwards. Each crash, pause and resume is a line of the trace
  (`note crash <name>`). When nothing stops, the check costs one truth test per callback;
  while some process is stopped, one context read and one dict lookup.
- *The loop stops a process's code; the network kills its connections.* What the network and
  the simulated servers run belongs to no process, so they must schedule it in a context of
  their own: a callback scheduled in the context current when some process wrote would be that
  process's, and its crash would stop a delivery to someone else, or a server's timer. Run so,
  the network still delivers bytes to a crashed process's stream reader, which only fills
  buffers and wakes futures whose waiters, the process's tasks, never run. A crash is thus
  `loop.crash(process)` and `Network.down(process.name)`, which resets its connections as the
  peer's kernel would; the world does both.
- *A crashed process's tasks* stay pending forever, and the loop keeps holding them as it holds
  every pending task: dropped, one would be collected whenever the garbage collector came by,
  and collecting a suspended coroutine closes it, which runs its `finally` blocks (what a
  SIGKILL never does) inside someone else's callback. `finish` cancels only the tasks of
  running processes: a process crashed or still paused when the run ends stays as it is (a
  machine switched off), its tasks pending, its async generators open; and a cancelled task
  that waits on such a process's task is left waiting too, instead of being a stall. Waiting in
  `run_until_complete` on what only a stopped process could give is still a stall.

Why `AbstractEventLoop` and not `BaseEventLoop`. BaseEventLoop's constructor, `run_forever`,
`close`, `call_soon_threadsafe`, `run_in_executor` and `create_connection` all assume a selector,
a self-pipe, a thread pool or sockets: overriding them leaves little of it, and whatever was
not overridden would keep doing real IO silently. From the abstract loop, every operation a
simulation cannot do (sockets, file descriptors, pipes, subprocesses, signals, name resolution,
servers) raises NotImplementedError saying why.

Invariants: time never goes back; a timer never fires before its `when`; two loops built with
the same seed and options and driven by the same program record the same trace; the ready
queue runs in registration order. One thing asyncio leaves unordered is ordered here too:
`finish` cancels leftover tasks in the order they were created (`asyncio.Runner` cancels them in
the iteration order of a set, by address), which is why `run` ends runs with it. The loop holds
every task until it is done (asyncio holds them weakly), so that no pending task disappears
whenever the garbage collector happens to run.

Limits. Time stands still while callbacks are ready, so a task that polls with `sleep(0)` until
a timer fires never lets it fire (a livelock; nothing in nats-py or the tier polls so). An async
generator dropped inside a reference cycle is finalized when the collector runs, as on any loop,
and that moment is not the seed's. Python offers no way to let go of a suspended coroutine
without running its `finally` blocks: when the loop itself is collected, so are the tasks of the
processes it left stopped, and their `finally` blocks run then, outside any run. A program that
runs many seeds in one interpreter should let go of each finished run and `gc.collect()` before
the next, so that this happens between runs and never inside another seed's.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
import heapq
import inspect
import logging
import random
import sys
import threading
import types
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Generator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Generic, NoReturn, TypeVar, TypeVarTuple, Unpack, cast

from kvhandoff.worker import ambient
from kvhandoff.worker.ambient import Ambient, in_context
from kvhandoff.worker.sim.disk import SimDisk

logger = logging.getLogger(__name__)

T = TypeVar("T")
_Ts = TypeVarTuple("_Ts")
_ProtocolT = TypeVar("_ProtocolT", bound=asyncio.BaseProtocol)

Connector = Callable[
    [Callable[[], asyncio.BaseProtocol], str, int],
    Awaitable[tuple[asyncio.BaseTransport, asyncio.BaseProtocol]],
]
"""Opens a simulated connection: builds the protocol with the factory, connects it to the
server at (host, port) and returns the transport and that protocol."""

ExceptionContext = dict[str, Any]

# BaseEventLoop's thresholds for rebuilding the timer heap without its cancelled timers.
_MIN_TIMERS_TO_COMPACT = 100
_MAX_CANCELLED_FRACTION = 0.5
# Fewer cancelled timers than this never call for a rebuild: the heap is below the minimum.
_MIN_CANCELLED = _MIN_TIMERS_TO_COMPACT * _MAX_CANCELLED_FRACTION
# Trace lines recorded before the running hash takes them in (`SimLoop._record`).
_LINES_HASHED_AT_ONCE = 1024
# Done tasks are dropped from the loop's register when it has doubled since the last time.
_MIN_TASKS_TO_PRUNE = 64


def _refuse(name: str, why: str) -> Any:  # Any: it stands in for methods of every signature
    def refuse(self: SimLoop, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"SimLoop.{name} is not supported: {why}")

    refuse.__name__ = refuse.__qualname__ = name
    return refuse


_NO_SOCKETS = "a simulation has no sockets or file descriptors (connections come from connect=)"
_NO_SERVERS = "simulated servers are reached through the connector, not a listening socket"
_NO_NAMES = "a simulation resolves no names: the connector is handed the host as given"
_NO_PROCESSES = "a simulation starts no process and has no pipes"
_NO_SIGNALS = "a simulation receives no signals"
_INLINE = "executors run inline, on the loop's thread"
_TASKS = "tasks are always asyncio.Task, so that the trace can name them by their coroutine"


class SimStalled(RuntimeError):
    """The loop waits for something, but nothing is ready and no timer is pending: nothing can
    ever happen again, so it never will."""


class _Timer(asyncio.TimerHandle):
    """A timer that knows whether it still waits in the heap: asyncio tells the loop of every
    cancellation, and only those of waiting timers count toward rebuilding the heap."""

    __slots__ = ("waiting",)
    waiting: bool


# A ready callback: the handle (which may be cancelled before it runs), what it calls, which
# names it in the trace, and the context it runs in, which says whose it is.
_Ready = tuple[asyncio.Handle, Callable[..., object], Sequence[Any], contextvars.Context]
# A waiting timer, by when it fires (its `when` plus its lateness), then its place among its
# ties drawn from the seed, then the order it was set in (so a comparison never reaches the
# handle).
_Waiting = tuple[float, int, int, _Timer, Callable[..., object], Sequence[Any], contextvars.Context]


class _Stopped:
    """A process the loop runs no more of: crashed for good, or paused and holding the callbacks
    that came up meanwhile. It holds the process, so that the `id` it is keyed by stays its."""

    __slots__ = ("held", "process")

    def __init__(self, process: Ambient, held: list[_Ready] | None) -> None:
        self.process = process
        self.held = held
        """The paused process's callbacks in the order they came up; None once it crashed."""

    @property
    def state(self) -> str:
        return "paused" if self.held is not None else "crashed"


def _name(process: Ambient) -> str:
    return str(getattr(process, "name", "?"))


class SimLoop(asyncio.AbstractEventLoop):
    """An event loop with virtual time whose every run of one seed is the same run."""

    def __init__(
        self,
        seed: int,
        *,
        keep_trace: bool = False,
        timer_jitter_s: float = 0.0,
        connect: Connector | None = None,
    ) -> None:
        if timer_jitter_s < 0:
            raise ValueError(f"timer_jitter_s={timer_jitter_s}: timers are late, never early")
        self.seed = seed
        self.chance = random.Random(seed)
        """The simulation's one source of randomness: derive from it, never around it."""
        self._timer_chance = random.Random(self.chance.getrandbits(64))
        self._timer_jitter_s = timer_jitter_s
        self._connect = connect
        self._now = 0.0
        self._ready: deque[_Ready] = deque()
        # How many callbacks at the head of `_ready` the current iteration still runs.
        self._batch = 0
        # The processes crashed or paused, by the `id` of their `Ambient`.
        self._stopped: dict[int, _Stopped] = {}
        self._buried = False
        self._timers: list[_Waiting] = []
        self._timers_set = 0
        self._cancelled_waiting = 0
        self._hash = hashlib.sha256()
        # Lines recorded and not hashed yet: the hash takes them a batch at a time, which is
        # the same sha256 as line by line, at a fraction of the calls.
        self._unhashed: list[str] = []
        self._stamp = "0 "  # how the trace's lines show `_now`, made once per instant
        self._lines: list[str] | None = [] if keep_trace else None
        self.steps = 0
        """How many callbacks have run."""
        self.errors: list[ExceptionContext] = []
        """Every context `call_exception_handler` was given, in order."""
        self._exception_handler: Callable[[asyncio.AbstractEventLoop, ExceptionContext], object]
        self._exception_handler = _default_handler
        self._debug = False
        self._running = False
        self._stopping = False
        self._closed = False
        self._thread = threading.get_ident()
        # The tasks not known to be done, by creation (dicts keep insertion order). Held, not
        # weakly referenced as asyncio holds them: a pending task nothing else reaches would
        # otherwise vanish whenever the garbage collector came by, and with it its part in the
        # run's end (`finish`), so the trace would depend on the collector's timing.
        # Each with the context it runs in, which says whose it is.
        self._tasks: dict[int, tuple[asyncio.Task[Any], contextvars.Context]] = {}
        self._tasks_created = 0
        self._tasks_pruned_at = _MIN_TASKS_TO_PRUNE
        # The async generators started and not finalized, by start, each with the process
        # that started it. Weakly referenced, as BaseEventLoop does: one dropped is finalized at
        # once (by reference counting) and closed by the task `_asyncgen_done` schedules, as on
        # a real loop.
        self._asyncgens: weakref.WeakKeyDictionary[AsyncGenerator[Any, Any], Ambient | None] = (
            weakref.WeakKeyDictionary()
        )
        self._asyncgens_shut_down = False
        self._awaited: asyncio.Future[Any] | None = None

    def __repr__(self) -> str:
        return (
            f"<SimLoop seed={self.seed} time={self._now} steps={self.steps} "
            f"running={self._running} closed={self._closed}>"
        )

    # The trace.

    def note(self, text: str) -> None:
        """Add a line to the trace at the current virtual time (one line: no line breaks)."""
        if "\n" in text or "\r" in text:
            raise ValueError(f"loop.note refused {text!r}: a trace line holds no line break")
        self._record(f"note {text}")

    def trace_hash(self) -> str:
        """The sha256 (hex) of the trace so far, each line ended by a newline."""
        self._hash_recorded()
        return self._hash.hexdigest()

    def trace_lines(self) -> list[str]:
        """The trace so far, if this loop keeps it (`keep_trace=True`)."""
        if self._lines is None:
            raise RuntimeError("this SimLoop keeps only the trace's hash: build it with keep_trace")
        self._hash_recorded()
        return list(self._lines)

    def _record(self, what: str) -> None:
        self._unhashed.append(self._stamp + what)
        if len(self._unhashed) >= _LINES_HASHED_AT_ONCE:
            self._hash_recorded()

    def _hash_recorded(self) -> None:
        """Hash the lines recorded since the last time (and keep them, if asked)."""
        lines = self._unhashed
        if not lines:
            return
        lines.append("")  # each line ends with a newline, the last one too
        self._hash.update("\n".join(lines).encode())
        lines.pop()
        if self._lines is not None:
            self._lines.extend(lines)
        lines.clear()

    # Processes.

    def crash(self, process: Ambient) -> None:
        """Kill `process` between two callbacks, for good (SIGKILL): none of its callbacks runs
        again, and nothing of it runs to end it. Killing a paused process drops what it held.
        Its connections are the network's to reset (`Network.down(name)`)."""
        stopped = self._stopped.get(id(process))
        if stopped is not None and stopped.held is None:
            raise RuntimeError(f"crash of {_name(process)} refused: it has crashed already")
        self._stopped[id(process)] = _Stopped(process, None)
        self.note(f"crash {_name(process)}")

    def pause(self, process: Ambient) -> None:
        """Stop `process` between two callbacks (SIGSTOP): hold its callbacks, in the order they
        come up, until `resume`."""
        stopped = self._stopped.get(id(process))
        if stopped is not None:
            raise RuntimeError(f"pause of {_name(process)} refused: it is {stopped.state}")
        self._stopped[id(process)] = _Stopped(process, [])
        self.note(f"pause {_name(process)}")

    def resume(self, process: Ambient) -> None:
        """Let a paused `process` go on (SIGCONT): what it held runs in the order it became
        ready, before any callback of the process queued since and all it schedules from now."""
        stopped = self._stopped.get(id(process))
        if stopped is None or stopped.held is None:
            state = "running" if stopped is None else stopped.state
            raise RuntimeError(f"resume of {_name(process)} refused: it is {state}, not paused")
        del self._stopped[id(process)]
        held = stopped.held
        ready = self._ready
        # The process's callbacks still queued became ready after all it held (each held one
        # came up first), so the held ones go just before the first of them.
        position = next(
            (at for at, entry in enumerate(ready) if in_context(entry[3]) is process), len(ready)
        )
        ready.rotate(-position)
        ready.extendleft(reversed(held))
        ready.rotate(position)
        if position < self._batch:  # they joined the current iteration's callbacks
            self._batch += len(held)
        self.note(f"resume {_name(process)}")

    def _stopped_in(self, context: contextvars.Context) -> _Stopped | None:
        """The stopped process whose code `context` runs, if it runs one's."""
        process = in_context(context)
        return None if process is None else self._stopped.get(id(process))

    # Running.

    def run_forever(self) -> None:
        """Run callbacks until `stop()`; raise `SimStalled` if none can ever come."""
        self._check_closed()
        if self._running:
            raise RuntimeError("this SimLoop is already running")
        if asyncio.events._get_running_loop() is not None:
            raise RuntimeError("cannot run a SimLoop while another loop is running")
        hooks = sys.get_asyncgen_hooks()
        sys.set_asyncgen_hooks(firstiter=self._asyncgen_firstiter, finalizer=self._asyncgen_done)
        asyncio.events._set_running_loop(self)
        self._running = True
        try:
            while True:
                self._run_once()
                if self._stopping:
                    break
        finally:
            self._stopping = False
            self._running = False
            asyncio.events._set_running_loop(None)
            sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=hooks.finalizer)

    def run_until_complete(self, future: Generator[Any, None, T] | Awaitable[T]) -> T:
        """Run until `future` (a coroutine is wrapped in a task) is done; return its result."""
        self._check_closed()
        new_task = not asyncio.isfuture(future)
        # The supertype's signature admits a generator; ensure_future refuses one itself, as
        # generator-based coroutines are gone in 3.11.
        awaited = asyncio.ensure_future(cast(Awaitable[T], future), loop=self)
        awaited.add_done_callback(_stop_when_done)
        self._awaited = awaited
        try:
            self.run_forever()
        except BaseException:
            if new_task and awaited.done() and not awaited.cancelled():
                awaited.exception()  # the caller cannot reach the task to retrieve it
            raise
        finally:
            awaited.remove_done_callback(_stop_when_done)
            self._awaited = None
        if not awaited.done():
            raise RuntimeError("the SimLoop stopped before the future it ran was done")
        return awaited.result()

    def stop(self) -> None:
        """Stop at the end of the current iteration."""
        self._stopping = True

    def is_running(self) -> bool:
        return self._running

    def is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop every pending callback and timer; the loop runs nothing more."""
        if self._running:
            raise RuntimeError("cannot close a running SimLoop")
        self._closed = True
        self._ready.clear()
        self._timers.clear()

    def finish(self) -> None:
        """End a run as `asyncio.Runner` does, in an order of the loop's own: cancel the tasks
        still pending in the order they were created and wait for them, close the async
        generators still open in the order they started, then close the loop.

        A process crashed or paused is left as it is: its tasks are neither cancelled nor
        closed and its generators stay open, so none of its `finally` blocks runs; a cancelled
        task that waits on one of its tasks is left waiting (the trace notes how many). The
        loop goes on holding all of them (see the module's docstring)."""
        if self._closed:
            return
        try:
            leftovers = [
                task
                for task, context in self._tasks.values()
                if not task.done() and self._stopped_in(context) is None
            ]
            for task in leftovers:
                task.cancel()
            if leftovers:
                try:
                    self.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
                except SimStalled:
                    if not self._stopped:
                        raise
                    stuck = sum(not task.done() for task in leftovers)
                    self.note(f"finish leaves {stuck} tasks waiting on stopped processes")
            for task in leftovers:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    self.call_exception_handler(
                        {
                            "message": "unhandled exception while the simulation ended",
                            "exception": task.exception(),
                            "task": task,
                        }
                    )
            self.run_until_complete(self.shutdown_asyncgens())
            for task, _ in self._tasks.values():
                if not task.done():
                    _abandon(task)
        finally:
            self.close()

    def bury(self) -> None:
        """Close the coroutines of the tasks a finished run still holds (a crashed or paused
        process's), suppressing whatever their `finally` blocks raise on a closed loop.

        Python runs a suspended coroutine's `finally` blocks when it lets go of it: left to the
        garbage collector, that would happen at a moment of its choosing, perhaps in the next
        seed's run, with errors reported as unraisable. A run buries its dead once it has read
        what it wanted from them (its checks), so that none of their code runs any later."""
        if not self._closed:
            raise RuntimeError("bury the tasks of a finished run: this SimLoop is not closed")
        self._buried = True
        tasks, self._tasks = list(self._tasks.values()), {}
        for task, _ in tasks:
            coro = task.get_coro()
            if not task.done() and inspect.iscoroutine(coro):
                with contextlib.suppress(BaseException):
                    coro.close()

    def _run_once(self) -> None:
        timers = self._timers
        # (`_cancelled` is what `Handle.cancelled()` reads, without a call per callback.)
        if timers and (timers[0][3]._cancelled or self._cancelled_waiting > _MIN_CANCELLED):
            self._drop_cancelled_timers()
        if not self._ready and not self._stopping:
            if not self._timers:
                raise SimStalled(self._stall_report())
            if self._timers[0][0] > self._now:
                self._now = self._timers[0][0]
                self._stamp = f"{round(self._now * 1e9)} "
        while self._timers and self._timers[0][0] <= self._now:
            _, _, _, timer, callback, args, context = heapq.heappop(self._timers)
            timer.waiting = False
            if timer.cancelled():
                self._cancelled_waiting -= 1
            else:
                self._ready.append((timer, callback, args, context))
        ready = self._ready
        stopped = self._stopped
        unhashed = self._unhashed  # `_record`'s, inlined: one line per callback
        run = self._stamp + "run "
        self._batch = len(ready)
        while self._batch:
            self._batch -= 1
            entry = ready.popleft()
            handle, callback, args, context = entry
            if handle._cancelled:
                continue
            if stopped:
                process = in_context(context)
                if process is not None:
                    halted = stopped.get(id(process))
                    if halted is not None:
                        if halted.held is not None:
                            halted.held.append(entry)
                        continue
            self.steps += 1
            unhashed.append(run + _stable_name(callback, args))
            if len(unhashed) >= _LINES_HASHED_AT_ONCE:
                self._hash_recorded()
            handle._run()

    def _drop_cancelled_timers(self) -> None:
        timers = self._timers
        if (
            len(timers) > _MIN_TIMERS_TO_COMPACT
            and self._cancelled_waiting > len(timers) * _MAX_CANCELLED_FRACTION
        ):
            for entry in timers:
                entry[3].waiting = not entry[3].cancelled()
            self._timers = [entry for entry in timers if entry[3].waiting]
            heapq.heapify(self._timers)
            self._cancelled_waiting = 0
            return
        while timers and timers[0][3].cancelled():
            heapq.heappop(timers)[3].waiting = False
            self._cancelled_waiting -= 1

    def _stall_report(self) -> str:
        waiting = (
            f"run_until_complete waits for {self._awaited!r}"
            if self._awaited is not None
            else "run_forever waits for stop()"
        )
        others: list[str] = []
        stopped: list[str] = []
        for task, context in self._tasks.values():
            if task.done() or task is self._awaited:
                continue
            halted = self._stopped_in(context)
            if halted is None:
                others.append(repr(task))
            else:
                stopped.append(f"{task!r} of {_name(halted.process)}, {halted.state}")
        return (
            f"{waiting}, but at virtual time {self._now} s nothing is ready and no timer is "
            f"pending, so nothing can ever happen again (seed {self.seed}). Other tasks pending: "
            + ("; ".join(others) or "none")
            + ". Tasks of stopped processes: "
            + ("; ".join(stopped) or "none")
        )

    def _check_closed(self) -> None:
        if self._closed:
            raise RuntimeError("this SimLoop is closed")

    # Scheduling.

    def time(self) -> float:
        """Virtual seconds since the loop was built."""
        return self._now

    def call_soon(
        self,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        self._check_closed()
        if self._debug:
            _check_callback(callback, "call_soon")
        context = contextvars.copy_context() if context is None else context
        handle = asyncio.Handle(callback, args, self, context)
        self._ready.append((handle, callback, args, context))
        return handle

    def call_soon_threadsafe(
        self,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        """`call_soon`, from the thread that built the loop only: a simulation has no other."""
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                f"call_soon_threadsafe({_stable_name(callback, args)}) from another thread: "
                "a SimLoop runs on one thread, and a simulation starts no other"
            )
        return self.call_soon(callback, *args, context=context)

    def call_later(
        self,
        delay: float,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        return self.call_at(self._now + delay, callback, *args, context=context)

    def call_at(
        self,
        when: float,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        self._check_closed()
        if self._debug:
            _check_callback(callback, "call_at")
        context = contextvars.copy_context() if context is None else context
        timer = _Timer(when, callback, args, self, context)
        timer.waiting = True
        lateness = self._timer_chance.random() * self._timer_jitter_s if self._timer_jitter_s else 0
        place = self._timer_chance.getrandbits(64)
        self._timers_set += 1
        heapq.heappush(
            self._timers,
            (when + lateness, place, self._timers_set, timer, callback, args, context),
        )
        return timer

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        """asyncio's notice that a timer was cancelled (`TimerHandle.cancel`)."""
        if isinstance(handle, _Timer) and handle.waiting:
            self._cancelled_waiting += 1

    # Futures and tasks.

    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.Future(loop=self)

    def create_task(
        self,
        coro: Generator[Any, None, T] | Coroutine[Any, Any, T],
        *,
        name: str | None = None,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[T]:
        self._check_closed()
        context = contextvars.copy_context() if context is None else context
        task = asyncio.Task(coro, loop=self, name=name, context=context)
        self._tasks_created += 1
        self._tasks[self._tasks_created] = (task, context)
        if len(self._tasks) >= self._tasks_pruned_at:
            self._tasks = {
                number: kept for number, kept in self._tasks.items() if not kept[0].done()
            }
            self._tasks_pruned_at = max(_MIN_TASKS_TO_PRUNE, 2 * len(self._tasks))
        return task

    def run_in_executor(
        self, executor: Executor | None, func: Callable[[Unpack[_Ts]], T], *args: *_Ts
    ) -> asyncio.Future[T]:
        """Call `func(*args)` now, on the loop's thread, and return a future holding what it
        returned or raised. The executor is not used: a simulation starts no thread. On a slow
        disk (the calling process's, worker.sim.disk), the call runs later instead, after the
        disk's previous call, in the caller's context."""
        self._check_closed()
        future: asyncio.Future[T] = self.create_future()
        disk = getattr(ambient.current(), "disk", None)
        if not isinstance(disk, SimDisk):
            disk = None
        if disk is not None and disk.latency_s:
            at = disk.next_slot(self.time())
            self.call_at(at, self._run_inline, future, disk, func, *args)
        else:
            self._run_inline(future, disk, func, *args)
        return future

    def _run_inline(
        self,
        future: asyncio.Future[T],
        disk: SimDisk | None,
        func: Callable[[Unpack[_Ts]], T],
        *args: *_Ts,
    ) -> None:
        if disk is not None:
            disk.catch_up()
        self._record(f"inline {_stable_name(func, args)}")
        try:
            result = func(*args)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    async def shutdown_default_executor(self) -> None:
        """Nothing to shut down: executors run inline."""

    # Async generators, tracked as BaseEventLoop tracks them (its hooks), in the order they
    # started rather than in a set's.

    def _asyncgen_firstiter(self, agen: AsyncGenerator[Any, Any]) -> None:
        if self._asyncgens_shut_down:
            logger.warning("async generator %s started after shutdown_asyncgens", agen)
        self._asyncgens[agen] = in_context(contextvars.copy_context())

    def _asyncgen_done(self, agen: AsyncGenerator[Any, Any]) -> None:
        process = self._asyncgens.pop(agen, None)
        # A stopped process's generator is let go unclosed, as its process would leave it:
        # closing it would run its `finally` blocks.
        if self._closed or (process is not None and id(process) in self._stopped):
            return
        self.call_soon_threadsafe(self.create_task, agen.aclose())

    async def shutdown_asyncgens(self) -> None:
        """Close every async generator still open, in the order they started, but those of
        stopped processes: a crashed or paused process's code does not run."""
        self._asyncgens_shut_down = True
        closing = [
            agen
            for agen, process in self._asyncgens.items()
            if process is None or id(process) not in self._stopped
        ]
        self._asyncgens.clear()
        results = await asyncio.gather(*(agen.aclose() for agen in closing), return_exceptions=True)
        for result, agen in zip(results, closing, strict=True):
            if isinstance(result, Exception):
                self.call_exception_handler(
                    {
                        "message": f"closing the async generator {agen!r} failed",
                        "exception": result,
                        "asyncgen": agen,
                    }
                )

    # Connections.

    async def create_connection(
        self,
        protocol_factory: Callable[[], _ProtocolT],
        host: str | None = None,
        port: int | None = None,
        **options: Any,
    ) -> tuple[asyncio.Transport, _ProtocolT]:
        """A connection to (host, port) from the connector the loop was built with."""
        refused = sorted(name for name, value in options.items() if value is not None)
        if refused:
            raise NotImplementedError(
                f"SimLoop.create_connection to {host}:{port} cannot honour {', '.join(refused)}: "
                "a simulated connection is given only a host and a port"
            )
        if host is None or port is None:
            raise NotImplementedError(
                "SimLoop.create_connection needs a host and a port: it has no sockets to adopt"
            )
        if self._connect is None:
            raise ConnectionRefusedError(
                f"{host}:{port} refused: this SimLoop was built without a connector (connect=)"
            )
        transport, protocol = await self._connect(protocol_factory, host, port)
        # The connector built the protocol with this factory, so it is of the factory's type.
        return cast(asyncio.Transport, transport), cast(_ProtocolT, protocol)

    # Errors.

    def get_exception_handler(
        self,
    ) -> Callable[[asyncio.AbstractEventLoop, ExceptionContext], object] | None:
        return None if self._exception_handler is _default_handler else self._exception_handler

    def set_exception_handler(
        self, handler: Callable[[asyncio.AbstractEventLoop, ExceptionContext], object] | None
    ) -> None:
        if handler is not None and not callable(handler):
            raise TypeError(f"an exception handler must be callable or None, not {handler!r}")
        self._exception_handler = _default_handler if handler is None else handler

    def default_exception_handler(self, context: ExceptionContext) -> None:
        """Log the context: its message, its exception's traceback, and its other entries."""
        exception = context.get("exception")
        details = "".join(
            f"\n{key}: {value!r}"
            for key, value in sorted(context.items())
            if key not in {"message", "exception"}
        )
        logger.error(
            "%s%s",
            context.get("message", "unhandled exception in the simulation's event loop"),
            details,
            exc_info=(type(exception), exception, exception.__traceback__)
            if isinstance(exception, BaseException)
            else None,
        )

    def call_exception_handler(self, context: ExceptionContext) -> None:
        """Keep the context on `errors`, then hand it to the handler (by default: log it).
        Once buried, a run's errors are the garbage collector's findings among its dead (a
        future of a crashed process that failed and that nobody read): kept, not reported."""
        self.errors.append(context)
        if self._buried:
            return
        try:
            self._exception_handler(self, context)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self.default_exception_handler(
                {"message": "the exception handler failed", "exception": exc, "context": context}
            )

    # Debugging.

    def get_debug(self) -> bool:
        return self._debug

    def set_debug(self, enabled: bool) -> None:
        self._debug = enabled

    # What a simulation cannot do: each refuses, saying why.
    add_reader = _refuse("add_reader", _NO_SOCKETS)
    remove_reader = _refuse("remove_reader", _NO_SOCKETS)
    add_writer = _refuse("add_writer", _NO_SOCKETS)
    remove_writer = _refuse("remove_writer", _NO_SOCKETS)
    sock_recv = _refuse("sock_recv", _NO_SOCKETS)
    sock_recv_into = _refuse("sock_recv_into", _NO_SOCKETS)
    sock_recvfrom = _refuse("sock_recvfrom", _NO_SOCKETS)
    sock_recvfrom_into = _refuse("sock_recvfrom_into", _NO_SOCKETS)
    sock_sendall = _refuse("sock_sendall", _NO_SOCKETS)
    sock_sendto = _refuse("sock_sendto", _NO_SOCKETS)
    sock_connect = _refuse("sock_connect", _NO_SOCKETS)
    sock_accept = _refuse("sock_accept", _NO_SOCKETS)
    sock_sendfile = _refuse("sock_sendfile", _NO_SOCKETS)
    sendfile = _refuse("sendfile", _NO_SOCKETS)
    start_tls = _refuse("start_tls", _NO_SOCKETS)
    create_unix_connection = _refuse("create_unix_connection", _NO_SOCKETS)
    create_datagram_endpoint = _refuse("create_datagram_endpoint", _NO_SOCKETS)
    connect_accepted_socket = _refuse("connect_accepted_socket", _NO_SOCKETS)
    create_server = _refuse("create_server", _NO_SERVERS)
    create_unix_server = _refuse("create_unix_server", _NO_SERVERS)
    getaddrinfo = _refuse("getaddrinfo", _NO_NAMES)
    getnameinfo = _refuse("getnameinfo", _NO_NAMES)
    connect_read_pipe = _refuse("connect_read_pipe", _NO_PROCESSES)
    connect_write_pipe = _refuse("connect_write_pipe", _NO_PROCESSES)
    subprocess_shell = _refuse("subprocess_shell", _NO_PROCESSES)
    subprocess_exec = _refuse("subprocess_exec", _NO_PROCESSES)
    add_signal_handler = _refuse("add_signal_handler", _NO_SIGNALS)
    remove_signal_handler = _refuse("remove_signal_handler", _NO_SIGNALS)
    set_default_executor = _refuse("set_default_executor", _INLINE)
    set_task_factory = _refuse("set_task_factory", _TASKS)
    get_task_factory = _refuse("get_task_factory", _TASKS)


def _default_handler(loop: asyncio.AbstractEventLoop, context: ExceptionContext) -> None:
    loop.default_exception_handler(context)


def _check_callback(callback: Callable[..., object], method: str) -> None:
    if asyncio.iscoroutine(callback) or asyncio.iscoroutinefunction(callback):
        raise TypeError(f"{method} was given a coroutine ({callback!r}): use create_task")
    if not callable(callback):
        raise TypeError(f"{method} was given {callback!r}, which is not callable")


def _stable_name(callback: Callable[..., object], args: Sequence[Any]) -> str:
    """What the trace calls a callback: the same in every run and every process."""
    if type(callback) is types.FunctionType:  # the commonest after a task's, and the cheapest
        return callback.__qualname__
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro = owner.get_coro()
        return f"task {getattr(coro, '__qualname__', type(coro).__qualname__)}"
    if isinstance(callback, functools.partial):
        return _stable_name(callback.func, callback.args)
    if isinstance(owner, contextvars.Context) and args:  # Context.run(fn, *args), as to_thread
        return _stable_name(args[0], args[1:])
    name = getattr(callback, "__qualname__", None)
    return name if isinstance(name, str) else type(callback).__qualname__


def _abandon(task: asyncio.Task[Any]) -> None:
    """Let go of a task the run ends with still pending, without running any of its code."""
    # asyncio would report its collection ("Task was destroyed but it is pending!") to a loop
    # long closed; a coroutine that never started is closed now, which runs none of it, rather
    # than warned about as never awaited when collected.
    task._log_destroy_pending = False  # type: ignore[attr-defined]
    coro = task.get_coro()
    if inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        coro.close()


def _stop_when_done(future: asyncio.Future[Any]) -> None:
    # As BaseEventLoop's: a SystemExit or KeyboardInterrupt leaves the loop by itself.
    if not future.cancelled() and isinstance(future.exception(), SystemExit | KeyboardInterrupt):
        return
    future.get_loop().stop()


@dataclass(frozen=True)
class Finished(Generic[T]):
    """A finished run: what its main coroutine returned, and its loop, closed, whose trace
    (`trace_hash()`, `trace_lines()`), `errors`, `steps` and `time()` are still readable."""

    result: T
    loop: SimLoop


def run(
    main: Callable[[], Coroutine[Any, Any, T]],
    seed: int,
    *,
    keep_trace: bool = False,
    timer_jitter_s: float = 0.0,
    connect: Connector | None = None,
) -> Finished[T]:
    """Run `main()` on a new `SimLoop` with this seed, then end the run (`SimLoop.finish`).

    What `main` raises is raised, with a note of the seed and the trace's hash by then."""
    loop = SimLoop(seed, keep_trace=keep_trace, timer_jitter_s=timer_jitter_s, connect=connect)
    try:
        try:
            result = loop.run_until_complete(main())
        finally:
            loop.finish()
    except BaseException as exc:
        exc.add_note(
            f"simulation seed {seed}: trace hash {loop.trace_hash()} after {loop.steps} steps, "
            f"at virtual time {loop.time()} s"
        )
        raise
    return Finished(result, loop)
