"""The worker on a full disk: its local commits fail, so it stops serving the partition until
one succeeds. What its replicated log holds was published (that log is the authority, and the
file catches up from it), but nothing more: the worker must retry at the pace of its rounds
instead of spinning, act on no input while the file cannot take it, say why (SQLite's own
words) and turn its health red; once there is room again, every handoff completes and the log
verifies."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvhandoff.events.replay import find_divergence
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.eventually import until
from tests.worker.conftest import WorkerProcess, logged, logged_actions
from tests.worker.scripted_engine import ScriptedEngines
from tests.worker.test_faults import make_starts
from tests.worker.tmpfs import fill, small_filesystem


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


async def test_a_full_disk_changes_nothing_until_there_is_room(
    nats_server: EmbeddedNats, engines: ScriptedEngines, tmp_path: Path
) -> None:
    # Room for SQLite's WAL to reach its checkpoint (1,000 pages) once the filler is gone.
    with small_filesystem(tmp_path, size_kib=16384) as disk:
        worker = WorkerProcess(nats_server.url, disk / "kvhandoff.db")
        worker.start()
        try:
            rng = random.Random(11)
            warm = make_starts(5, rng)
            for start in warm:
                await engines.start_handoff(start)
            await engines.wait_complete({s.handoff_id for s in warm})
            seen_before = len(engines.first)

            filler = fill(disk)
            starts = make_starts(100, rng)
            for start in starts:
                await engines.start_handoff(start)
            await until(lambda: not worker.healthy(), "health to turn red")
            await until(lambda: "database or disk is full" in worker.logs(), "the cause")
            # It retries at the pace of its rounds rather than spinning (the issue saw ~13
            # failed commits a second): four more failures take at least 1.4 s.
            failures = metric(worker.metrics(), "kvhandoff_commit_failures_total")
            seen_while_full = len(engines.first)
            took_s = await until(
                lambda: metric(worker.metrics(), "kvhandoff_commit_failures_total") >= failures + 4,
                "four more failed commits",
            )
            assert took_s >= 1.4
            # The batch appended before its local commit failed went out; since then, nothing.
            assert len(engines.first) == seen_while_full < seen_before + len(starts) * 2
            assert not worker.healthy()
            assert worker.process is not None and worker.process.poll() is None

            filler.unlink()
            await engines.wait_complete({s.handoff_id for s in starts}, within=120)
            await until(worker.healthy, "health to turn green again")
            assert not engines.mismatched
            assert set(engines.effects.values()) == {1}
            for start in [*warm, *starts]:
                assert find_divergence(logged(worker.db, start.handoff_id).records()) is None
                published = engines.actions_of(start.handoff_id)
                assert logged_actions(worker.db, start.handoff_id) == published
            assert worker.terminate() == 0
        finally:
            worker.stop()


pytestmark = pytest.mark.slow
