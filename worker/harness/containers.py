"""Containers for integration tests: NATS with JetStream, the kvhandoff worker, mock engines.

For projects that talk to kvhandoff over the bus (frontends, engines) and want the real thing
in their tests. Each class is a testcontainers `DockerContainer` that starts, waits until it is
ready, and exposes what a test needs:

    NatsContainer             `url` (from the host), `internal_url` (from containers on its
                              network), `monitoring_url` (/healthz, /jsz); `restart()`
    KvhandoffWorkerContainer  `db_path` (the SQLite event log, on the host), `metrics_url`,
                              `healthy()`, `metrics()`; `kill()` (SIGKILL), `terminate()` (drain)
    MockEnginesContainer      `kvhandoff engines`: the mock prefill and decode engines
    KvhandoffCommandContainer any other `kvhandoff` command, such as a `load` run

Requirements. The `testcontainers` package (in kvhandoff's `[dev]` extra, or
`pip install 'testcontainers>=4.8'`); `import worker` and the `kvhandoff` command never import
this module. A Docker daemon, and the images built locally by `deploy/build-images.sh`
(`kvhandoff-nats:local`, `kvhandoff:local`): nothing is pulled. Re-run that script after
changing kvhandoff's code, or the containers run the old code. Where no registry is reachable,
testcontainers' reaper image (Ryuk) cannot be pulled either: set
`TESTCONTAINERS_RYUK_DISABLED=true` and stop every container yourself, as `with` does.

Example, a test module of a downstream project (a frontend) that starts one handoff::

    import asyncio
    import os
    import sqlite3
    import uuid

    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")  # before the first start

    from kvhandoff.events.codec import decode_action, encode
    from kvhandoff.events.messages import Action, EngineType, StartHandoff
    from kvhandoff.events.subjects import Subjects
    from kvhandoff.worker.bus.connection import Bus, Message
    from kvhandoff.worker.bus.settings import NatsSettings
    from kvhandoff.worker.harness.containers import (
        KvhandoffWorkerContainer,
        MockEnginesContainer,
        NatsContainer,
    )

    def test_a_handoff_completes() -> None:
        with (
            NatsContainer() as bus,  # on a network of its own
            KvhandoffWorkerContainer(bus) as worker,  # healthy: connected, serving its share
            MockEnginesContainer(bus, "--speedup", "10"),  # vllm-prefill-0, ...
        ):
            start = StartHandoff(
                uuid.uuid4(), EngineType.VLLM, "vllm-prefill-0", "vllm-decode-0", 30_000
            )
            complete = asyncio.run(hand_off(bus.url, start))
            assert complete.completion == "success"
            worker.terminate()  # drain, then read the event log on the host
            with sqlite3.connect(worker.db_path) as log:
                assert log.execute("SELECT state FROM handoffs").fetchall() == [("succeeded",)]

    async def hand_off(url: str, start: StartHandoff) -> Action:
        # Publish a StartHandoff as a frontend does, and wait for its Complete.
        frontend = await Bus.connect(NatsSettings(url=url), "frontend")
        subjects = Subjects()
        done: asyncio.Queue[Message] = asyncio.Queue()
        try:
            await frontend.subscribe(subjects.done(start.handoff_id), done.put)
            await frontend.publish_durable(subjects.input(start.handoff_id), encode(start))
            return decode_action((await asyncio.wait_for(done.get(), 30)).data)
        finally:
            await frontend.close()

The worker's data directory is bind-mounted from the host so that `db_path` is an ordinary
file there. Pass `data_dir=` to choose it (and to start a second worker container on the log
of a killed one); without it a temporary directory is made and removed by `stop()`. The image
runs as uid 10001. When the tests run as root, the directory is chowned to 10001, so the worker
runs as the image's own user and root still reads everything. Otherwise the container runs as
the calling user's uid and gid instead, because a non-root user cannot chown to 10001 and could
not then open the log files (SQLite's -wal and -shm) that uid 10001 had created.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import docker.errors
from testcontainers.core.container import DockerContainer
from testcontainers.core.network import Network
from testcontainers.core.waiting_utils import WaitStrategy, WaitStrategyTarget

from kvhandoff.worker.errors import WorkerError
from kvhandoff.worker.harness.health import answers_ok

__all__ = [
    "NATS_IMAGE",
    "WORKER_IMAGE",
    "ContainerError",
    "KvhandoffCommandContainer",
    "KvhandoffWorkerContainer",
    "MockEnginesContainer",
    "NatsContainer",
]

NATS_IMAGE = "kvhandoff-nats:local"
WORKER_IMAGE = "kvhandoff:local"

NATS_PORT = 4222
NATS_MONITOR_PORT = 8222
METRICS_PORT = 9464
# The image's fixed user (deploy/Dockerfile), which must own the bind-mounted /data.
IMAGE_UID = 10001
DB_IN_CONTAINER = "/data/kvhandoff.db"

_POLL_S = 0.1
_ALIVE = frozenset({"created", "running", "restarting"})


class ContainerError(WorkerError):
    """A test container's image is missing, or the container exited or was not ready in time.
    The message carries the end of the container's log."""


