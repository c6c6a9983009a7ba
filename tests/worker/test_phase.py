"""A partition owner's phase table (worker.tier.phase), without NATS: every legal move lands
where the table says, every other move raises `PhaseError` naming the phase and the event and
leaves the phase as it was, and every phase an owner can be in is reachable from its start."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.worker.errors import PhaseError, WorkerError
from kvhandoff.worker.tier.phase import MOVES, Event, PartitionPhase, Phase

LEGAL = [(phase, event, after) for phase, moves in MOVES.items() for event, after in moves.items()]
ILLEGAL = [(phase, event) for phase in Phase for event in Event if event not in MOVES[phase]]


@pytest.mark.parametrize(("phase", "event", "after"), LEGAL, ids=str)
def test_a_legal_move_lands_where_the_table_says(phase: Phase, event: Event, after: Phase) -> None:
    machine = PartitionPhase(7, phase)
    assert machine.move(event) is after
    assert machine.now is after


@pytest.mark.parametrize(("phase", "event"), ILLEGAL, ids=str)
def test_an_illegal_move_raises_naming_phase_and_event_and_changes_nothing(
    phase: Phase, event: Event
) -> None:
    machine = PartitionPhase(7, phase)
    with pytest.raises(PhaseError) as raised:
        machine.move(event)
    assert machine.now is phase
    message = str(raised.value)
    assert "partition 7" in message and repr(phase.value) in message
    assert repr(event.value) in message


def test_the_table_covers_every_phase_and_its_ends_have_no_way_out() -> None:
    assert set(MOVES) == set(Phase)
    assert {p for p in Phase if p.ended} == {Phase.HANDED_OVER, Phase.FENCED, Phase.RELEASED}
    assert {p for p in Phase if p.claimed} == {Phase.OWNING, Phase.OWNING_UNPINNED}
    assert issubclass(PhaseError, WorkerError)


def test_every_phase_is_reachable_from_claiming_and_every_phase_can_end() -> None:
    reached, frontier = {Phase.CLAIMING}, [Phase.CLAIMING]
    while frontier:
        for after in MOVES[frontier.pop()].values():
            if after not in reached:
                reached.add(after)
                frontier.append(after)
    assert reached == set(Phase)
    # Whatever happens, an owner can be failed out of any phase it is still in.
    assert all(MOVES[p].get(Event.FAILED) is Phase.RELEASED for p in Phase if not p.ended)


def test_the_table_cannot_be_changed_at_run_time() -> None:
    with pytest.raises(TypeError):
        MOVES[Phase.FENCED][Event.CLAIM_BEGAN] = Phase.CATCHING_UP  # type: ignore[index]


@given(st.lists(st.sampled_from(Event), max_size=40))
def test_any_run_of_events_follows_the_table_and_rejections_change_nothing(
    events: list[Event],
) -> None:
    machine = PartitionPhase(0)
    expected = Phase.CLAIMING
    for event in events:
        after = MOVES[expected].get(event)
        if after is None:
            with pytest.raises(PhaseError):
                machine.move(event)
        else:
            assert machine.move(event) is after
            expected = after
        assert machine.now is expected
