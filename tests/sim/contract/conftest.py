"""The `backend` fixture: each contract runs once per backend named in `BACKENDS`.

The real backend's server starts at the first contract that needs it and serves the whole
session; contracts keep apart by the names `Backend.fresh` gives them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.sim.contract.backend import Backend, ModelBackend, RealBackend

BACKENDS = ["real", "model"]
# The model runs each contract under this seed (worker.sim.loop): a failure replays from it.
MODEL_SEED = 36


@pytest.fixture(scope="session")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    store: Path = tmp_path_factory.mktemp("contract-nats")
    with EmbeddedNats(store_dir=store, config=RealBackend.SERVER_CONFIG) as server:
        yield server


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    match request.param:
        case "real":
            return RealBackend(request.getfixturevalue("real_server"))
        case "model":
            return ModelBackend(MODEL_SEED)
    raise AssertionError(f"no backend named {request.param!r}")
