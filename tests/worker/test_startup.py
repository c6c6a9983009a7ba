"""`kvhandoff run` starting against NATS, as a real process against real nats-servers.

- NATS that refuses our credentials or TLS handshake: exit 2 at once, one line naming the
  setting to check; the right credentials and certificates connect.
- NATS that is not up yet is retried with backoff, and SIGTERM ends the worker promptly with
  exit 0 wherever start-up is: between retries, while the server does not answer, while
  JetStream does not answer, while reconnecting.
- A worker given a data directory that does not exist creates it, and serves.
- A second worker on the stream, with its own log, is a member of a tier of one partition: it
  stands by, healthy, and takes the partition over when the first stops; a paused owner that
  wakes after the other took over serves nothing more of it and stays up.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvhandoff.events.messages import EngineType, StartHandoff
from kvhandoff.worker.bus.connection import _refusal
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.harness.child import Child
from kvhandoff.worker.harness.health import answers_ok, worker_healthz
from kvhandoff.worker.harness.natsserver import EmbeddedNats, free_port
from kvhandoff.worker.log.reader import open_log
from tests.worker.conftest import WorkerProcess
from tests.worker.scripted_engine import ScriptedEngines

# What a worker logs once it serves the partition (worker.tier.partition).
CLAIMED = "partition 0: caught"
PROMPTLY_S = 3.0  # well under nats-py's 5 s connect and JetStream request timeouts


# --- Helpers ------------------------------------------------------------------------------


def worker_command(nats_url: str, db: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvhandoff.worker.cli",
        "run",
        "--nats-url",
        nats_url,
        "--db",
        str(db),
        "--metrics-port",
        "0",
        *extra,
    ]


def run_to_exit(nats_url: str, db: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The worker run until it exits by itself (within 30 s), with its output."""
    return subprocess.run(
        worker_command(nats_url, db, *extra),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if " ERROR " in line]


def full_log(child: Child) -> str:
    return child.log_path.read_text(errors="replace")


def wait_for_log(child: Child, pattern: str, times: int = 1, timeout: float = 20.0) -> str:
    """Poll the child's log until `pattern` appears there `times` times; the log so far."""
    deadline = time.monotonic() + timeout
    while len(re.findall(pattern, log := full_log(child))) < times:
        assert child.running(), f"worker exited: {log}"
        assert time.monotonic() < deadline, f"no {pattern!r} in {timeout}s: {log}"
        time.sleep(0.05)  # polling another process's output
    return log


def terminate_within(child: Child, seconds: float) -> int:
    """SIGTERM, and the exit code, which must come within `seconds`."""
    began = time.monotonic()
    code = child.terminate(timeout_s=seconds)
    if time.monotonic() - began >= seconds:
        pytest.fail(f"worker still running {seconds}s after SIGTERM: {full_log(child)[-3000:]}")
    return code


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Child]]:
    """Starts workers that are not waited for: start-up is what the test watches."""
    launched: list[Child] = []

    def start(nats_url: str, db: Path, *extra: str) -> Child:
        child = Child(
            worker_command(nats_url, db, *extra), tmp_path / f"worker-{len(launched)}.log"
        )
        launched.append(child)
        child.launch()
        return child

    yield start
    for child in launched:
        child.stop()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[[str], EmbeddedNats]]:
    """Starts nats-servers with extra configuration (authorization, TLS)."""
    started: list[EmbeddedNats] = []

    def start(config: str) -> EmbeddedNats:
        store = tmp_path / f"nats-{len(started)}"
        store.mkdir()
        server = EmbeddedNats(store_dir=store, config=config)
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.close()


@dataclass(frozen=True)
class Certificates:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate it signed,
    and another CA that signed neither."""

    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def fill(self, args: list[str]) -> list[str]:
        """`args` with {ca}, {client_cert}, ... replaced by those files' paths."""
        paths = {name: str(path) for name, path in vars(self).items()}
        return [arg.format(**paths) for arg in args]

    def server_config(self, tls: str) -> str:
        """nats-server configuration: no TLS (""), TLS ("tls"), TLS that verifies clients."""
        if not tls:
            return ""
        verify = f', ca_file: "{self.ca}", verify: true' if tls == "verify" else ""
        return f'tls {{ cert_file: "{self.server_cert}", key_file: "{self.server_key}"{verify} }}'


