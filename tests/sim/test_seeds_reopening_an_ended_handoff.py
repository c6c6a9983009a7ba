"""Seed 200 of `kvhandoff sim`: a handoff that succeeded reopened on a late `Canceled`
(docs/handoff.md), and a worker restarted without its files claimed its partition while it was
open again.

What it found. The planner kept the tombstone of the handoff's first ending after the reopen,
so the snapshot taken while it was open carried its open row and a tombstone saying it had
succeeded; the restarted worker's file took both (`Batch.merge`, worker.log.store), and once
the handoff ended canceled its file's tombstone contradicted its rows (`kvhandoff verify`: "a
snapshot's tombstone says it ended succeeded, its rows say canceled"). A claim that reads the
file's tombstones would answer a late input from the stale ending. Now a reopen drops the
tombstone (worker.tier.planner), and a merge keeps no tombstone of a handoff the snapshot holds
as a row and takes the snapshot's tombstones over the file's older ones (worker.log.store);
tests/worker/test_planner.py and tests/worker/test_store.py make each happen on demand.

This keeps the run: it breaks no invariant, and still takes that path (a snapshot that a file
is caught up from holds a handoff that reopened), so that a change that moves the seed's trace
away from it is seen rather than passing for nothing.
"""

from __future__ import annotations

import sqlite3
from typing import Any
from uuid import UUID

import pytest

from kvhandoff.worker.log import store
from kvhandoff.worker.log.rows import LiveState
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.sim import world
from kvhandoff.worker.tier.planner import Planner

# The fault kinds the seed drew when it found the bug, forced, so that a kind added since
# (`reset`) leaves its run as it was (worker.sim.faults).
DREW = ("crash", "pause", "node", "election", "delay", "engines")


def test_the_run_where_a_file_took_a_reopened_handoffs_stale_tombstone_breaks_no_invariant() -> (
    None
):
    reopened: set[UUID] = set()
    merged: set[UUID] = set()
    plan, merge = Planner.plan, store._merge

    def planning(planner: Planner, *args: Any, **kwargs: Any) -> Any:
        ended = set(planner.tombstones)
        made = plan(planner, *args, **kwargs)
        reopened.update(
            h
            for h, row in made.batch.handoffs.items()
            if h in ended and row.state is HandoffState.OPEN
        )
        return made

    def merging(db: sqlite3.Connection, state: LiveState) -> None:
        merged.update(row.handoff_id for row in state.handoffs)
        merge(db, state)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Planner, "plan", planning)
        patch.setattr(store, "_merge", merging)
        outcome = world.simulate(world.Scenario(200, fault_kinds=DREW))
    assert outcome.violations == []
    assert reopened & merged, "seed 200 no longer merges a reopened handoff into a file"
    assert "crash worker-1 at 44.06s for 2.57s, without its files" in outcome.faults
