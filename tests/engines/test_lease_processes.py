"""Engine leases with real processes: `kvhandoff run`, `kvhandoff engines` and `kvhandoff load`
as children. An engine process SIGKILLed mid-load strands nothing (every handoff ends, long
before its deadline; the surviving engines leak nothing; `stuck` lists none). One SIGSTOPped
past its lease and resumed fenced itself (its handoff ended `canceled`, and it published no late
success), and a restart of the same id is a new incarnation that serves new handoffs. An engine
that takes no lease keeps today's behaviour: its handoffs end at their deadline."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhandoff.client import Connection, Frontend, HandoffRejected
from kvhandoff.events.leases import LEASE_EXPIRED
from kvhandoff.events.messages import (
    EngineType,
    Failed,
    HandoffCompletion,
    SourceHeld,
    StartHandoff,
)
from kvhandoff.events.records import InputRecord
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.log.schema import HandoffState

KVHANDOFF = [sys.executable, "-m", "kvhandoff.worker.cli"]
ROSTER = ["--engine-types", "vllm", "--sources", "2", "--destinations", "1"]
KEPT, DOOMED, DECODE = "vllm-prefill-0", "vllm-prefill-1", "vllm-decode-0"
WAIT_S = 90.0
LONG_DEADLINE_MS = 120_000  # beyond every wait here: a deadline is never what ends a handoff


def bus_options(nats_server: EmbeddedNats, subjects: Subjects) -> list[str]:
    return ["--nats-url", nats_server.url, "--subject-prefix", subjects.prefix]


class Engines:
    """`kvhandoff engines` serving some of `ROSTER`, in a child process."""

    def __init__(self, bus: list[str], *options: str) -> None:
        self.process = subprocess.Popen(
            [*KVHANDOFF, "engines", *bus, *ROSTER, *options],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def stop(self) -> tuple[int, str]:
        """SIGINT, and its exit code and output (the accounting and leak report)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        out, _ = self.process.communicate(timeout=60)
        return self.process.returncode, out


@pytest.fixture
def spawn() -> Iterator[list[Engines]]:
    started: list[Engines] = []
    yield started
    for engines in started:
        if engines.process.poll() is None:
            engines.process.send_signal(signal.SIGCONT)
            engines.process.kill()
        engines.process.communicate(timeout=30)  # and close its pipe


def wait_until(condition: object, what: str) -> None:
    give_up_at = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < give_up_at, f"not within {WAIT_S}s: {what}"
        time.sleep(0.05)  # poll interval


def handoffs_of(db: Path, engine_id: str) -> int:
    if not db.exists():
        return 0
    with open_log(db) as log:
        return sum(row.source == engine_id for row in log.handoffs())


