"""Fixtures for the worker's tests: a real nats-server, the worker as a real process (so it can
be killed with SIGKILL), and the scripted engines."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from uuid import UUID

import pytest

from events.messages import Action, Input
from events.records import ActionRecord, InputRecord
from tests.worker.scripted_engine import ScriptedEngines
from worker.health import answers_ok, worker_healthz
from worker.logreader import open_log
from worker.natsserver import EmbeddedNats, free_port
from worker.rows import HandoffLog


class WorkerProcess:
    """`kvhandoff run` in a child process, restartable on the same database."""

    def __init__(self, nats_url: str, db: Path, *extra: str, module: str = "worker.cli") -> None:
        self.module = module  # another entry point that runs the same CLI (a crashing one)
        self.nats_url = nats_url
        self.db = db
        self.extra = extra
        self.log_path = db.with_suffix(".log")
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self, timeout: float = 30.0) -> None:
        """Launch the worker and wait until it is healthy (recovered and connected)."""
        self.launch()
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited {self.process.returncode}: {self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"worker not healthy in {timeout}s: {self.logs()}")
            time.sleep(0.05)  # readiness poll of a child process

    def launch(self) -> None:
        """Launch the worker without waiting for it."""
        self.port = free_port()
        command = [
            sys.executable, "-m", self.module, "run",
            "--nats-url", self.nats_url, "--db", str(self.db),
            "--metrics-host", "127.0.0.1", "--metrics-port", str(self.port),
            "--retry-interval", "1s", "--ack-wait", "2s", *self.extra,
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def healthy(self) -> bool:
        return answers_ok(worker_healthz(self.port), timeout_s=1)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
            return bytes(r.read()).decode()

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    store = tmp_path / "nats"
    store.mkdir()
    server = EmbeddedNats(store_dir=store)
    server.start()
    yield server
    server.close()


@pytest.fixture
def worker(nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[WorkerProcess]:
    process = WorkerProcess(nats_server.url, tmp_path / "kvhandoff.db")
    process.start()
    yield process
    process.stop()


@pytest.fixture
async def engines(nats_server: EmbeddedNats) -> AsyncIterator[ScriptedEngines]:
    scripted = ScriptedEngines(nats_server.url)
    await scripted.start()
    yield scripted
    await scripted.close()


def logged(db: Path, handoff_id: UUID) -> HandoffLog:
    """One handoff's log, read the way the offline tools read it (read-only, beside the worker)."""
    with open_log(db) as log:
        return log.load(handoff_id)


def logged_actions(db: Path, handoff_id: UUID) -> list[Action]:
    records = (e.record for e in logged(db, handoff_id).events)
    return [r.action for r in records if isinstance(r, ActionRecord)]


def logged_inputs(db: Path, handoff_id: UUID) -> list[Input]:
    records = (e.record for e in logged(db, handoff_id).events)
    return [r.input for r in records if isinstance(r, InputRecord)]