class _Readiness(WaitStrategy):
    """Polls `check` until it holds; fails at once, with the container's log, if the container
    exits, and after `timeout_s` otherwise. (testcontainers' HttpWaitStrategy keeps polling a
    container that has already exited, until its whole timeout has passed.)"""

    def __init__(self, what: str, check: Callable[[], bool], timeout_s: float) -> None:
        super().__init__()
        self._what = what
        self._check = check
        self.with_startup_timeout(int(timeout_s))

    def _checks(self) -> bool:
        try:
            return self._check()
        except (ConnectionError, KeyError):
            # Docker has not (re)published the port yet, or the container is between networks
            # (its inspect data lacks the network that its host address is looked up in).
            return False

    def wait_until_ready(self, container: WaitStrategyTarget) -> None:
        deadline = time.monotonic() + self._startup_timeout
        wrapped = container.get_wrapped_container()
        while True:
            wrapped.reload()
            if wrapped.status not in _ALIVE:
                code = wrapped.attrs["State"]["ExitCode"]
                raise ContainerError(
                    f"{self._what}: the container stopped ({wrapped.status}, exit code {code}) "
                    f"before it was ready; its log ends:\n{_tail(wrapped)}"
                )
            if wrapped.status == "running" and self._checks():
                return
            if time.monotonic() > deadline:
                raise ContainerError(
                    f"{self._what}: not ready within {self._startup_timeout:.0f}s; "
                    f"its log ends:\n{_tail(wrapped)}"
                )
            time.sleep(_POLL_S)  # polling another process's state, with a deadline


def _tail(wrapped: Any, lines: int = 40) -> str:
    return bytes(wrapped.logs(tail=lines)).decode(errors="replace")


class _KvhandoffContainer(DockerContainer):
    """What every container here shares: a local image that must exist (nothing is pulled),
    readiness that is checked again after a restart, and log and exit helpers."""

    _readiness: _Readiness | None = None

    def start(self) -> Self:
        try:
            self.get_docker_client().client.images.get(self.image)
        except docker.errors.ImageNotFound as exc:
            raise ContainerError(
                f"image {self.image} not found; build it with deploy/build-images.sh "
                "(nothing is pulled from a registry)"
            ) from exc
        return super().start()

    def wait_ready(self) -> None:
        """Return once the container is ready again (after a restart or a reconnect)."""
        if self._readiness is not None:
            self._readiness.wait_until_ready(self)

    def logs(self) -> str:
        """Everything the container wrote so far, stdout and stderr interleaved."""
        return bytes(self.get_wrapped_container().logs()).decode(errors="replace")

    def signal(self, name: str = "SIGKILL") -> None:
        """Send a signal to the container's main process (`docker kill`)."""
        self.get_wrapped_container().kill(signal=name)

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        """The exit code, once the container has stopped; ContainerError after `timeout_s`."""
        wrapped = self.get_wrapped_container()
        deadline = time.monotonic() + timeout_s
        while True:
            wrapped.reload()
            if wrapped.status in ("exited", "dead"):
                return int(wrapped.attrs["State"]["ExitCode"])
            if time.monotonic() > deadline:
                raise ContainerError(
                    f"{self.image}: still {wrapped.status} after {timeout_s:.0f}s; "
                    f"its log ends:\n{_tail(wrapped)}"
                )
            time.sleep(_POLL_S)  # polling another process's state, with a deadline

    def _mapped_url(self, scheme: str, port: int) -> str:
        # Looked up on every call: Docker maps a new host port after a restart or a network
        # reconnect.
        return f"{scheme}://{self.get_container_host_ip()}:{self.get_exposed_port(port)}"


