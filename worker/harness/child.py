"""Processes we start and stop: `kvhandoff run` above all, for the demo, the tests and the benches.

`Child` is any command run as a child process, its stdout and stderr appended to one file, ready
once its `ready()` says so. It is stopped one of two ways: `terminate()`, politely (SIGTERM, then
SIGKILL if it has not exited after a timeout), giving its exit status, or `kill()` / `stop()`,
at once with SIGKILL, as a crash would (`stop` only if it still runs: a test's last word). It
can be started again after it stopped, appending to the same file; as a context manager it is
terminated on the way out.

`WorkerChild` is `kvhandoff run` on a log and a NATS server, its metrics endpoint on a free
loopback port chosen at each launch (so a restart never waits for the old port), ready when its
`/healthz` answers 200: the worker has recovered its log and is consuming. `metrics()` reads its
Prometheus text, and `metric(name)` sums a family's samples from it.

A child that exits before it is ready, or is not ready in time, is a `ChildError` that quotes
the end of its output. Readiness is polled (every 50 ms) against the child's real state, never
assumed after a pause.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from kvhandoff.worker.errors import ChildError
from kvhandoff.worker.harness.health import answers_ok, worker_healthz
from kvhandoff.worker.harness.natsserver import free_port

_TAIL_CHARS = 4000  # of a child's output, quoted when it fails


class Child:
    """A command run as a child process (module docstring)."""

    def __init__(
        self,
        command: Sequence[str],
        log_path: Path,
        *,
        name: str | None = None,
        cwd: Path | None = None,
        new_session: bool = False,
    ) -> None:
        self.command = list(command)
        self.log_path = log_path
        self.name = name or log_path.stem
        self.cwd = cwd
        # In a session of its own, Ctrl-C reaches only the parent, which stops its children in
        # the order it chooses.
        self.new_session = new_session
        self.process: subprocess.Popen[bytes] | None = None

    def ready(self) -> bool:
        """Whether the child is ready for use; a started process is, unless a subclass knows
        better."""
        return True

    def launch(self) -> None:
        """Start the process, without waiting for it to be ready."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=self.new_session,
            )

    def start(self, timeout_s: float = 30.0) -> None:
        """Launch the process and wait until it is ready; `ChildError` if it exits first or is
        not ready within `timeout_s`."""
        self.launch()
        process = self._launched()
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if process.poll() is not None:
                raise ChildError(f"{self.name} exited {process.returncode}: {self.logs()}")
            if time.monotonic() > deadline:
                raise ChildError(f"{self.name} not ready in {timeout_s:g}s: {self.logs()}")
            time.sleep(0.05)  # readiness poll of a child process

    @property
    def pid(self) -> int:
        return self._launched().pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (the worker drains, the engines report leaks), and the exit status; SIGKILL
        if it has not exited within `timeout_s`."""
        process = self._launched()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                return process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
        return process.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would, and wait for it to be gone."""
        process = self._launched()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def stop(self) -> None:
        """Kill the process if it still runs."""
        if self.running():
            self.kill()

    def logs(self) -> str:
        """The end of the child's output."""
        return self.log_path.read_text(errors="replace")[-_TAIL_CHARS:]

    def _launched(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise ChildError(f"{self.name} was never launched")
        return self.process

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.running():
            self.terminate()


class WorkerChild(Child):
    """`kvhandoff run` as a child process (module docstring). `extra` arguments come last, so
    they may repeat and override any of the others; `module` is another entry point that runs
    the same CLI (a test's crashing one)."""

    def __init__(
        self,
        nats_url: str,
        db: Path,
        *extra: str,
        log_path: Path | None = None,
        module: str = "kvhandoff.worker.cli",
        cwd: Path | None = None,
        new_session: bool = False,
    ) -> None:
        log = log_path or db.with_suffix(".log")
        super().__init__([], log, name="the worker", cwd=cwd, new_session=new_session)
        self.nats_url = nats_url
        self.db = db
        self.extra = extra
        self.module = module
        self.port = 0

    def launch(self) -> None:
        self.port = free_port()
        self.command = [
            sys.executable,
            "-m",
            self.module,
            "run",
            "--nats-url",
            self.nats_url,
            "--db",
            str(self.db),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(self.port),
            *self.extra,
        ]
        super().launch()

    def ready(self) -> bool:
        return self.healthy()

    def healthy(self) -> bool:
        """Whether its /healthz answers 200."""
        return answers_ok(worker_healthz(self.port), timeout_s=1)

    def metrics(self) -> str:
        """Its /metrics, as Prometheus text."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
            return bytes(r.read()).decode()

    def metric(self, name: str) -> float:
        """The sum of the samples named `name` in its /metrics (every label set)."""
        return metric_sum(self.metrics(), name)


def metric_sum(text: str, name: str) -> float:
    """The sum of the samples named `name` in Prometheus text (every label set)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
