"""Fixtures for the container suite: the whole stack in Docker, built from this checkout.

- `docker_images` (session): skips the suite, with the reason, when no Docker daemon answers;
  otherwise runs `deploy/build-images.sh` once, so the containers run the code of this checkout
  and never an image left over from an earlier build. A cached run takes seconds: the wheel is
  byte-identical for identical sources, so Docker reuses every layer. Set
  `KVHANDOFF_SKIP_IMAGE_BUILD=1` to use images built beforehand (by a CI step of their own, or
  where PyPI, which the wheel build needs, is unreachable).
- No registry is reachable here, so testcontainers' reaper (Ryuk) is off. Every fixture removes
  its containers, and the session removes whatever is still labelled with its testcontainers
  session id (a container whose start failed half-way, say).
- `nats`, `workers` / `worker`, `engines` and `loads` start the containers of
`worker.harness.containers`
  on one network. Loads run `kvhandoff load --json -` in a container, so the report arrives on
  its stdout and the exit code says whether every handoff ended with no leak.
"""

from __future__ import annotations

import os

# Before testcontainers reads its configuration (at the first container start).
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

import gc
import re
import sqlite3
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import docker
import docker.errors
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from testcontainers.core.labels import LABEL_SESSION_ID, SESSION_ID

from kvhandoff.worker.harness.containers import (
    KvhandoffCommandContainer,
    KvhandoffWorkerContainer,
    MockEnginesContainer,
    NatsContainer,
)
from kvhandoff.worker.loadgen.generator import LoadReport
from tests.conftest import SUMMARY

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "deploy" / "build-images.sh"
BUILD_TIMEOUT_S = 1200.0  # a first build debootstraps the base image

# Modelled prefill, transfer and decode times divided by this: a handoff takes milliseconds.
ENGINE_ARGS = ("--speedup", "10")
# Republish unanswered actions after 1 s (default 5 s), so recoveries finish quickly.
WORKER_ARGS = ("--retry-interval", "1s")

_build_seconds = pytest.StashKey[float]()


@pytest.fixture(scope="session")
def docker_images(request: pytest.FixtureRequest) -> Iterator[None]:
    """Docker answers and the images are built from this checkout; skip the suite otherwise."""
    client, unavailable = _connect_docker()
    if client is None:
        pytest.skip(f"Docker is not available: {unavailable}")
    try:
        if os.environ.get("KVHANDOFF_SKIP_IMAGE_BUILD") != "1":
            request.config.stash[_build_seconds] = _build_images()
        yield
    finally:
        _remove_leftovers(client)
        client.close()


def _connect_docker() -> tuple[Any, str]:
    """A client of the Docker daemon, or None and the reason why there is none."""
    # A failed docker.from_env() leaves the socket of its version probe to the garbage
    # collector, whose ResourceWarning would fail the run (warnings are errors).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            client = docker.from_env()
            client.ping()
        except (docker.errors.DockerException, OSError) as exc:
            unavailable = str(exc)
        else:
            return client, ""
        gc.collect()
    return None, unavailable


