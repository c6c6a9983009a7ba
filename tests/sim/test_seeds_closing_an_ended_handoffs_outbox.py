"""Seed 483 of `kvhandoff sim` (the default scenario): a claim published again every action of a
handoff that had succeeded 15 s before, and the engines, restarted since, did them anew: a
destination reserved 94 blocks that nothing released.

What it found. worker-0 ended the handoff, and its actions' outbox marks waited for the
partition's next batch, which never came before worker-0 took a snapshot and crashed (with its
files). When worker-0 claimed the partition again, its file was caught up from another owner's
snapshot, which knows the handoff by its tombstone alone. A snapshot's tombstone closed the
outbox of a row the file held open, or ended otherwise, but not of one ended as it says: the
file's row kept every action unmarked, and the claim published them all again. Now the
tombstone closes that outbox too (worker.log.store, `_CLOSE_BY_TOMBSTONE`).
"""

from __future__ import annotations

from kvhandoff.worker.sim import world

# The fault kinds the seed drew when it found the bug, forced, so that a kind added since
# leaves its run as it was (worker.sim.faults).
DREW = ("crash", "election", "engines", "node", "pause", "slow")


def test_the_run_where_a_claim_republished_an_ended_handoffs_actions_breaks_no_invariant() -> None:
    outcome = world.simulate(world.Scenario(483, fault_kinds=DREW))
    assert outcome.violations == []
    # Still the run that found it: worker-0 crashes, with its files, after the engines' host
    # came back.
    assert "crash worker-0 at 25.51s for 7.47s" in outcome.faults
    assert "engines engines at 22.79s for 7.90s" in outcome.faults
