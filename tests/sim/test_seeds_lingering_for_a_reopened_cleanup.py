"""Seed 213 of `kvhandoff sim`: a handoff's deadline passed while its partition changed hands,
and the new owner's `TimedOut` reached the log just behind the outcome that made it succeed, so
it reopened (docs/handoff.md): its `CancelDestination` went out, an engine dropped it, and its
retry was due five seconds later (the retry interval, worker.tier.timers).

What it found. The tier was right, the run was not: the frontend's waits had all ended (at
each handoff's first `Complete`), the engines were settled (the destination held blocks only
for a decode), so the run stopped the workers before the retry, and the log ended with the
handoff open while the frontend had seen it succeed. The frontend now listens on until the log
ends every handoff or the quiet phase is over (`LoadConfig.linger`, worker.sim.world), so the
tier has the whole quiet phase, as docs/simulation.md says, and the frontend's final states are
the log's.

This keeps the run: it breaks no invariant, and still takes that path (the log held a handoff
open once the frontend's waits ended), so that a change that moves the seed's trace away from
it is seen rather than passing for nothing.
"""

from __future__ import annotations

import pytest

from kvhandoff.worker.sim import world
from kvhandoff.worker.sim.checks import ReplicatedLog

# The fault kinds the seed drew when it found the bug, forced, so that a kind added since
# leaves its run as it was (worker.sim.faults).
DREW = ("crash", "pause", "node", "delay", "reset")


def test_the_run_whose_reopened_cleanup_ended_after_the_frontends_waits_breaks_no_invariant() -> (
    None
):
    found_open: list[bool] = []
    open_in_log = world._open_in_log

    def spying(log: ReplicatedLog) -> bool:
        found = open_in_log(log)
        found_open.append(found)
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(world, "_open_in_log", spying)
        outcome = world.simulate(world.Scenario(213, fault_kinds=DREW))

    assert outcome.ok, outcome.violations
    # The path: a handoff was open in the log when the frontend's last wait ended, and it
    # ended while the frontend listened on, as a success reopened and canceled.
    assert found_open[0] and not found_open[-1]
    assert outcome.load is not None and outcome.load.reopened >= 1
