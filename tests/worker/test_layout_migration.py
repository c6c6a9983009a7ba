"""A layout-1 log under a worker of this build: a copy of the golden layout-1 log is migrated
when `kvhandoff run` starts on it, and the worker carries on with the handoffs it left open,
with a real nats-server and the scripted engines."""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from uuid import UUID

import pytest

from kvhandoff.events.messages import (
    SCHEDULED,
    ActionOutcome,
    HandoffCompletion,
    TransferCompleted,
)
from kvhandoff.events.replay import find_divergence
from kvhandoff.worker.ambient import now_ms
from kvhandoff.worker.commands.verify import verify_log
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.log.reader import open_log
from tests.eventually import until
from tests.tools.conftest import IDS, V1
from tests.worker.bus_probe import running
from tests.worker.conftest import WorkerProcess, logged, logged_actions
from tests.worker.scripted_engine import ScriptedEngines

OPEN = [UUID(IDS[name]) for name in ("stuck-on-reserve", "stuck-on-transfer", "just-started")]


def metric(worker: WorkerProcess, name: str) -> float:
    for line in worker.metrics().splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


@pytest.fixture
def layout_1(tmp_path: Path) -> Path:
    """The golden layout-1 log, its open handoffs' deadlines moved to an hour from now: they
    started in 2025, and would otherwise time out the moment the worker recovers them."""
    db = tmp_path / "kvhandoff.db"
    shutil.copyfile(V1 / "log.sqlite3", db)
    with closing(sqlite3.connect(db)) as connection, connection:
        connection.execute(
            "UPDATE handoffs SET deadline_at_ms = ? WHERE state = 'open'",
            (now_ms() + 3_600_000,),
        )
    return db


@pytest.fixture
def worker(nats_server: EmbeddedNats, layout_1: Path) -> Iterator[WorkerProcess]:
    process = WorkerProcess(nats_server.url, layout_1)
    assert process.db == layout_1
    yield process
    process.stop()


async def test_a_worker_migrates_a_layout_1_log_and_carries_on_with_its_open_handoffs(
    worker: WorkerProcess, engines: ScriptedEngines, layout_1: Path
) -> None:
    with open_log(layout_1) as before:
        logged_before = {h.handoff_id: before.load(h.handoff_id) for h in before.handoffs()}

    worker.start()  # recovered: migrated, rebuilt, its outstanding actions published again
    assert "migrated from layout 1 to 2" in worker.logs()
    assert "0 of them kept whole" in worker.logs()
    transfer = UUID(IDS["stuck-on-transfer"])
    # An input layout 1 logged, delivered again: the worker knows it from the migrated log,
    # though layout 2 keeps no digest of it, and drops it instead of rejecting it.
    await engines.send(ActionOutcome(transfer, 2, SCHEDULED))
    await until(
        lambda: metric(worker, "kvhandoff_duplicate_inputs_total") == 1,
        "the duplicate",
        within=60,
        guard=running(worker),
    )
    # stuck-on-transfer waits for a fact, not an action: the source reports it now.
    await engines.send(TransferCompleted(transfer))
    await engines.wait_complete(set(OPEN))
    assert worker.terminate() == 0

    assert not engines.rejections and not engines.mismatched
    for handoff_id in OPEN:
        (complete,) = engines.completions[handoff_id]
        assert complete.completion is HandoffCompletion.SUCCESS
        # The log goes on from where layout 1 left it, with action ids that go on too.
        log = logged(layout_1, handoff_id)
        old = logged_before[handoff_id].records()
        assert log.records()[: len(old)] == old
        assert find_divergence(log.records()) is None
        actions = logged_actions(layout_1, handoff_id)
        assert [a.action_id for a in actions] == list(range(len(actions)))
        assert actions[-1] == complete
    for handoff_id, before_log in logged_before.items():
        if handoff_id not in OPEN:
            assert logged(layout_1, handoff_id).records() == before_log.records()
    with open_log(layout_1) as after:
        assert after.form == "a layout-2 log"
        assert verify_log(after).findings == []
