"""Fixtures for the scale-out tests: a real three-node JetStream cluster of nats-server
processes on loopback (`worker.natsserver.NatsCluster`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.natsserver import NatsCluster

# What a step that should take milliseconds may take on a busy two-core machine, elections
# included.
WITHIN_S = 30.0


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """Three clustered nodes, formed (the meta group has a leader and all three peers)."""
    with NatsCluster(store_dir=tmp_path / "cluster") as cluster:
        yield cluster
