"""Seeds 5 and 12 of `kvhandoff sim`: a worker restarted on the files it kept reclaims
partitions whose handoffs it held open when it crashed, and which another worker ended
meanwhile.

What it found. The claim catches the file up from a snapshot that knows such a handoff by its
tombstone alone, so the file's row is ended as the tombstone says, over the prefix of the
handoff's history the file had (`Batch.merge`, worker.log.store). The claim then published that
prefix's unmarked actions again (an ended handoff's `SubmitPrefill`), the engine answered, and
the planner, loading the handoff from the file for that answer, rebuilt it from the prefix as
open and applied the answer as its next event: the log forked the handoff's history and left
it open. Now such a row's outbox is closed (`_END_BY_TOMBSTONE`) and the planner answers for
it by its tombstone (`Planner._ended_elsewhere`); tests/worker/test_store.py and
tests/worker/test_planner.py make each happen on demand.

This keeps the runs that found it (seed 5; seed 12 broke the same way): each breaks no
invariant, and still takes that path (a file holds a handoff ended with fewer events than the
log holds), so that a change that moves a seed's trace away from it is seen rather than
passing for nothing.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
from pathlib import Path
from uuid import UUID

import pytest

from kvhandoff.worker.sim import checks, world
from kvhandoff.worker.sim.history import History

# The fault kinds each seed drew when it found the bug, forced, so that a kind added since
# (`reset`) leaves its run as it was (worker.sim.faults).
DREW = {
    5: ("crash", "pause", "node", "delay", "engines"),
    12: ("crash", "pause", "node", "delay", "churn"),
}


@pytest.mark.parametrize("seed", [5, 12])
def test_a_run_breaks_no_invariant_where_a_file_holds_an_ended_handoff_in_part(
    seed: int, tmp_path: Path
) -> None:
    kept: list[History] = []
    files = tmp_path / "work"

    def spy(history: History, workdir: Path, **options: object) -> list[str]:
        kept.append(history)
        shutil.copytree(workdir, files)
        return checks.check_run(history, workdir, **options)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(world, "check_run", spy)
        outcome = world.simulate(world.Scenario(seed, fault_kinds=DREW[seed]))
    assert outcome.violations == []

    log = checks.ReplicatedLog.read(kept[0], checks.Names())
    in_part = []
    for path in sorted(files.rglob("partition-*.db")):
        with contextlib.closing(sqlite3.connect(path)) as db:
            ended = db.execute(
                "SELECT handoff_id, last_seq FROM handoffs WHERE state IN ('succeeded', 'canceled')"
            ).fetchall()
        in_part += [hid for hid, last_seq in ended if last_seq < max(log.events[UUID(hid)])]
    assert in_part, f"seed {seed} no longer ends a handoff a file holds in part: find another"
