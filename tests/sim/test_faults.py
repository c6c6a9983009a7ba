"""worker.sim.faults.draw: a seed's faults, drawn or of the kinds a scenario forces."""

from __future__ import annotations

import random

import pytest

from kvhandoff.worker.sim import faults

WORKERS, NODES = ["worker-0", "worker-1", "worker-2"], ["n1", "n2", "n3"]


def _draw(seed: int, kinds: tuple[str, ...] | None = None) -> faults.FaultPlan:
    return faults.draw(
        random.Random(seed), workers=WORKERS, nodes=NODES, duration_s=60.0, kinds=kinds
    )


def test_the_same_seed_draws_the_same_plan() -> None:
    assert _draw(7) == _draw(7)
    assert _draw(7, ("node",)) == _draw(7, ("node",))


@pytest.mark.parametrize("kinds", [("crash",), ("node", "election"), ("churn", "engines")])
def test_forced_kinds_are_on_in_every_seed_and_the_others_off(kinds: tuple[str, ...]) -> None:
    for seed in range(20):
        drawn = {fault.kind for fault in _draw(seed, kinds).faults}
        assert drawn == set(kinds), f"seed {seed}: {sorted(drawn)}"


def test_no_kinds_is_no_faults_but_the_phase_properties() -> None:
    plan = _draw(3, ())
    assert plan.faults == ()
    assert set(plan.skews_s) == set(WORKERS)


def test_drawn_kinds_vary_by_seed() -> None:
    mixes = {frozenset(fault.kind for fault in _draw(seed).faults) for seed in range(20)}
    assert len(mixes) > 5


def test_an_unknown_kind_is_refused_with_the_kinds() -> None:
    with pytest.raises(ValueError, match=r"'flood'.*crash, pause"):
        _draw(1, ("crash", "flood"))
