"""Seeds 2991 and 2993 of `kvhandoff sim`: a worker's file holds a handoff that succeeded, which
a late `Canceled` reopened under another owner, and which ended canceled there; the worker
then caught its file up from a snapshot that knows the handoff by that tombstone alone.

What they found. The catch-up (`Batch.merge`, worker.log.store) ended as its tombstone says
only a row the file held open; a row the file held ended kept its first ending, beside the
snapshot's tombstone of the second (`kvhandoff verify`: "a snapshot's tombstone says it ended
canceled, its rows say succeeded"). Now such a row ends as the tombstone says too, its outbox
closed, as an open one does; tests/worker/test_store.py makes it happen on demand.

This keeps the runs: each breaks no invariant, and still takes that path (a merge meets a row
the file holds ended otherwise than the snapshot's tombstone says), so that a change that moves
a seed's trace away from it is seen rather than passing for nothing.
"""

from __future__ import annotations

import sqlite3

import pytest

from kvhandoff.worker.log import store
from kvhandoff.worker.log.rows import LiveState
from kvhandoff.worker.sim import world

# The fault kinds each seed drew when it found the bug, forced, so that a kind added since
# (`reset`) leaves its run as it was (worker.sim.faults).
DREW = {2991: ("node", "election", "churn"), 2993: ("crash", "pause", "delay")}


@pytest.mark.parametrize("seed", [2991, 2993])
def test_a_run_breaks_no_invariant_where_a_snapshot_ends_a_kept_handoff_again(seed: int) -> None:
    ended_otherwise: set[str] = set()
    merge = store._merge

    def merging(db: sqlite3.Connection, state: LiveState) -> None:
        for tombstone in state.tombstones:
            held = db.execute(
                "SELECT state, completed_at_ms FROM handoffs WHERE handoff_id = ?"
                " AND state IN ('succeeded', 'canceled')",
                (str(tombstone.handoff_id),),
            ).fetchone()
            if held is not None and held != (tombstone.state, tombstone.completed_at_ms):
                ended_otherwise.add(str(tombstone.handoff_id))
        merge(db, state)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store, "_merge", merging)
        outcome = world.simulate(world.Scenario(seed, fault_kinds=DREW[seed]))
    assert outcome.violations == []
    assert ended_otherwise, (
        f"seed {seed} no longer merges a tombstone of a handoff a file holds ended otherwise:"
        " find another seed"
    )
