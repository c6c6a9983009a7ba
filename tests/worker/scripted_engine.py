"""A scripted stand-in for every engine and the frontend, for the worker's tests.

It answers each action on `kvhandoff.engine.*.actions` according to a script (by default the
success path), publishing outcomes and facts with JetStream so none is lost, and it records
what it saw so tests can assert on it:

- `first`: the first delivery of each (handoff, action id); a later delivery with the same key
  must be the identical action (ids are stable across worker restarts), and is answered with
  the same outcome again, never a second effect (`effects` counts executions).
- `completions`: every `Complete` on `kvhandoff.done.>`, per handoff.
- `stored`: the stream sequence of every input it published, as the stream acknowledged it
  (what must never be lost).
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Callable
from uuid import UUID

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from kvhandoff.events import codec
from kvhandoff.events.messages import (
    Action,
    ActionOutcome,
    Complete,
    Input,
    Rejection,
    StartHandoff,
)
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.engines.healthy import success_script

Script = Callable[[Action], list[Input]]


class ScriptedEngines:
    def __init__(
        self, url: str, script: Script = success_script, *, prefix: str = "kvhandoff"
    ) -> None:
        self.url = url
        self.script = script
        self.subjects = Subjects(prefix)
        self.first: dict[tuple[UUID, int], Action] = {}
        self.replies: dict[tuple[UUID, int], list[Input]] = {}
        self.effects: Counter[tuple[UUID, int]] = Counter()
        self.deliveries: Counter[tuple[UUID, int]] = Counter()
        self.mismatched: list[tuple[Action, Action]] = []
        self.completions: dict[UUID, list[Complete]] = defaultdict(list)
        self.rejections: list[Rejection] = []
        self.stored: list[int] = []
        self._nc: Client | None = None
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def nc(self) -> Client:
        assert self._nc is not None
        return self._nc

    async def start(self) -> None:
        self._nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        await self.nc.subscribe(f"{self.subjects.prefix}.engine.*.actions", cb=self._on_action)
        await self.nc.subscribe(self.subjects.all_done, cb=self._on_done)
        await self.nc.subscribe(self.subjects.all_rejected, cb=self._on_rejected)
        await self.nc.flush()

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()

    async def send(self, message: Input) -> None:
        """Publish an input to its handoff's subject durably, retrying while NATS is away."""
        payload = codec.encode(message)
        await self.send_raw(self.subjects.input(message.handoff_id), payload)

    async def send_raw(self, subject: str, payload: bytes) -> None:
        js = self.nc.jetstream()
        for attempt in range(200):
            try:
                self.stored.append((await js.publish(subject, payload, timeout=2.0)).seq)
                return
            except (nats.errors.Error, TimeoutError):
                # The stream or the server may be restarting; a bounded retry, not a wait.
                await asyncio.sleep(min(0.05 * (attempt + 1), 0.5))
        raise AssertionError(f"could not publish to {subject}")

    async def start_handoff(self, start: StartHandoff) -> None:
        await self.send(start)

    async def until(self, predicate: Callable[[], bool], what: str, within: float = 60) -> None:
        """Return once `predicate` holds (re-checked on every message seen), or fail."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), within)
            except TimeoutError:
                raise AssertionError(f"timed out after {within}s waiting for {what}") from None

    async def wait_complete(self, handoff_ids: set[UUID], within: float = 60.0) -> None:
        def done() -> bool:
            return handoff_ids <= self.completions.keys()

        missing = len(handoff_ids - self.completions.keys())
        await self.until(done, f"{missing} handoffs to complete", within)

    async def wait_completions(self, handoff_id: UUID, count: int) -> None:
        await self.until(
            lambda: len(self.completions.get(handoff_id, ())) >= count,
            f"{count} completions of {handoff_id}",
        )

    async def wait_for_action(self, handoff_id: UUID, kind: type[Action]) -> Action:
        def arrived() -> bool:
            return any(isinstance(a, kind) for a in self.actions_of(handoff_id))

        await self.until(arrived, f"{kind.__name__} for {handoff_id}")
        return next(a for a in self.actions_of(handoff_id) if isinstance(a, kind))

    async def wait_rejection(self, handoff_id: UUID) -> Rejection:
        def arrived() -> bool:
            return any(r.handoff_id == handoff_id for r in self.rejections)

        await self.until(arrived, f"a rejection for {handoff_id}")
        return next(r for r in self.rejections if r.handoff_id == handoff_id)

    async def wait_rejections(self, count: int) -> list[Rejection]:
        await self.until(lambda: len(self.rejections) >= count, f"{count} rejections")
        return list(self.rejections)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _on_action(self, msg: Msg) -> None:
        # Engines work on many requests at once; the replies to one action stay in order.
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        action = codec.decode_action(msg.data)
        key = (action.handoff_id, action.action_id)
        self.deliveries[key] += 1
        if key in self.first:
            if self.first[key] != action:
                self.mismatched.append((self.first[key], action))
            replies: list[Input] = [r for r in self.replies[key] if isinstance(r, ActionOutcome)]
        else:
            self.first[key] = action
            self.effects[key] += 1
            replies = self.replies[key] = self.script(action)
        await self._notify()
        for reply in replies:
            await self.send(reply)

    async def _on_done(self, msg: Msg) -> None:
        complete = codec.decode_action(msg.data)
        assert isinstance(complete, Complete)
        self.completions[complete.handoff_id].append(complete)
        self.first.setdefault((complete.handoff_id, complete.action_id), complete)
        await self._notify()

    async def _on_rejected(self, msg: Msg) -> None:
        self.rejections.append(codec.decode_rejection(msg.data))
        await self._notify()

    def actions_of(self, handoff_id: UUID) -> list[Action]:
        """The distinct actions engines and frontend received for one handoff, by action id."""
        keys = sorted(k for k in self.first if k[0] == handoff_id)
        return [self.first[k] for k in keys]