def _build_images() -> float:
    began = time.monotonic()
    try:
        build = subprocess.run(
            [str(BUILD_SCRIPT)],
            # The wheels must be built by a CPython 3.11, like the image's.
            env={**os.environ, "PYTHON": sys.executable},
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{BUILD_SCRIPT} did not finish in {BUILD_TIMEOUT_S:.0f}s: {exc.output!r}")
    if build.returncode != 0:
        output = (build.stdout + build.stderr)[-4000:]
        pytest.fail(f"{BUILD_SCRIPT} failed with exit code {build.returncode}:\n{output}")
    return time.monotonic() - began


def _remove_leftovers(client: Any) -> None:
    label = {"label": f"{LABEL_SESSION_ID}={SESSION_ID}"}
    for container in client.containers.list(all=True, filters=label):
        container.remove(force=True, v=True)
    for network in client.networks.list(filters=label):
        network.remove()


@pytest.fixture(autouse=True)
def _report_the_build(request: pytest.FixtureRequest) -> None:
    """The first test after the images were built reports how long that took (tests/conftest.py
    prints it at the end of the run)."""
    seconds = request.config.stash.get(_build_seconds, None)
    if seconds is not None:
        del request.config.stash[_build_seconds]
        line = f"container images: deploy/build-images.sh took {seconds:.0f}s"
        request.node.user_properties.append((SUMMARY, line))


# --- The stack ----------------------------------------------------------------------------


@pytest.fixture
def nats(docker_images: None) -> Iterator[NatsContainer]:
    with NatsContainer() as container:
        yield container


class Workers:
    """Starts worker containers on one NATS and removes them all at teardown."""

    def __init__(self, nats: NatsContainer, data_dir: Path) -> None:
        self.nats = nats
        self.data_dir = data_dir
        self.started: list[KvhandoffWorkerContainer] = []

    def start(self) -> KvhandoffWorkerContainer:
        """A worker on `data_dir`, healthy: every worker of a test shares one event log."""
        worker = KvhandoffWorkerContainer(self.nats, *WORKER_ARGS, data_dir=self.data_dir)
        self.started.append(worker)
        worker.start()
        return worker

    def stop_all(self) -> None:
        for worker in self.started:
            worker.stop()


@pytest.fixture
def workers(nats: NatsContainer, tmp_path: Path) -> Iterator[Workers]:
    data_dir = tmp_path / "worker"
    data_dir.mkdir()
    started = Workers(nats, data_dir)
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture
def worker(workers: Workers) -> KvhandoffWorkerContainer:
    return workers.start()


@pytest.fixture
def engines(nats: NatsContainer) -> Iterator[MockEnginesContainer]:
    with MockEnginesContainer(nats, *ENGINE_ARGS) as container:
        yield container


class Loads:
    """`kvhandoff load` runs in containers on one NATS, removed at teardown."""

    def __init__(self, nats: NatsContainer) -> None:
        self.nats = nats
        self.started: list[KvhandoffCommandContainer] = []

    def start(self, handoffs: int, *args: str) -> KvhandoffCommandContainer:
        load = KvhandoffCommandContainer(
            self.nats, "load", "--handoffs", str(handoffs), "--json", "-", "--quiet", *args
        )
        self.started.append(load)
        load.start()
        return load

    def finish(self, load: KvhandoffCommandContainer, timeout_s: float = 240.0) -> LoadReport:
        """Wait for the run to end; its report, checked against its exit code."""
        code = load.wait_exit(timeout_s)
        try:
            report = msgspec.json.decode(load.stdout(), type=LoadReport)
        except msgspec.DecodeError as exc:
            pytest.fail(f"load exited {code} without a report ({exc}); its log:\n{load.logs()}")
        assert code == (0 if report.ok else 1), f"load exited {code} for {report}"
        return report

    def stop_all(self) -> None:
        for load in self.started:
            load.stop()


@pytest.fixture
def loads(nats: NatsContainer) -> Iterator[Loads]:
    started = Loads(nats)
    try:
        yield started
    finally:
        started.stop_all()


# --- Observing the stack ------------------------------------------------------------------


def wait_until(
    condition: Callable[[], bool],
    what: str,
    timeout_s: float = 60.0,
    context: Callable[[], str] = lambda: "",
) -> None:
    """Poll another process's observable state until `condition` holds; fail after
    `timeout_s`, naming `what` and adding `context()`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f}s\n{context()}")
        time.sleep(0.1)  # polling a container's state, not ordering our own work


def completed_handoffs(worker: KvhandoffWorkerContainer) -> int:
    """`kvhandoff_handoffs_completed_total`, over every completion, from the worker's metrics."""
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(worker.metrics())
            for sample in family.samples
            if sample.name == "kvhandoff_handoffs_completed_total"
        )
    )


def recovered_open_handoffs(worker: KvhandoffWorkerContainer) -> int:
    """How many open handoffs the worker rebuilt from its log when it claimed the partition.
    A worker started beside a dead one's membership is healthy before it claims (its share is
    empty until that membership expires), so its claim is waited for."""
    pattern = re.compile(r"recovered (\d+) open handoffs")
    wait_until(
        lambda: pattern.search(worker.logs()) is not None, "the worker's claim", context=worker.logs
    )
    found = pattern.search(worker.logs())
    assert found is not None
    return int(found.group(1))


def handoff_states(db_path: Path) -> Counter[str]:
    """Handoffs per state (open, succeeded, canceled) in a worker's event log."""
    with closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as connection:
        rows = connection.execute("SELECT state, count(*) FROM handoffs GROUP BY state")
        return Counter({state: count for state, count in rows})