@pytest.fixture
def certificates(tmp_path: Path) -> Certificates:
    folder = tmp_path / "tls"
    folder.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        openssl(
            "req",
            "-x509",
            *new_key,
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.pem",
            "-days",
            "1",
            "-subj",
            f"/CN=kvhandoff test {ca}",
        )
    for name, extension in [
        ("server", "subjectAltName=IP:127.0.0.1"),
        ("client", "extendedKeyUsage=clientAuth"),
    ]:
        (folder / f"{name}.ext").write_text(extension + "\n")
        openssl(
            "req", *new_key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}"
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
        )
    return Certificates(
        ca=folder / "ca.pem",
        other_ca=folder / "other-ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        client_cert=folder / "client.pem",
        client_key=folder / "client.key",
    )


USER_PASSWORD = "authorization { user: worker, password: secret }"
TOKEN = "authorization { token: s3cret }"


async def handled(engines: ScriptedEngines) -> uuid.UUID:
    """A handoff goes all the way through whichever worker serves the stream; its id."""
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    await engines.start_handoff(start)
    await engines.wait_complete({start.handoff_id}, within=30)
    return start.handoff_id


def logged_ids(db: Path) -> set[uuid.UUID]:
    """The handoffs a worker's file holds, read beside it."""
    with open_log(db) as log:
        return {row.handoff_id for row in log.handoffs()}


def tombstone_ids(db: Path) -> set[uuid.UUID]:
    """The ended handoffs a worker's file knows by their tombstones (worker.log.store)."""
    with closing(sqlite3.connect(db)) as connection:
        return {
            uuid.UUID(hid) for (hid,) in connection.execute("SELECT handoff_id FROM tombstones")
        }


# --- Refused at start ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("server_config", "client_args", "cause"),
    [
        (USER_PASSWORD, [], "the server requires credentials; set --nats-user/--nats-password"),
        (
            USER_PASSWORD,
            ["--nats-user", "worker", "--nats-password", "wrong"],
            "check --nats-user/--nats-password",
        ),
        (TOKEN, ["--nats-token", "wrong"], "check --nats-token"),
    ],
    ids=["no credentials", "wrong password", "wrong token"],
)
def test_refused_authentication_exits_2_naming_the_setting(
    servers: Callable[[str], EmbeddedNats],
    tmp_path: Path,
    server_config: str,
    client_args: list[str],
    cause: str,
) -> None:
    server = servers(server_config)

    began = time.monotonic()
    result = run_to_exit(server.url, tmp_path / "kvhandoff.db", *client_args)

    assert result.returncode == 2, result.stderr
    [line] = error_lines(result.stderr)
    assert f"cannot start: NATS at {server.url} refused the connection: authentication" in line
    assert "Authorization Violation" in line
    assert cause in line
    assert "retrying" not in result.stderr  # refused once is enough
    assert time.monotonic() - began < 15


@dataclass(frozen=True)
class Tls:
    """A server's TLS ("", "tls" or "verify"), the worker's flags, what its error says."""

    server: str
    args: list[str]
    says: str = ""


REFUSED_TLS = {
    "server requires TLS": Tls("tls", [], "the server requires TLS; set --tls-ca"),
    "wrong CA": Tls("tls", ["--tls-ca", "{other_ca}"], "certificate verify failed"),
    "no client certificate": Tls(
        "verify", ["--tls-ca", "{ca}"], "the server verifies clients; set --tls-cert"
    ),
    "not a CA file": Tls("tls", ["--tls-ca", "{server_key}"], "cannot load the TLS files"),
}


@pytest.mark.parametrize("case", REFUSED_TLS.values(), ids=REFUSED_TLS.keys())
def test_refused_tls_exits_2_naming_the_setting(
    servers: Callable[[str], EmbeddedNats], certificates: Certificates, tmp_path: Path, case: Tls
) -> None:
    server = servers(certificates.server_config(case.server))

    result = run_to_exit(server.url, tmp_path / "kvhandoff.db", *certificates.fill(case.args))

    assert result.returncode == 2, result.stderr
    [line] = error_lines(result.stderr)
    assert "cannot start: " in line
    assert case.says in line
    assert "--tls-" in line


