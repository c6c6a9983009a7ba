"""Fixtures for the worker's tests: a real nats-server, the worker as a real process (so it can
be killed with SIGKILL), and the scripted engines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from uuid import UUID

import pytest

from kvhandoff.events.messages import Action, Input
from kvhandoff.events.records import ActionRecord, InputRecord
from kvhandoff.worker.harness.child import WorkerChild
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.log.rows import HandoffLog
from kvhandoff.worker.log.schema import HandoffState
from tests.eventually import until
from tests.worker.scripted_engine import ScriptedEngines


class WorkerProcess(WorkerChild):
    """`kvhandoff run` in a child process (`worker.harness.child`), restartable on the same
    database, with retries and redeliveries sped up for tests: the embedded default, a tier of one
    partition whose log is `db`."""

    def __init__(
        self, nats_url: str, db: Path, *extra: str, module: str = "kvhandoff.worker.cli"
    ) -> None:
        super().__init__(nats_url, db, "--retry-interval", "1s", *extra, module=module)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    store = tmp_path / "nats"
    store.mkdir()
    server = EmbeddedNats(store_dir=store)
    server.start()
    yield server
    server.close()


@pytest.fixture
def worker(nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[WorkerProcess]:
    """The worker, started."""
    process = WorkerProcess(nats_server.url, tmp_path / "kvhandoff.db")
    process.start()
    yield process
    process.stop()


@pytest.fixture
async def engines(nats_server: EmbeddedNats) -> AsyncIterator[ScriptedEngines]:
    scripted = ScriptedEngines(nats_server.url)
    await scripted.start()
    yield scripted
    await scripted.close()


def logged(db: Path, handoff_id: UUID) -> HandoffLog:
    """One handoff's log, read the way the offline tools read it (read-only, beside the worker)."""
    with open_log(db) as log:
        return log.load(handoff_id)


def logged_actions(db: Path, handoff_id: UUID) -> list[Action]:
    records = (e.record for e in logged(db, handoff_id).events)
    return [r.action for r in records if isinstance(r, ActionRecord)]


def logged_inputs(db: Path, handoff_id: UUID) -> list[Input]:
    records = (e.record for e in logged(db, handoff_id).events)
    return [r.input for r in records if isinstance(r, InputRecord)]


async def completed_inputs(db: Path, handoff_id: UUID, within: float = 60.0) -> list[Input]:
    """The handoff's logged inputs, once its local file holds its completion: the file commits
    behind the publishes, the `Complete` included, so a handoff seen complete on the bus may
    not be in the file yet."""

    def ended_in_file() -> bool:
        with open_log(db) as log:
            return any(
                row.handoff_id == handoff_id and row.state is not HandoffState.OPEN
                for row in log.handoffs()
            )

    await until(ended_in_file, f"the file held the completion of {handoff_id}", within=within)
    return logged_inputs(db, handoff_id)