class NatsContainer(_KvhandoffContainer):
    """nats-server with JetStream (deploy/nats.Dockerfile), ready once /healthz answers 200,
    which includes JetStream.

    Joins `network` under `alias`; without a network it creates one, removed by `stop()`.
    Its JetStream store is the image's /data volume, kept across `restart()` and deleted by
    `stop()`.
    """

    def __init__(
        self,
        image: str = NATS_IMAGE,
        *,
        network: Network | None = None,
        alias: str = "nats",
        startup_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(image)
        self.alias = alias
        self._given_network = network
        self._own_network: Network | None = None
        self.with_exposed_ports(NATS_PORT, NATS_MONITOR_PORT)
        self._readiness = _Readiness(
            f"NATS ({image})",
            lambda: answers_ok(f"{self.monitoring_url}/healthz"),
            startup_timeout_s,
        )
        self.waiting_for(self._readiness)

    @property
    def network(self) -> Network:
        """The network that other containers join to reach `internal_url`."""
        network = self._given_network or self._own_network
        if network is None:
            raise ContainerError("NATS container: not started, so it has no network yet")
        return network

    @property
    def url(self) -> str:
        """The client URL from the host (the mapped port)."""
        return self._mapped_url("nats", NATS_PORT)

    @property
    def internal_url(self) -> str:
        """The client URL from containers on `network`."""
        return f"nats://{self.alias}:{NATS_PORT}"

    @property
    def monitoring_url(self) -> str:
        """The HTTP monitoring endpoint from the host: /healthz, /varz, /jsz, /connz."""
        return self._mapped_url("http", NATS_MONITOR_PORT)

    def start(self) -> Self:
        if self._given_network is None:
            self._own_network = Network().create()
        self.with_network(self.network).with_network_aliases(self.alias)
        return super().start()

    def restart(self, timeout_s: int = 10) -> None:
        """`docker restart` (SIGTERM, SIGKILL after `timeout_s`), then wait until ready.
        The host port changes: read `url` again."""
        self.get_wrapped_container().restart(timeout=timeout_s)
        self.wait_ready()

    def stop(self, force: bool = True, delete_volume: bool = True) -> None:
        try:
            super().stop(force=force, delete_volume=delete_volume)
        finally:
            if self._own_network is not None:
                self._own_network.remove()
                self._own_network = None


class KvhandoffWorkerContainer(_KvhandoffContainer):
    """`kvhandoff run` on the network of `nats`, with its event log in a host directory
    (see the module docstring for `data_dir` and ownership). Ready once /healthz answers 200:
    the worker is connected to NATS and serves its share of the tier (`healthy`).

    `args` are added to the `run` command line (for example `--retry-interval 1s`). `user`
    ("uid:gid") overrides who the worker runs as, and then `data_dir` is left as it is.
    """

    def __init__(
        self,
        nats: NatsContainer,
        *args: str,
        image: str = WORKER_IMAGE,
        data_dir: Path | None = None,
        user: str | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(image)
        self._nats = nats
        self._given_data_dir = data_dir
        self._own_data_dir: Path | None = None
        self.with_command(["run", "--nats-url", nats.internal_url, "--db", DB_IN_CONTAINER, *args])
        self.with_exposed_ports(METRICS_PORT)
        # The worker listens on loopback unless told otherwise; the host must reach it.
        self.with_env("KVHANDOFF_METRICS_HOST", "0.0.0.0")
        if user is None and os.geteuid() != 0:
            user = f"{os.getuid()}:{os.getgid()}"
        self._chown = user is None  # as root: keep the image's user and hand it the directory
        if user is not None:
            self.with_kwargs(user=user)
        self._readiness = _Readiness(
            f"kvhandoff worker ({image})",
            lambda: answers_ok(f"{self.metrics_url}/healthz"),
            startup_timeout_s,
        )
        self.waiting_for(self._readiness)

    @property
    def data_dir(self) -> Path:
        """The host directory mounted on /data."""
        data_dir = self._given_data_dir or self._own_data_dir
        if data_dir is None:
            raise ContainerError("worker container: not started, so it has no data directory")
        return data_dir

    @property
    def db_path(self) -> Path:
        """The worker's SQLite event log, on the host. Read it while the worker runs with
        `sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)`, or after `terminate()`."""
        return self.data_dir / Path(DB_IN_CONTAINER).name

    @property
    def metrics_url(self) -> str:
        """The worker's metrics server from the host: /metrics (Prometheus), /healthz."""
        return self._mapped_url("http", METRICS_PORT)

    def healthy(self) -> bool:
        """Whether /healthz answers 200 now: connected to NATS, and serving every partition of
        its share (claimed and recovered; a worker started beside a dead one's unexpired
        membership has an empty share until it expires)."""
        return answers_ok(f"{self.metrics_url}/healthz")

    def metrics(self) -> str:
        """The Prometheus exposition text of /metrics."""
        with urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=5) as response:
            return bytes(response.read()).decode()

    def kill(self) -> None:
        """SIGKILL the worker (a crash); the container and its data directory stay."""
        self.signal("SIGKILL")
        self.wait_exit()

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM: the worker drains (finishes the batch in hand, commits, acks) and exits;
        returns the exit code (0 after a clean drain)."""
        self.signal("SIGTERM")
        return self.wait_exit(timeout_s)

    def start(self) -> Self:
        self.with_network(self._nats.network)
        if self._given_data_dir is None:
            self._own_data_dir = Path(tempfile.mkdtemp(prefix="kvhandoff-worker-"))
        if self._chown:
            os.chown(self.data_dir, IMAGE_UID, IMAGE_UID)
        self.with_volume_mapping(self.data_dir, "/data", "rw")
        return super().start()

    def stop(self, force: bool = True, delete_volume: bool = True) -> None:
        try:
            super().stop(force=force, delete_volume=delete_volume)
        finally:
            if self._own_data_dir is not None:
                shutil.rmtree(self._own_data_dir, ignore_errors=True)
                self._own_data_dir = None


class KvhandoffCommandContainer(_KvhandoffContainer):
    """Any `kvhandoff COMMAND --nats-url <nats.internal_url> ARGS...` on the network of `nats`,
    such as a `load` run: started, not waited for. `wait_exit()` gives its exit code and
    `stdout()` what it printed (`load --json -` prints its report there, logs go to stderr).
    """

    def __init__(
        self, nats: NatsContainer, command: str, *args: str, image: str = WORKER_IMAGE
    ) -> None:
        super().__init__(image)
        self._nats = nats
        self.with_command([command, "--nats-url", nats.internal_url, *args])
        # The image's HEALTHCHECK probes the worker's endpoint, which this process lacks.
        self.with_kwargs(healthcheck={"test": ["NONE"]})

    def start(self) -> Self:
        self.with_network(self._nats.network)
        return super().start()

    def stdout(self) -> str:
        """What the command printed on stdout so far."""
        logs = self.get_wrapped_container().logs(stdout=True, stderr=False)
        return bytes(logs).decode(errors="replace")

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then the exit code."""
        self.signal("SIGTERM")
        return self.wait_exit(timeout_s)


class MockEnginesContainer(KvhandoffCommandContainer):
    """`kvhandoff engines`: the mock prefill and decode engines, ready once subscribed. `args`
    go to its command line (roster, `--speedup`, faults: `kvhandoff engines --help`).
    `terminate()` stops them; they print their accounting and exit 0 only if no engine holds
    anything for a handoff that the worker completed (a leak).
    """

    def __init__(
        self,
        nats: NatsContainer,
        *args: str,
        image: str = WORKER_IMAGE,
        startup_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(nats, "engines", *args, image=image)
        self._readiness = _Readiness(
            f"kvhandoff engines ({image})",
            lambda: "mock engines listening" in self.logs(),
            startup_timeout_s,
        )
        self.waiting_for(self._readiness)
