"""Seed 4 of `kvhandoff sim` (20 s of load at 2 handoffs a second, the plant
`lease-expiry-ignored`, which only lets a start in on partition 8): an owner that never held
a partition's pin unpinned the worker that owned it.

What it found. A membership read that listed no worker gave worker-0 and worker-2 every
partition for a round; their owners of partition 8 waited for the pin, which worker-1's owner
held. Stopped at the next round, they unpinned on their way out: the server's unpin drops
whoever holds the pin (ADR-42 takes no pin id), so worker-1 lost it without a word. The next
input pinned the joiner, which claimed, applied a start and handed over 0.3 s later; worker-1,
owning the partition by the balance rule and by its own lights, kept pulling with its old pin
id, which the server holds waiting while nobody is pinned, and never claimed again: the open
handoff was never timed out. Now an owner unpins only its own pin (worker.tier.owner
`_release_pin`), and `checks.check_hand_overs_claimed` catches a partition left unclaimed
after a hand-over.
"""

from __future__ import annotations

from kvhandoff.worker.sim import world

# The fault kinds the seed drew when it found the bug, forced, so that a kind added since
# (`reset`) leaves its run as it was (worker.sim.faults).
DREW = ("pause", "node", "election", "churn", "engines")


def test_the_run_where_a_waiting_owner_unpinned_the_owner_breaks_no_invariant() -> None:
    outcome = world.simulate(
        world.Scenario(
            4, duration_s=20, rate_per_s=2, plant="lease-expiry-ignored", fault_kinds=DREW
        )
    )
    assert outcome.violations == []
    # Still the run that found it: worker-2 is paused while it hands partition 8 over, and a
    # worker joins.
    assert "pause worker-2 at 19.33s for 7.95s" in outcome.faults
    assert "churn joiner at 18.84s for 15.28s" in outcome.faults