CLIENT_CERTIFICATE = ["--tls-cert", "{client_cert}", "--tls-key", "{client_key}"]
ACCEPTED = {
    "user and password": (
        USER_PASSWORD,
        Tls("", ["--nats-user", "worker", "--nats-password", "secret"]),
    ),
    "token": (TOKEN, Tls("", ["--nats-token", "s3cret"])),
    "TLS": ("", Tls("tls", ["--tls-ca", "{ca}"])),
    "TLS with a client certificate": ("", Tls("verify", ["--tls-ca", "{ca}", *CLIENT_CERTIFICATE])),
}


@pytest.mark.parametrize(("authorization", "tls"), ACCEPTED.values(), ids=ACCEPTED.keys())
def test_the_right_credentials_and_certificates_connect(
    servers: Callable[[str], EmbeddedNats],
    certificates: Certificates,
    tmp_path: Path,
    authorization: str,
    tls: Tls,
) -> None:
    server = servers(f"{authorization}\n{certificates.server_config(tls.server)}")
    worker = WorkerProcess(server.url, tmp_path / "kvhandoff.db", *certificates.fill(tls.args))
    try:
        worker.start()  # healthy: connected, consuming, recovered
        assert worker.terminate() == 0
    finally:
        worker.stop()


# --- Retries, and stopping at any point of start-up -----------------------------------------


def test_a_server_that_starts_later_is_retried_with_backoff(
    launch: Callable[..., Child], tmp_path: Path
) -> None:
    port, metrics_port = free_port(), free_port()
    worker = launch(
        f"nats://127.0.0.1:{port}",
        tmp_path / "kvhandoff.db",
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        str(metrics_port),
    )
    wait_for_log(worker, "retrying in", times=4)

    store = tmp_path / "nats"
    store.mkdir()
    with EmbeddedNats(store_dir=store, port=port):
        deadline = time.monotonic() + 30
        while not answers_ok(worker_healthz(metrics_port), timeout_s=1):
            assert worker.running(), full_log(worker)
            assert time.monotonic() < deadline, full_log(worker)
            time.sleep(0.05)  # readiness poll of a child process
        assert terminate_within(worker, PROMPTLY_S) == 0

    delays = [float(d) for d in re.findall(r"retrying in ([\d.]+)s", full_log(worker))]
    assert delays[:4] == [0.25, 0.5, 1.0, 2.0]
    assert max(delays) <= 5.0


def test_sigterm_between_connect_retries_exits_0_promptly(
    launch: Callable[..., Child], tmp_path: Path
) -> None:
    worker = launch(f"nats://127.0.0.1:{free_port()}", tmp_path / "kvhandoff.db")
    wait_for_log(worker, "cannot connect to NATS .* retrying in")

    assert terminate_within(worker, PROMPTLY_S) == 0


def test_sigterm_while_the_server_does_not_answer_exits_0_promptly(
    launch: Callable[..., Child], tmp_path: Path
) -> None:
    # Accepts the connection and never sends INFO: nats-py waits out its connect timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(30)
        worker = launch(f"nats://127.0.0.1:{silent.getsockname()[1]}", tmp_path / "kvhandoff.db")
        connection, _ = silent.accept()
        with connection:
            assert terminate_within(worker, PROMPTLY_S) == 0


def test_sigterm_while_jetstream_does_not_answer_exits_0_promptly(
    servers: Callable[[str], EmbeddedNats], launch: Callable[..., Child], tmp_path: Path
) -> None:
    # The server drops this user's JetStream requests (the tier's set-up), so each waits out
    # its timeout; core NATS works.
    server = servers(
        "authorization { users = [ { user: worker, password: secret,"
        ' permissions: { publish: { deny: "$JS.API.>" } } } ] }'
    )
    worker = launch(
        server.url, tmp_path / "kvhandoff.db", "--nats-user", "worker", "--nats-password", "secret"
    )
    wait_for_log(worker, "(?i)permissions violation")

    assert terminate_within(worker, PROMPTLY_S) == 0
    assert CLAIMED not in full_log(worker)


def test_sigterm_while_reconnecting_exits_0_promptly(
    nats_server: EmbeddedNats, launch: Callable[..., Child], tmp_path: Path
) -> None:
    worker = launch(nats_server.url, tmp_path / "kvhandoff.db")
    wait_for_log(worker, CLAIMED)
    nats_server.stop()
    deadline = time.monotonic() + 20
    while "disconnected from NATS" not in worker.logs():
        assert time.monotonic() < deadline, worker.logs()
        time.sleep(0.05)  # polling the worker's log

    assert terminate_within(worker, PROMPTLY_S) == 0


