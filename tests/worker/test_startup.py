"""`kvhandoff run` starting against NATS, as a real process against real nats-servers.

- NATS that refuses our credentials or TLS handshake: exit 2 at once, one line naming the
  setting to check; the right credentials and certificates connect.
- NATS that is not up yet is retried with backoff, and SIGTERM ends the worker promptly with
  exit 0 wherever start-up is: between retries, while the server does not answer, while
  JetStream does not answer, while reconnecting.
- One worker per stream and consumer: a second one exits 2 naming the first and leaves the
  consumer alone; a worker restarted on its own log after SIGKILL takes its lease over at once;
  another log may take it once it expired; a worker that lost it stops and exits 1.

Tests that wait for a lease to expire create the lease bucket themselves with a short TTL; the
worker uses whatever TTL the bucket has.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
import nats.js.errors
import pytest

from kvhandoff.events.messages import EngineType, StartHandoff
from kvhandoff.worker.bus import LEASE_BUCKET, LEASE_TTL_S, LeaseHolder, _refusal
from kvhandoff.worker.child import Child
from kvhandoff.worker.config import NatsSettings
from kvhandoff.worker.health import answers_ok, worker_healthz
from kvhandoff.worker.natsserver import EmbeddedNats, free_port
from tests.worker.conftest import WorkerProcess
from tests.worker.scripted_engine import ScriptedEngines

LEASE_KEY = "KVHANDOFF_IN.kvhandoff-worker"
PROMPTLY_S = 3.0  # well under nats-py's 5 s connect and JetStream request timeouts
SHORT_TTL_S = 2.0


# --- Helpers ------------------------------------------------------------------------------


def worker_command(nats_url: str, db: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "kvhandoff.worker.cli", "run",
        "--nats-url", nats_url, "--db", str(db), "--metrics-port", "0", *extra,
    ]  # fmt: skip


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


def worker_mode(tier: bool, data_dir: Path) -> tuple[list[str], str]:
    """The flags of a single worker, or of a tier worker at one partition, and what its log
    says once it works."""
    if tier:
        return ["--partitions", "1", "--data-dir", str(data_dir)], "partition 0: claimed"
    return [], "consuming"


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
        openssl("req", "-x509", *new_key, "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                "-days", "1", "-subj", f"/CN=kvhandoff test {ca}")  # fmt: skip
    for name, extension in [
        ("server", "subjectAltName=IP:127.0.0.1"),
        ("client", "extendedKeyUsage=clientAuth"),
    ]:
        (folder / f"{name}.ext").write_text(extension + "\n")
        openssl("req", *new_key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                "-extfile", f"{name}.ext")  # fmt: skip
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


async def lease_holder(nats_url: str) -> LeaseHolder | None:
    """Who holds the default stream's consumer lease, as NATS has it, or None."""
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(LEASE_BUCKET)
        try:
            entry = await kv.get(LEASE_KEY)
        except nats.js.errors.KeyNotFoundError:
            return None
        return msgspec.json.decode(entry.value or b"", type=LeaseHolder)
    finally:
        await nc.close()


async def assert_lease_held_by(url: str, pid: int) -> None:
    holder = await lease_holder(url)
    assert holder is not None, "nobody holds the lease"
    assert holder.pid == pid


async def create_lease_bucket(nats_url: str, ttl_s: float | None) -> None:
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().create_key_value(bucket=LEASE_BUCKET, history=1, ttl=ttl_s)
    finally:
        await nc.close()


async def consumer_created(nats_url: str) -> object:
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().consumer_info("KVHANDOFF_IN", "kvhandoff-worker")
        return info.created
    finally:
        await nc.close()


