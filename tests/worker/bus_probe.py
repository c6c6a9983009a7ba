"""What the hostile-bus tests observe of a running worker from the outside.

The worker is another process, so every check here is on state it exposes: the JetStream
stream and consumer it reads (is every input settled?), the `rejected` and `done` subjects it
publishes on, the `KVHANDOFF_DONE` stream a frontend reads after the fact, its /healthz and
/metrics, its SQLite log and the `kvhandoff list` command. Waits are bounded polls of that state;
a poll also fails at once, with the worker's last log lines, when the worker process died.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from kvhandoff.events import codec
from kvhandoff.events.messages import Complete, Rejection
from kvhandoff.events.subjects import DEFAULT_DONE_STREAM, DEFAULT_STREAM, Subjects
from tests.eventually import until
from tests.subscribed import registered
from tests.worker.conftest import WorkerProcess

SUBJECTS = Subjects()


@dataclass(frozen=True, slots=True)
class Rejected:
    """A rejection as it arrived: the subject it came on, and the message."""

    subject: str
    rejection: Rejection


@dataclass(frozen=True, slots=True)
class Settlement:
    """The input stream as the worker's consumer sees it."""

    num_pending: int
    num_ack_pending: int
    stream_messages: int

    @property
    def settled(self) -> bool:
        return self.num_pending == 0 and self.num_ack_pending == 0 and self.stream_messages == 0


def assert_alive(worker: WorkerProcess, pid: int) -> None:
    """The same worker process still runs and its /healthz answers 200."""
    assert worker.process is not None
    assert worker.process.pid == pid, f"the worker was replaced: pid {worker.process.pid}"
    code = worker.process.poll()
    assert code is None, f"the worker exited with {code}: {worker.logs()}"
    assert worker.healthy(), f"the worker runs but /healthz is not 200: {worker.logs()}"


def assert_running(worker: WorkerProcess) -> None:
    assert worker.process is not None
    code = worker.process.poll()
    assert code is None, f"the worker exited with {code}: {worker.logs()}"


def running(worker: WorkerProcess) -> Callable[[], None]:
    """A guard for `tests.eventually.until`: fail at once, with its logs, if the worker died."""
    return lambda: assert_running(worker)


