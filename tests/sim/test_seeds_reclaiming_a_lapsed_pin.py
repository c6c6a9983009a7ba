"""Seed 15 of `kvhandoff sim` (the default scenario): an owner whose pin lapsed went on owning
a partition that another worker had claimed and handed back since.

What it found. An election (JetStream answering nothing for 4.65 s) kept every pull from the
server, and every pin lapsed. The next input of partition 0 pinned worker-0, whose owner was
waiting for the pin; it claimed, opened a handoff, and handed the partition back at the next
round of the balance rule, unpinning its own pin. worker-1, owning partition 0 by the balance
rule and under its lapsed pin, was refused once (423) and then pulled without a pin id, but
no input came to pin it: it never claimed again, and the handoff worker-0 had opened was never
timed out. An owner learns of a lost pin only from a delivery; now one idle under its pin for
the priority timeout asks whose the pin is, and goes back to claiming if it is not its own
(worker.tier.owner "Lapsed pins", the `pin_lost` move of worker.tier.phase).
"""

from __future__ import annotations

from kvhandoff.worker.sim import world

# The fault kinds the seed drew when it found the bug, forced, so that a kind added since
# (`reset`) leaves its run as it was (worker.sim.faults).
DREW = ("crash", "pause", "node", "election", "engines")


def test_the_run_where_an_owner_kept_a_lapsed_pin_breaks_no_invariant() -> None:
    outcome = world.simulate(world.Scenario(15, fault_kinds=DREW))
    assert outcome.violations == []
    # Still the run that found it: the election that let the pins lapse, after the crashes that
    # put the partitions' owners in place.
    assert "election at 51.86s for 4.65s" in outcome.faults
    assert "crash worker-2 at 20.90s for 8.76s" in outcome.faults
