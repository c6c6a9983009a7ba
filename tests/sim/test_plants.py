"""The simulation finds each planted bug (worker.sim.plants) within the CI budget of seeds.

For each plant that the simulation can expose today, seeds are run from `SEEDS`, in order,
until one run has violations; one of them must be of the kind that plant breaks, and
the seeds it took are recorded. The table (plant, seeds to find, violation) and the median are
printed, so CI's output shows them. The same seeds pass with no plant, so a violation is the
plant's. A plant whose damage needs faults that a seed's own draw rarely brings together is
hunted with them forced (`HUNTS`), as `kvhandoff sim --faults` forces them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvhandoff.worker.sim import plants
from kvhandoff.worker.sim.world import Scenario, simulate
from tests.conftest import SUMMARY

SEEDS = tuple(range(1, 31))  # the CI budget: a plant not found within these is a failure


@dataclass(frozen=True)
class Hunt:
    """The runs a plant is hunted with: small, for speed (a run takes about two seconds), each
    seed drawing its own faults unless `kinds` forces some."""

    kinds: tuple[str, ...] | None = None
    rate_per_s: float = 2.0

    def scenario(self, seed: int, plant: str | None = None) -> Scenario:
        return Scenario(
            seed, duration_s=20.0, rate_per_s=self.rate_per_s, fault_kinds=self.kinds, plant=plant
        )


# `no-outbox-barrier` breaks only a publish that a reset or a node's death swallowed, marked
# published by a batch appended after the reconnect: a reset while a delay keeps much in
# flight, and more load, make that likely; the draw of a seed brings them together rarely.
HUNTS = {"no-outbox-barrier": Hunt(("reset", "delay", "node"), rate_per_s=4.0)}


@dataclass(frozen=True)
class Expect:
    """What finds a plant: a phrase of the violation its first failing run reports (or of
    another that the same breakage shows as, `or_else`)."""

    violation: str
    or_else: tuple[str, ...] = ()

    def matches(self, violation: str) -> bool:
        return any(phrase in violation for phrase in (self.violation, *self.or_else))


EXPECTED: dict[str, Expect] = {
    "append-without-cas": Expect("was stored without compare-and-set"),
    "ack-before-append": Expect("before the log entry that applied it was stored"),
    # "handoff h: action n (Kind) published by w at t before <entry> logged it"
    "publish-before-append": Expect("logged it"),
    # The fenced batch's actions: published before the new owner's entry logged them, or
    # logged by none; or the fenced owner's file, which kept the batch the log refused.
    "act-when-fenced": Expect("published by", or_else=("differs from the one partition",)),
    # "worker-2 asked KVHANDOFF_IN.kvhandoff-worker-p12 for messages (on _INBOX...) with pin
    # id x at t, after it read a 423 refusing it": the stale pin id is never dropped.
    "ignore-423": Expect("after it read a 423 refusing it"),
    "claim-forgets-applied": Expect("is applied twice"),
    # "handoff h: input n is applied by <entry>, after input m, stored later, ...": orphans of
    # a reconnect (what the server sent on the lost connection) applied behind newer inputs.
    "orphans-in-stream-order": Expect("out of stream order"),
    # "handoff h: w published TimedOut again at t (Nats-Msg-Id m), though its previous
    # TimedOut, at t0, was acknowledged (...), and it did not claim partition p in between"
    "timer-fires-twice": Expect("published TimedOut again"),
    # "handoff h: worker-1 published TimedOut at t, n ms before its deadline by its own clock"
    "timer-fires-early": Expect("before its deadline"),
    # "handoff h: <entry> marks action n (Complete) published, though the server had not read
    # it": written to a connection a reset or a node's death cut, and never published again
    # (its frontend, or its engine, waits past the quiet phase, if the run shows it so).
    "no-outbox-barrier": Expect(
        "published, though the server had not read it",
        or_else=("did not end within the quiet phase",),
    ),
    # "handoff h: partition p: Snapshot at seq n of ... holds neither its row nor its
    # tombstone, though the log before it started the handoff m ms before"
    "snapshot-without-tombstones": Expect("holds neither its row nor its tombstone"),
    # "handoff h: <entry> accepted its start naming e at t, n s after that engine's lease
    # expired (...), more than a lease TTL (5s): ..."
    "lease-expiry-ignored": Expect("more than a lease TTL"),
}


@dataclass(frozen=True)
class Found:
    plant: str
    seeds: int  # runs it took, the failing one included
    violations: list[str]  # the failing run's

    @property
    def violation(self) -> str:
        """The one of the expected kind if any (a fault may break more than the plant's own
        invariant first), else the first."""
        expect = EXPECTED[self.plant]
        return next((v for v in self.violations if expect.matches(v)), self.violations[0])


def _hunt(plant: str) -> Found | None:
    """Run `SEEDS` in order with `plant` planted, through `Scenario.plant`, until one fails."""
    hunt = HUNTS.get(plant, Hunt())
    for tried, seed in enumerate(SEEDS, start=1):
        outcome = simulate(hunt.scenario(seed, plant))
        if outcome.violations:
            return Found(plant, tried, outcome.violations)
    return None


@pytest.fixture(scope="module")
def campaign() -> dict[str, Found | None]:
    return {plant: _hunt(plant) for plant in plants.PLANTS}


def test_every_plant_has_an_expectation() -> None:
    assert set(EXPECTED) == set(plants.PLANTS)
    assert len(plants.PLANTS) >= 10


@pytest.mark.parametrize("plant", list(plants.PLANTS))
def test_plant_is_found(plant: str, campaign: dict[str, Found | None]) -> None:
    found = campaign[plant]
    assert found is not None, f"{plant}: no violation in {len(SEEDS)} seeds"
    assert EXPECTED[plant].matches(found.violation), (
        f"{plant}: found at seed {SEEDS[found.seeds - 1]}, but by another violation than "
        f"expected ({EXPECTED[plant].violation!r}): {found.violation}"
    )


def test_the_same_seeds_pass_unplanted(campaign: dict[str, Found | None]) -> None:
    """Every seed a plant was found at, and those before it, passes with no plant, in the runs
    that plant was hunted with."""
    used: dict[Hunt, int] = {}
    for plant, found in campaign.items():
        if found is not None:
            hunt = HUNTS.get(plant, Hunt())
            used[hunt] = max(used.get(hunt, 0), found.seeds)
    for hunt, seeds in used.items():
        for seed in SEEDS[:seeds]:
            outcome = simulate(hunt.scenario(seed))
            assert outcome.ok, f"seed {seed} fails with no plant: {outcome.violations[:3]}"


def test_seeds_to_find(
    campaign: dict[str, Found | None], record_property: Callable[[str, object], None]
) -> None:
    """The table CI prints at the end of the run (tests/conftest.py, `SUMMARY`): each plant,
    the seeds it took to find, and the violation."""
    lines = [f"{'plant':<30} {'seeds':>5}  violation"]
    for plant in plants.PLANTS:
        found = campaign.get(plant)
        if found is not None:
            lines.append(f"{plant:<30} {found.seeds:>5}  {found.violation[:100]}")
        else:
            lines.append(f"{plant:<30} {'>' + str(len(SEEDS)):>5}  not found")
    taken = [found.seeds for found in campaign.values() if found is not None]
    median = statistics.median(taken) if taken else None
    lines.append(
        f"median seeds to find: {median} ({len(taken)} of {len(plants.PLANTS)} plants found"
        f" within {len(SEEDS)} seeds)"
    )
    record_property(SUMMARY, "\n".join(lines))
    assert taken and median is not None and median <= len(SEEDS)


@pytest.mark.parametrize("plant", list(plants.PLANTS))
def test_plant_goes_in_and_comes_out(plant: str) -> None:
    spec = plants.PLANTS[plant]
    original = vars(spec.target)[spec.attribute]
    with plants.planted(plant) as planting:
        assert vars(spec.target)[spec.attribute] is not original
        assert planting.plant is spec
    assert vars(spec.target)[spec.attribute] is original


def test_an_error_inside_still_takes_the_plant_out() -> None:
    spec = plants.PLANTS["ack-before-append"]
    original = vars(spec.target)[spec.attribute]
    with pytest.raises(KeyError), plants.planted(spec.name):
        raise KeyError("boom")
    assert vars(spec.target)[spec.attribute] is original


def test_unknown_plant_is_refused_with_the_names() -> None:
    with pytest.raises(ValueError, match="ack-before-append"), plants.planted("no-such-bug"):
        pass


def test_one_plant_at_a_time() -> None:
    with (
        plants.planted("ack-before-append"),
        pytest.raises(RuntimeError, match="ack-before-append"),
        plants.planted("ignore-423"),
    ):
        pass


def test_no_plant_is_the_tier_as_it_is() -> None:
    with plants.planted(None) as planting:
        assert planting.plant is None
    for spec in plants.PLANTS.values():
        assert getattr(vars(spec.target)[spec.attribute], "__module__", "") != plants.__name__
