"""Seed 283 of `kvhandoff sim` (the default scenario, with the disk faults): a rejected start
whose rejection was never published, so its frontend waited past the quiet phase.

What it found. worker-2 appended an entry that rejected a start (its engine's lease had
expired) and lost the append's acknowledgement (the lost-ack fault); before it gave up waiting
for it, it crashed, and came back without its files. The entry was in the log, but its rejection
had never been published, and rejections, unlike actions, had no outbox: the worker that claimed
the partition next republished every action the log did not mark published, and no rejection.
The frontend waited on the start for ever. Now each entry names the newest entry whose publishes
the server confirmed (`LoggedRows.confirmed`), and a claim publishes again the rejections of the
entries after it (worker.tier.partition, `_unconfirmed_rejections`).
"""

from __future__ import annotations

from kvhandoff.worker.sim import world

# The fault kinds the seed drew when it found the bug, forced, so that a kind added since
# leaves its run as it was (worker.sim.faults).
DREW = ("crash", "delay", "election", "engines", "full", "node", "reset")


def test_the_run_where_an_owner_died_before_publishing_a_rejection_breaks_no_invariant() -> None:
    outcome = world.simulate(world.Scenario(283, fault_kinds=DREW))
    assert outcome.violations == []
    # Still the run that found it: worker-2 crashes and loses its files two seconds after the
    # append, while engines' leases are gone and starts are rejected.
    assert "crash worker-2 at 35.02s for 7.94s, without its files" in outcome.faults
    assert outcome.load is not None and outcome.load.rejected > 0