# --- A second worker on the stream ---------------------------------------------------------


async def test_a_second_worker_on_another_log_shares_the_tier_and_takes_over_when_one_stops(
    nats_server: EmbeddedNats, worker: WorkerProcess, engines: ScriptedEngines, tmp_path: Path
) -> None:
    """Two workers on one stream are a tier of one partition: one serves it (the balance rule
    picks which), the other is a healthy member with nothing to serve; when the first stops,
    the other serves, its file caught up from the replicated log: from the snapshot the first
    took as it handed over, which knows a handoff it ended by its tombstone alone."""
    other = WorkerProcess(nats_server.url, tmp_path / "other.db")
    try:
        await asyncio.to_thread(other.start)
        first = await handled(engines)

        assert await asyncio.to_thread(worker.terminate) == 0

        await asyncio.to_thread(wait_for_log, other, CLAIMED)
        second = await handled(engines)
        assert await asyncio.to_thread(other.terminate) == 0
        # Whichever served `first` holds its rows; if that was the worker that stopped, the
        # other knows it by its tombstone only.
        assert logged_ids(worker.db) <= {first}
        assert second in logged_ids(other.db)
        assert logged_ids(other.db) | logged_ids(worker.db) == {first, second}
        assert first in logged_ids(other.db) | tombstone_ids(other.db)
    finally:
        other.stop()


async def test_a_paused_owner_is_replaced_and_the_tier_carries_on_when_it_wakes(
    nats_server: EmbeddedNats, tmp_path: Path, engines: ScriptedEngines
) -> None:
    """SIGSTOP the owner past its pin's priority timeout and its membership's TTL: the other
    worker takes the partition over and serves it; the woken one rejoins the tier as a member
    (which of the two serves is then the balance rule's choice), and every handoff ends."""
    paused = WorkerProcess(nats_server.url, tmp_path / "paused.db")
    successor = WorkerProcess(nats_server.url, tmp_path / "successor.db")
    try:
        await asyncio.to_thread(paused.start)
        assert paused.process is not None
        before = await handled(engines)
        paused.process.send_signal(signal.SIGSTOP)
        await asyncio.to_thread(successor.start)
        await asyncio.to_thread(wait_for_log, successor, CLAIMED, 1, 60.0)
        during = await handled(engines)

        paused.process.send_signal(signal.SIGCONT)
        after = [await handled(engines) for _ in range(3)]

        assert paused.process.poll() is None, paused.logs()
        assert await asyncio.to_thread(paused.terminate) == 0
        assert await asyncio.to_thread(successor.terminate) == 0
        assert {before, during} <= logged_ids(successor.db)
        assert set(after) <= logged_ids(paused.db) | logged_ids(successor.db)
    finally:
        paused.stop()  # SIGKILL ends a stopped process too
        successor.stop()


@pytest.mark.parametrize("closed", [BrokenPipeError(32, "Broken pipe"), ConnectionResetError()])
def test_a_connection_closed_as_tls_begins_is_a_refusal_without_a_client_certificate(
    closed: OSError, tmp_path: Path
) -> None:
    """TLS 1.3 lets a client finish its handshake before the server refuses its (missing)
    certificate, so the refusal may show only as a closed pipe; it must not be retried forever.
    With a client certificate, or without TLS, the same error is the network's and retried."""
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    with_tls = NatsSettings(tls_ca=ca)
    assert "set --tls-cert" in (_refusal(closed, with_tls) or "")
    assert _refusal(closed, NatsSettings()) is None
    assert _refusal(closed, NatsSettings(tls_ca=ca, tls_cert=ca, tls_key=ca)) is None


async def test_a_worker_creates_its_missing_data_dir_and_serves(
    nats_server: EmbeddedNats, engines: ScriptedEngines, tmp_path: Path
) -> None:
    data_dir = tmp_path / "missing" / "data"
    worker = WorkerProcess(nats_server.url, tmp_path / "unused.db", "--data-dir", str(data_dir))
    with worker:
        await asyncio.to_thread(worker.start)
        handoff_id = await handled(engines)
    assert data_dir.stat().st_mode & 0o777 == 0o700
    assert logged_ids(data_dir / "partition-0.db") == {handoff_id}