def test_an_engine_sigkilled_mid_load_strands_no_handoff(
    nats_server: EmbeddedNats,
    subjects: Subjects,
    worker: Path,
    tmp_path: Path,
    spawn: list[Engines],
) -> None:
    bus = bus_options(nats_server, subjects)
    db = worker.parent / "kvhandoff.db"
    kept = Engines(bus, "--leave-out", DOOMED, "--lease-ttl", "1", "--speedup", "20")
    doomed = Engines(
        bus, "--leave-out", KEPT, "--leave-out", DECODE, "--lease-ttl", "1", "--speedup", "20"
    )
    spawn += [kept, doomed]
    report_path = tmp_path / "report.json"
    load = subprocess.Popen(
        [
            *KVHANDOFF,
            "load",
            *bus,
            *ROSTER,
            "--handoffs",
            "300",
            "--concurrency",
            "30",
            "--deadline-ms",
            str(LONG_DEADLINE_MS),
            "--wait-timeout",
            "60s",
            "--wait-for-engines",
            "30s",
            "--json",
            str(report_path),
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_until(lambda: handoffs_of(db, DOOMED) >= 20, "the doomed engine has handoffs")

    doomed.process.send_signal(signal.SIGKILL)
    load.communicate(timeout=WAIT_S * 2)

    # (It exits 1: the starts naming the dead engine were rejected, as they should be.)
    report = json.loads(report_path.read_text())
    # Every handoff ended: none waited for its deadline (the wait timeout is shorter).
    assert report["timed_out"] == 0, report
    assert report["completed"] + report["canceled"] + report["rejected"] == 300, report
    assert report["canceled"] > 0, report  # the doomed engine's open handoffs
    assert report["leaks"] == 0, report  # of the surviving engines
    stuck = subprocess.run(
        [*KVHANDOFF, "stuck", str(db), "--json"], capture_output=True, text=True, check=True
    )
    assert json.loads(stuck.stdout)["handoffs"] == [], stuck.stdout
    code, out = kept.stop()
    assert code == 0 and "no leaks" in out, out


def test_an_engine_paused_past_its_lease_fences_itself_and_comes_back_as_a_new_incarnation(
    nats_server: EmbeddedNats, subjects: Subjects, worker: Path, spawn: list[Engines]
) -> None:
    bus = bus_options(nats_server, subjects)
    db = worker.parent / "kvhandoff.db"
    spawn.append(Engines(bus, "--leave-out", DOOMED, "--lease-ttl", "1"))
    # A prefill of a few seconds: the source holds the handoff while it is paused.
    slow = ["--lease-ttl", "1", "--prefill-tokens-per-s", "500"]
    paused = Engines(bus, "--leave-out", KEPT, "--leave-out", DECODE, *slow)
    spawn.append(paused)
    handoff_id = asyncio.run(_start(nats_server, subjects))
    wait_until(lambda: handoffs_of(db, DOOMED) == 1, "the paused engine's handoff started")

    paused.process.send_signal(signal.SIGSTOP)
    asyncio.run(_ended(nats_server, subjects, handoff_id, HandoffCompletion.CANCELED))
    paused.process.send_signal(signal.SIGCONT)

    # Back: a new incarnation (the tier admits starts naming it again) that serves them.
    asyncio.run(_served_again(nats_server, subjects))
    with open_log(db) as log:
        inputs = [
            e.record.input for e in log.load(handoff_id).events if isinstance(e.record, InputRecord)
        ]
    assert Failed(handoff_id, LEASE_EXPIRED) in inputs
    assert not any(isinstance(i, SourceHeld) for i in inputs)  # no late success
    code, out = paused.stop()
    assert "fencing the engine" in out, out
    # It saw the handoff complete, and holds nothing for it: it dropped the prefill's blocks.
    assert code == 0 and "no leaks" in out, out


def test_an_engine_restarted_with_the_same_id_ends_its_old_handoffs_and_serves_new_ones(
    nats_server: EmbeddedNats, subjects: Subjects, worker: Path, spawn: list[Engines]
) -> None:
    bus = bus_options(nats_server, subjects)
    db = worker.parent / "kvhandoff.db"
    spawn.append(Engines(bus, "--leave-out", DOOMED, "--lease-ttl", "30"))
    slow = ["--prefill-tokens-per-s", "10"]  # its prefill would outlast the test
    old = Engines(bus, "--leave-out", KEPT, "--leave-out", DECODE, "--lease-ttl", "30", *slow)
    spawn.append(old)
    handoff_id = asyncio.run(_start(nats_server, subjects))
    wait_until(lambda: handoffs_of(db, DOOMED) == 1, "the old incarnation's handoff started")

    old.process.send_signal(signal.SIGKILL)  # its lease would live on for 30 s
    spawn.append(Engines(bus, "--leave-out", KEPT, "--leave-out", DECODE, "--lease-ttl", "30"))

    # Long before the old lease's 30 s: the new incarnation replaced it.
    asyncio.run(_ended(nats_server, subjects, handoff_id, HandoffCompletion.CANCELED))
    asyncio.run(_served_again(nats_server, subjects))


def test_an_engine_without_a_lease_keeps_the_deadline_behaviour(
    nats_server: EmbeddedNats, subjects: Subjects, worker: Path, spawn: list[Engines]
) -> None:
    bus = bus_options(nats_server, subjects)
    db = worker.parent / "kvhandoff.db"
    spawn.append(Engines(bus, "--leave-out", DOOMED))
    unleased = Engines(
        bus,
        "--leave-out",
        KEPT,
        "--leave-out",
        DECODE,
        "--lease-ttl",
        "0",
        "--prefill-tokens-per-s",
        "10",
    )
    spawn.append(unleased)
    handoff_id = asyncio.run(_start(nats_server, subjects, deadline_ms=3000))
    wait_until(lambda: handoffs_of(db, DOOMED) == 1, "the handoff started")

    unleased.process.send_signal(signal.SIGKILL)

    # Ended by its deadline, which cleanup then waits on for ever (the engine is gone).
    wait_until(lambda: _timed_out(db, handoff_id), "the deadline passed")
    with open_log(db) as log:
        row = log.load(handoff_id).handoff
        inputs = [
            e.record.input for e in log.load(handoff_id).events if isinstance(e.record, InputRecord)
        ]
    assert row.state is HandoffState.OPEN
    assert not any(isinstance(i, Failed) for i in inputs)
    # `stuck` lists it, waiting on an engine of which the tier knew no lease.
    stuck = subprocess.run(
        [*KVHANDOFF, "stuck", str(db), "--json"], capture_output=True, text=True, check=True
    )
    report = json.loads(stuck.stdout)
    assert report["leases_at_ms"] is not None  # the worker's view of the leased engines
    (waiting,) = next(
        h["waiting"] for h in report["handoffs"] if h["handoff"]["handoff_id"] == str(handoff_id)
    )
    assert (waiting["engine"], waiting["lease"]) == (DOOMED, None)


def _timed_out(db: Path, handoff_id: uuid.UUID) -> bool:
    with open_log(db) as log:
        events = log.load(handoff_id).events
    return any(
        isinstance(e.record, InputRecord) and type(e.record.input).__name__ == "TimedOut"
        for e in events
    )


async def _start(
    nats_server: EmbeddedNats, subjects: Subjects, deadline_ms: int = LONG_DEADLINE_MS
) -> uuid.UUID:
    settings = NatsSettings(url=nats_server.url, subject_prefix=subjects.prefix)
    async with await Connection.open(settings, "test") as connection:
        frontend = await Frontend.open(connection)
        give_up_at = time.monotonic() + WAIT_S
        while not await connection.engine_listening(DOOMED, wait_s=0.5):  # the probe waits
            assert time.monotonic() < give_up_at, f"{DOOMED} never listened"
        start = StartHandoff(uuid.uuid4(), EngineType.VLLM, DOOMED, DECODE, deadline_ms)
        return await frontend.start(start)


async def _ended(
    nats_server: EmbeddedNats,
    subjects: Subjects,
    handoff_id: uuid.UUID,
    completion: HandoffCompletion,
) -> None:
    settings = NatsSettings(url=nats_server.url, subject_prefix=subjects.prefix)
    async with await Connection.open(settings, "test") as connection:
        frontend = await Frontend.open(connection)
        complete = await frontend.wait(handoff_id, timeout_s=WAIT_S)
        assert complete.completion is completion


async def _served_again(nats_server: EmbeddedNats, subjects: Subjects) -> None:
    """Start handoffs naming the doomed engine's id until one succeeds."""
    settings = NatsSettings(url=nats_server.url, subject_prefix=subjects.prefix)
    async with await Connection.open(settings, "test") as connection:
        frontend = await Frontend.open(connection)
        give_up_at = time.monotonic() + WAIT_S
        while True:
            start = StartHandoff(uuid.uuid4(), EngineType.VLLM, DOOMED, DECODE, 60_000)
            handoff_id = await frontend.start(start)
            try:
                complete = await frontend.wait(handoff_id, timeout_s=WAIT_S)
            except HandoffRejected:  # the tier still has it expired
                complete = None
            if complete is not None and complete.completion is HandoffCompletion.SUCCESS:
                return
            assert time.monotonic() < give_up_at, "never served again"
            await asyncio.sleep(0.25)  # the next renewal