async def handled(engines: ScriptedEngines) -> None:
    """A handoff goes all the way through whichever worker consumes the stream."""
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    await engines.start_handoff(start)
    await engines.wait_complete({start.handoff_id}, within=30)


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
    worker = launch(f"nats://127.0.0.1:{port}", tmp_path / "kvhandoff.db",
                    "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port))  # fmt: skip
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


@pytest.mark.parametrize("tier", [False, True], ids=["single", "tier"])
def test_sigterm_while_jetstream_does_not_answer_exits_0_promptly(
    servers: Callable[[str], EmbeddedNats], launch: Callable[..., Child], tmp_path: Path,
    tier: bool,
) -> None:  # fmt: skip
    # The server drops this user's JetStream requests (the lease, the stream; the tier's
    # set-up), so each waits out its timeout; core NATS works.
    server = servers(
        "authorization { users = [ { user: worker, password: secret,"
        ' permissions: { publish: { deny: "$JS.API.>" } } } ] }'
    )
    flags, working = worker_mode(tier, tmp_path)
    worker = launch(server.url, tmp_path / "kvhandoff.db", *flags,
                    "--nats-user", "worker", "--nats-password", "secret")  # fmt: skip
    wait_for_log(worker, "(?i)permissions violation")

    assert terminate_within(worker, PROMPTLY_S) == 0
    assert working not in full_log(worker)


@pytest.mark.parametrize("tier", [False, True], ids=["single", "tier"])
def test_sigterm_while_reconnecting_exits_0_promptly(
    nats_server: EmbeddedNats, launch: Callable[..., Child], tmp_path: Path, tier: bool
) -> None:
    flags, working = worker_mode(tier, tmp_path)
    worker = launch(nats_server.url, tmp_path / "kvhandoff.db", *flags)
    wait_for_log(worker, working)
    nats_server.stop()
    deadline = time.monotonic() + 20
    while "disconnected from NATS" not in worker.logs():
        assert time.monotonic() < deadline, worker.logs()
        time.sleep(0.05)  # polling the worker's log

    assert terminate_within(worker, PROMPTLY_S) == 0


# --- One worker per stream and consumer -----------------------------------------------------


async def test_a_second_worker_exits_2_naming_the_first_and_leaves_its_consumer_alone(
    nats_server: EmbeddedNats, worker: WorkerProcess, engines: ScriptedEngines, tmp_path: Path
) -> None:
    created = await consumer_created(nats_server.url)
    assert worker.process is not None

    second = await asyncio.to_thread(run_to_exit, nats_server.url, tmp_path / "second.db")

    assert second.returncode == 2, second.stderr
    [line] = error_lines(second.stderr)
    assert "cannot start: stream KVHANDOFF_IN / consumer kvhandoff-worker is consumed by" in line
    assert f"pid {worker.process.pid} on {socket.gethostname()}" in line
    assert f"with log {worker.db.resolve()}" in line
    # The first worker keeps its consumer, and keeps consuming.
    assert await consumer_created(nats_server.url) == created
    await handled(engines)
    await assert_lease_held_by(nats_server.url, worker.process.pid)
    # A worker that creates the bucket gives it the default TTL.
    nc = await nats.connect(nats_server.url)
    try:
        status = await (await nc.jetstream().key_value(LEASE_BUCKET)).status()
        assert status.ttl == LEASE_TTL_S
    finally:
        await nc.close()


async def test_a_worker_restarted_after_sigkill_takes_its_lease_over_at_once(
    nats_server: EmbeddedNats, tmp_path: Path, engines: ScriptedEngines
) -> None:
    # A TTL far longer than the test: only a takeover lets the restarted worker start.
    await create_lease_bucket(nats_server.url, ttl_s=300)
    worker = WorkerProcess(nats_server.url, tmp_path / "kvhandoff.db")
    try:
        await asyncio.to_thread(worker.start)
        assert worker.process is not None
        first_pid = worker.process.pid
        worker.kill()

        await asyncio.to_thread(worker.start)

        assert worker.process.pid != first_pid
        assert f"took over the lease on KVHANDOFF_IN / kvhandoff-worker from pid {first_pid}" in (
            worker.logs()
        )
        await assert_lease_held_by(nats_server.url, worker.process.pid)
        await handled(engines)
    finally:
        worker.stop()


async def test_a_worker_on_another_log_takes_the_lease_once_the_dead_holders_expired(
    nats_server: EmbeddedNats, tmp_path: Path, engines: ScriptedEngines
) -> None:
    await create_lease_bucket(nats_server.url, ttl_s=SHORT_TTL_S)
    first = WorkerProcess(nats_server.url, tmp_path / "first.db")
    second = WorkerProcess(nats_server.url, tmp_path / "second.db")
    try:
        await asyncio.to_thread(first.start)
        assert first.process is not None
        first.kill()
        await assert_lease_held_by(
            nats_server.url, first.process.pid
        )  # dead, but its lease lives on for the TTL

        await asyncio.to_thread(second.start)  # as a new container would, on another host

        assert second.process is not None
        assert (
            f"the lease on KVHANDOFF_IN / kvhandoff-worker is held by pid {first.process.pid}"
            in (second.logs())
        )
        await assert_lease_held_by(nats_server.url, second.process.pid)
        await handled(engines)
    finally:
        second.stop()


async def test_a_worker_that_lost_its_lease_stops_and_exits_1(
    nats_server: EmbeddedNats, tmp_path: Path, engines: ScriptedEngines
) -> None:
    await create_lease_bucket(nats_server.url, ttl_s=SHORT_TTL_S)
    zombie = WorkerProcess(nats_server.url, tmp_path / "zombie.db")
    successor = WorkerProcess(nats_server.url, tmp_path / "successor.db")
    try:
        await asyncio.to_thread(zombie.start)
        assert zombie.process is not None
        zombie.process.send_signal(signal.SIGSTOP)
        await asyncio.to_thread(successor.start)  # once the zombie's lease expired
        assert successor.process is not None

        zombie.process.send_signal(signal.SIGCONT)

        try:
            # It stops at its first refresh; on a loaded machine its connection, stale after
            # the pause, may have to be made again first.
            code = await asyncio.to_thread(zombie.process.wait, 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the zombie still runs 60 s after SIGCONT: {full_log(zombie)}")
        assert code == 1, zombie.logs()
        [line] = error_lines(zombie.logs())
        assert "stopped consuming KVHANDOFF_IN: lost the lease" in line
        assert f"pid {successor.process.pid}" in line
        assert successor.healthy()
        await handled(engines)
    finally:
        zombie.stop()
        successor.stop()


async def test_a_worker_that_stops_releases_its_lease(
    nats_server: EmbeddedNats, worker: WorkerProcess
) -> None:
    assert await lease_holder(nats_server.url) is not None

    assert await asyncio.to_thread(worker.terminate) == 0

    assert await lease_holder(nats_server.url) is None  # released, not left to expire


async def test_a_lease_that_expired_while_nats_was_away_is_taken_again(
    nats_server: EmbeddedNats, tmp_path: Path, engines: ScriptedEngines
) -> None:
    await create_lease_bucket(nats_server.url, ttl_s=SHORT_TTL_S)
    worker = WorkerProcess(nats_server.url, tmp_path / "kvhandoff.db")
    try:
        await asyncio.to_thread(worker.start)
        assert worker.process is not None
        nats_server.stop()
        # Time must pass for the lease to outlive its TTL; there is nothing to wait on.
        await asyncio.sleep(SHORT_TTL_S + 1)
        nats_server.start()

        deadline = time.monotonic() + 20
        while "had expired; took it again" not in worker.logs():
            assert worker.process.poll() is None, worker.logs()
            assert time.monotonic() < deadline, worker.logs()
            await asyncio.sleep(0.1)  # polling the worker's log
        await assert_lease_held_by(nats_server.url, worker.process.pid)
        await handled(engines)
    finally:
        worker.stop()


def test_a_lease_bucket_without_a_ttl_is_refused(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    asyncio.run(create_lease_bucket(nats_server.url, ttl_s=None))

    result = run_to_exit(nats_server.url, tmp_path / "kvhandoff.db")

    assert result.returncode == 1, result.stderr
    [line] = error_lines(result.stderr)
    assert f"lease bucket {LEASE_BUCKET} has no TTL" in line


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
