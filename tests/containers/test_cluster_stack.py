"""deploy/compose.cluster.yaml, as an operator runs it: three NATS nodes clustered, three
workers of a tier of 16 partitions, the mock engines and a load, each in its own container,
every kvhandoff process given all three nodes' URLs.

The load ends every handoff with a Complete and no engine leaks (its exit status says so, and
the engines' own at their stop), and each worker's partition files re-derive what they log
(`kvhandoff verify` on its data directory). Then a worker container is killed (SIGKILL): the
two left own all 16 partitions again, by their metrics.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import docker
import docker.errors
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvhandoff.worker.harness.natsserver import free_ports
from tests.containers.conftest import ROOT, wait_until

pytestmark = pytest.mark.containers

COMPOSE_FILE = ROOT / "deploy" / "compose.cluster.yaml"
PARTITIONS = 16  # the file's --partitions
WORKERS = ("worker-1", "worker-2", "worker-3")
HANDOFFS = 300
UP_TIMEOUT_S = 180.0  # `up` waits for the workers' healthchecks before it starts the load
LOAD_TIMEOUT_S = 120.0


def compose_command() -> list[str]:
    """Compose v2 (`docker compose`) if the Docker CLI has it, else v1 (`docker-compose`)."""
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if v2.returncode == 0:
        return ["docker", "compose"]
    v1 = shutil.which("docker-compose")
    if v1 is None:
        pytest.fail("Docker answers, but neither `docker compose` nor `docker-compose` exists")
    return [v1]


class ComposeProject:
    """One `up` of deploy/compose.cluster.yaml under a project name of its own (so that it
    meets no other run's containers, volumes or network), on free loopback ports."""

    def __init__(self) -> None:
        self.name = f"kvhandoff-cluster-{uuid.uuid4().hex[:8]}"
        ports = free_ports(6)
        self.metrics_ports = dict(zip(WORKERS, ports[:3], strict=True))
        self.env = {
            **os.environ,
            "LOAD_HANDOFFS": str(HANDOFFS),
            **{f"WORKER_{i + 1}_METRICS_PORT": str(p) for i, p in enumerate(ports[:3])},
            **{f"NATS_{i + 1}_MONITOR_PORT": str(p) for i, p in enumerate(ports[3:])},
        }
        self._command = [*compose_command(), "-p", self.name, "-f", str(COMPOSE_FILE)]
        self._docker = docker.from_env()

    def run(self, *args: str, timeout_s: float) -> None:
        done = subprocess.run(
            [*self._command, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        assert done.returncode == 0, f"compose {args}: {done.stdout}{done.stderr}\n{self.logs()}"

    def container(self, service: str) -> Any:
        labels = [
            f"com.docker.compose.project={self.name}",
            f"com.docker.compose.service={service}",
        ]
        (found,) = self._docker.containers.list(all=True, filters={"label": labels})
        return found

    def logs(self, *services: str) -> str:
        """The end of each service's log, for a failure's message."""
        tails = []
        for service in services or ("load", "engines", *WORKERS):
            try:
                tail = self.container(service).logs(tail=40).decode(errors="replace")
            except (ValueError, docker.errors.DockerException):
                continue  # not created
            tails.append(f"--- {service}\n{tail}")
        return "\n".join(tails)

    def owned(self, worker: str) -> int:
        """`kvhandoff_owned_partitions` from the worker's /metrics."""
        url = f"http://127.0.0.1:{self.metrics_ports[worker]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = bytes(r.read()).decode()
        return int(
            sum(
                s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "kvhandoff_owned_partitions"
            )
        )

    def close(self) -> None:
        try:
            self.run("down", "--volumes", "--remove-orphans", "-t", "5", timeout_s=120)
        finally:
            self._docker.close()


@pytest.fixture
def cluster(docker_images: None) -> Iterator[ComposeProject]:
    project = ComposeProject()
    try:
        yield project
    finally:
        project.close()


def test_the_cluster_compose_file_runs_a_load_and_survives_a_worker_kill(
    cluster: ComposeProject,
) -> None:
    cluster.run("up", "-d", timeout_s=UP_TIMEOUT_S)

    load = cluster.container("load")
    code = load.wait(timeout=LOAD_TIMEOUT_S)["StatusCode"]
    assert code == 0, f"the load exited {code}: not every handoff ended, or leaks\n{cluster.logs()}"
    engines = cluster.container("engines")
    engines.stop(timeout=30)  # SIGTERM: they report their leaks, and exit 1 if any
    engines.reload()
    assert engines.attrs["State"]["ExitCode"] == 0, cluster.logs("engines")
    for worker in WORKERS:
        verified = cluster.container(worker).exec_run(["kvhandoff", "verify", "/data"])
        assert verified.exit_code == 0, f"{worker}: {verified.output.decode(errors='replace')}"
    assert sum(cluster.owned(w) for w in WORKERS) == PARTITIONS

    killed = cluster.container("worker-1")
    killed.kill()  # SIGKILL, no hand-over; its restart policy leaves a killed container be
    left = WORKERS[1:]
    wait_until(
        lambda: sum(cluster.owned(w) for w in left) == PARTITIONS,
        "the two workers left own every partition",
        timeout_s=60,
        context=lambda: cluster.logs(*left),
    )
    killed.reload()
    assert killed.status == "exited"