class BusProbe:
    """A frontend's-eye view of the bus: rejections with their subjects, completions with
    their arrival times, the input stream's settlement and the stored completions."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rejected: list[Rejected] = []
        self.undecodable: list[tuple[str, bytes]] = []  # what arrived but is not a Rejection
        self.completed_at: dict[UUID, float] = {}  # first Complete per handoff, monotonic time
        self.completions: dict[UUID, list[Complete]] = {}
        self.reconnects = 0
        self._completed: dict[UUID, asyncio.Event] = {}
        self._nc: Client | None = None

    @property
    def nc(self) -> Client:
        assert self._nc is not None
        return self._nc

    async def start(self, rejections: bool = True) -> None:
        """Connect and subscribe to completions, and to rejections unless told not to (a
        flood's thousands of them would load the test's own event loop)."""

        async def on_reconnect() -> None:
            self.reconnects += 1

        async def on_error(exc: Exception) -> None:
            """Refused connections while a test keeps NATS down are expected, not news."""

        self._nc = await nats.connect(
            self.url,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            reconnected_cb=on_reconnect,
            error_cb=on_error,
        )
        if rejections:
            await self.nc.subscribe(SUBJECTS.all_rejected, cb=self._on_rejected)
        await self.nc.subscribe(SUBJECTS.all_done, cb=self._on_done)
        # What the probe watches is caused through other connections (the engines', the
        # worker's): the server must have its subscriptions before those publish.
        await registered(self.nc)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()

    async def _on_rejected(self, msg: Msg) -> None:
        try:
            self.rejected.append(Rejected(msg.subject, codec.decode_rejection(msg.data)))
        except msgspec.DecodeError:
            self.undecodable.append((msg.subject, msg.data))

    async def _on_done(self, msg: Msg) -> None:
        action = codec.decode_action(msg.data)
        assert isinstance(action, Complete), f"not a Complete on {msg.subject}: {action!r}"
        self.completed_at.setdefault(action.handoff_id, time.monotonic())
        self.completions.setdefault(action.handoff_id, []).append(action)
        self._completion_event(action.handoff_id).set()

    def _completion_event(self, handoff_id: UUID) -> asyncio.Event:
        return self._completed.setdefault(handoff_id, asyncio.Event())

    async def wait_completion(self, handoff_id: UUID, within: float) -> Complete:
        """The first Complete of a handoff, once it arrives (within `within` s)."""
        try:
            await asyncio.wait_for(self._completion_event(handoff_id).wait(), within)
        except TimeoutError:
            raise AssertionError(f"no Complete for {handoff_id} within {within}s") from None
        return self.completions[handoff_id][0]

    async def publish(self, subject: str, payload: bytes) -> None:
        """Publish an input durably (the stream stored it), retrying while NATS is away."""
        js = self.nc.jetstream()
        for attempt in range(200):
            try:
                await js.publish(subject, payload, timeout=2.0)
                return
            except (nats.errors.Error, TimeoutError):
                await asyncio.sleep(min(0.05 * (attempt + 1), 0.5))  # a bounded retry
        raise AssertionError(f"could not publish to {subject}")

    async def refused(self, subject: str, payload: bytes) -> bool:
        """Whether JetStream refuses to store a publish to `subject`: no stream takes it."""
        try:
            await self.nc.jetstream().publish(subject, payload, timeout=2.0)
        except nats.js.errors.NoStreamResponseError:
            return True
        return False

    async def settlement(self) -> Settlement:
        js = self.nc.jetstream()
        # One per partition.
        consumers = await js.consumers_info(DEFAULT_STREAM)
        stream = await js.stream_info(DEFAULT_STREAM)
        return Settlement(
            sum(c.num_pending or 0 for c in consumers),
            sum(c.num_ack_pending or 0 for c in consumers),
            stream.state.messages,
        )

    async def wait_settled(self, worker: WorkerProcess, within: float = 60.0) -> None:
        """Every input published so far was acknowledged by the worker."""
        last: list[Settlement] = []

        async def settled() -> bool:
            last[:] = [await self.settlement()]
            return last[0].settled

        await until(
            settled,
            "inputs settled",
            within=within,
            every=0.1,
            guard=running(worker),
            context=lambda: last,
        )

    async def wait_rejections(
        self,
        match: Callable[[Rejected], bool],
        what: str,
        worker: WorkerProcess,
        within: float = 60.0,
    ) -> list[Rejected]:
        await until(
            lambda: any(match(r) for r in self.rejected), what, within=within, guard=running(worker)
        )
        return [r for r in self.rejected if match(r)]

    async def stored_completion(self, handoff_id: UUID) -> Complete | None:
        """The last Complete of a handoff as KVHANDOFF_DONE keeps it, if it does."""
        js = self.nc.jetstream()
        try:
            stored = await js.get_last_msg(DEFAULT_DONE_STREAM, SUBJECTS.done(handoff_id))
        except nats.js.errors.NotFoundError:
            return None
        assert stored.data is not None
        action = codec.decode_action(stored.data)
        assert isinstance(action, Complete), f"KVHANDOFF_DONE holds {action!r}"
        return action

    async def has_stream(self, name: str) -> bool:
        try:
            await self.nc.jetstream().stream_info(name)
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def purge_inputs(self) -> None:
        await self.nc.jetstream().purge_stream(DEFAULT_STREAM)


def takes(subject: str) -> bool:
    """Whether the worker's input stream stores `subject`: `<prefix>.in.<token>` only, the
    subjects its transform can partition (JetStream refuses the rest to their publisher)."""
    return "." not in subject.removeprefix(f"{SUBJECTS.prefix}.in.")


def rejection_subject_matches(rejected: Rejected) -> bool:
    """The rejection travels on `rejected.<its handoff id>`, or `rejected.unknown`."""
    return rejected.subject == SUBJECTS.rejected(rejected.rejection.handoff_id)


def corrupt_record(db: Path, handoff_id: UUID, seq: int) -> None:
    """Overwrite one logged record with bytes no msgpack decoder accepts (0xc1 is never used)."""
    with closing(sqlite3.connect(db, timeout=30)) as connection, connection:
        changed = connection.execute(
            "UPDATE events SET record = ? WHERE seq = ? AND handoff_key ="
            " (SELECT handoff_key FROM handoffs WHERE handoff_id = ?)",
            (b"\xc1 not a log record \xff", seq, str(handoff_id)),
        ).rowcount
    assert changed == 1, f"no event {seq} of {handoff_id} to corrupt"


def handoff_state(db: Path, handoff_id: UUID) -> str | None:
    with closing(sqlite3.connect(db, timeout=30)) as connection:
        row = connection.execute(
            "SELECT state FROM handoffs WHERE handoff_id = ?", (str(handoff_id),)
        ).fetchone()
    return None if row is None else str(row[0])


def logged_rejections(db: Path, handoff_id: UUID) -> list[str]:
    """The reasons the rejections table holds for one handoff, oldest first."""
    with closing(sqlite3.connect(db, timeout=30)) as connection:
        rows = connection.execute(
            "SELECT reason FROM rejections WHERE handoff_id = ? ORDER BY id", (str(handoff_id),)
        ).fetchall()
    return [str(reason) for (reason,) in rows]


def rejected_ids(db: Path) -> set[UUID | None]:
    """The handoff ids of every row in the rejections table."""
    with closing(sqlite3.connect(db, timeout=30)) as connection:
        rows = connection.execute("SELECT DISTINCT handoff_id FROM rejections").fetchall()
    return {None if h is None else UUID(h) for (h,) in rows}


def gauge(metrics: str, name: str) -> float | None:
    """The value of an unlabelled gauge in Prometheus text, or None if it is not there."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    return None if found is None else float(found.group(1))


def listed(db: Path, *filters: str) -> set[UUID]:
    """The handoff ids `kvhandoff list DB --json FILTERS...` prints (a separate process)."""
    result = subprocess.run(
        [sys.executable, "-m", "kvhandoff.worker.cli", "list", str(db), "--json", *filters],
        capture_output=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    report = json.loads(result.stdout)
    return {UUID(h["handoff"]["handoff_id"]) for h in report["handoffs"]}
