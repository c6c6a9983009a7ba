"""Fixtures for the scale-out tests: a real three-node JetStream cluster of nats-server
processes on loopback (`worker.harness.natsserver.NatsCluster`), a `Bus` connected to all of it,
nats-py's JetStream beside it to observe and to play the other clients, and what the owner
and worker processes of the failover tests publish when they act."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Protocol

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.bus.streams import wait_jetstream
from kvhandoff.worker.harness.child import WorkerChild
from kvhandoff.worker.harness.natsserver import NatsCluster
from kvhandoff.worker.tier.membership import TierSettings
from kvhandoff.worker.tier.streams import open_partition_log
from tests import eventually
from tests.eventually import Condition
from tests.subscribed import registered

# What a step that should take milliseconds may take on a busy two-core machine, elections
# included.
WITHIN_S = 30.0
PARTITIONS = 4  # of the `kvhandoff run --partitions` workers


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """Three clustered nodes, formed (the meta group has a leader and all three peers)."""
    with NatsCluster(store_dir=tmp_path / "cluster") as cluster:
        yield cluster


@pytest.fixture
async def bus(nats_cluster: NatsCluster) -> AsyncIterator[Bus]:
    """A Bus given every node's URL, once JetStream answers through it."""
    bus = await Bus.connect(NatsSettings(url=nats_cluster.url), "test-cluster")
    await wait_jetstream(bus, WITHIN_S)
    yield bus
    await bus.close()


@pytest.fixture
async def other(nats_cluster: NatsCluster, bus: Bus) -> AsyncIterator[Bus]:
    """A second worker's Bus, for a partition's log written by two owners (the default tier's
    log stream, opened)."""
    settings = TierSettings(partitions=1)
    await open_partition_log(bus, settings.log_stream, settings.prefix)
    other = await Bus.connect(NatsSettings(url=nats_cluster.url), "test-other-owner")
    yield other
    await other.close()


@pytest.fixture
async def js(nats_cluster: NatsCluster) -> AsyncIterator[JetStreamContext]:
    """nats-py's JetStream on the cluster: the observer and the other clients."""
    nc = await nats.connect(
        nats_cluster.url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2
    )
    yield nc.jetstream()
    await nc.close()


async def publish(js: JetStreamContext, subject: str, payload: bytes) -> int:
    """A JetStream publish, retried while no stream answers (a stream just created in a
    cluster answers on every node only once its interest has spread over the routes; a stream
    whose leader died answers once another is elected), as the worker's own `publish_durable`
    retries; its stream sequence. Every attempt carries one message id, so it is stored once."""
    deadline = time.monotonic() + WITHIN_S
    headers = {"Nats-Msg-Id": uuid.uuid4().hex}
    while True:
        try:
            return (await js.publish(subject, payload, timeout=2, headers=headers)).seq
        except (
            nats.js.errors.NoStreamResponseError,
            nats.js.errors.ServiceUnavailableError,
            nats.errors.TimeoutError,
            TimeoutError,
        ):
            assert time.monotonic() < deadline, f"no stream took {subject} in {WITHIN_S}s"
            await asyncio.sleep(0.05)  # a bounded poll of the cluster's state


class Acted:
    """What the owners published after their appends: (owner, input stream sequence)."""

    def __init__(self) -> None:
        self.by: dict[str, list[int]] = defaultdict(list)
        self.first_at: dict[str, float] = {}
        self._at: list[float] = []  # when each arrived

    async def on(self, msg: Msg) -> None:
        name = msg.subject.rpartition(".")[2]
        now = time.monotonic()
        self.first_at.setdefault(name, now)
        self._at.append(now)
        self.by[name].append(int(msg.data))

    def longest_gap_s(self) -> float:
        """The longest time between two inputs applied, by anyone (for the report)."""
        return max((b - a for a, b in zip(self._at, self._at[1:], strict=False)), default=0.0)


@pytest.fixture
async def acted(nats_cluster: NatsCluster) -> AsyncIterator[Acted]:
    seen = Acted()
    nc = await nats.connect(nats_cluster.url.split(","))
    await nc.subscribe("kvhandoff.acted.*", cb=seen.on)
    await registered(nc)  # every act counts: the owners' first ones too
    yield seen
    await nc.close()


class TierWorker(WorkerChild):
    """`kvhandoff run --partitions 4` (worker.tier.service, or `partitions`) with its own data
    directory (`tmp / name`, or `data_dir`), and any further arguments of `run`."""

    def __init__(
        self,
        url: str,
        name: str,
        tmp: Path,
        *extra: str,
        partitions: int = PARTITIONS,
        data_dir: Path | None = None,
    ) -> None:
        self.data_dir = tmp / name if data_dir is None else data_dir
        self.data_dir.mkdir()
        super().__init__(
            url,
            tmp / f"{name}.db",
            "--partitions",
            str(partitions),
            "--data-dir",
            str(self.data_dir),
            *extra,
            log_path=tmp / f"{name}.log",
        )
        self.name = name

    def took_a_share(self) -> bool:
        """Whether its tier took partitions (from its log lines); fails if it died."""
        assert self.running(), f"{self.name} died: {self.logs()}"
        return re.search(r"taking \[\d", self.logs()) is not None

    def handed_over_a_share(self) -> bool:
        """Whether its tier handed partitions over to another worker; fails if it died."""
        assert self.running(), f"{self.name} died: {self.logs()}"
        return re.search(r"handing over \[\d", self.whole_log()) is not None

    def whole_log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logged(self, text: str) -> bool:
        """Whether its log holds `text`; fails if it died."""
        assert self.running(), f"{self.name} died: {self.logs()}"
        return text in self.whole_log()


@pytest.fixture
def workers() -> Iterator[list[TierWorker]]:
    """The tier workers a test starts, killed at its end if they still run."""
    started: list[TierWorker] = []
    yield started
    for worker in started:
        worker.stop()


class StatusChild:
    """A test module of tests/cluster run as a child process that writes its status as JSON:
    what the owner and tier tests start. (Its `process` is never None, unlike
    worker.harness.child's, which the waits here rely on.)"""

    def __init__(
        self, module: str, name: str, tmp: Path, args: list[str], env: dict[str, str]
    ) -> None:
        self.name = name
        self.status_path = tmp / f"{name}.json"
        self.log_path = tmp / f"{name}.log"
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, *args, str(self.status_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
            )

    def status(self) -> dict[str, object]:
        loaded: dict[str, object] = json.loads(self.status_path.read_text())
        return loaded

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


class Watched(Protocol):
    """A child process a wait watches: it fails at once, with its logs, if the child died."""

    name: str
    process: subprocess.Popen[bytes]

    def logs(self) -> str: ...


async def until(holds: Condition, what: str, *watched: Watched) -> None:
    """`tests.eventually.until` within twice WITHIN_S, failing at once if a watched child died."""

    def alive() -> None:
        for child in watched:
            assert child.process.poll() is None, f"{child.name} died: {child.logs()}"

    await eventually.until(holds, what, within=2 * WITHIN_S, guard=alive)
