"""`events.replay` on the golden logs: the timeline as data, and verification that finds the
first step whose re-derived actions differ from the logged ones, whatever the difference."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from uuid import UUID

import msgspec
import pytest

from kvhandoff.events.codec import encode_record, input_digest
from kvhandoff.events.coordinator import Mode
from kvhandoff.events.errors import LogCorrupt, ReplayDivergence
from kvhandoff.events.messages import (
    APPLIED,
    Action,
    ActionOutcome,
    CancelDestination,
    CancelSource,
    Complete,
    HandoffCompletion,
    ReserveDestination,
    SourceHeld,
    StartTransfer,
)
from kvhandoff.events.records import ActionRecord, InputRecord
from kvhandoff.events.replay import (
    Divergence,
    LoggedRecord,
    StoredRecord,
    check_stored,
    find_divergence,
    rebuild,
    timeline,
    verify,
)
from kvhandoff.worker.log.reader import SqliteLog
from tests.tools.conftest import IDS, V1


def golden(name: str) -> list[LoggedRecord]:
    with SqliteLog(V1 / "log.sqlite3") as log:
        return log.load(UUID(IDS[name])).records()


def test_timeline_has_one_step_per_input_numbered_by_its_seq() -> None:
    tl = timeline(golden("frontend-cancel"))
    assert [s.step for s in tl.steps] == [0, 2, 3, 5, 8, 9]
    assert all(s.actions == s.logged and s.rejection is None for s in tl.steps)
    canceled = tl.steps[3]
    assert canceled.input.__struct_config__.tag == "canceled"
    assert [type(a) for a in canceled.actions] == [CancelSource, CancelDestination]
    assert canceled.state.startswith("cleaning_up")
    assert tl.state.mode is Mode.COMPLETE
    assert tl.state.completion is HandoffCompletion.CANCELED
    assert tl.waiting == () and tl.outstanding == ()


def test_timeline_changes_name_exactly_the_fields_a_step_changed() -> None:
    steps = timeline(golden("frontend-cancel")).steps
    submitted = steps[1]
    assert [c.field for c in submitted.changes] == ["journal.outcomes", "source.submitted"]
    assert submitted.changes[1].before is False and submitted.changes[1].after is True
    mode = next(c for c in steps[3].changes if c.field == "mode")
    assert (mode.before, mode.after) == (Mode.ACTIVE, Mode.CLEANING_UP)


@pytest.mark.parametrize(("until", "last"), [(3, 3), (4, 3), (5, 5), (100, 9)])
def test_timeline_until_stops_after_that_step_with_its_full_state(until: int, last: int) -> None:
    tl = timeline(golden("frontend-cancel"), until=until)
    assert tl.steps[-1].step == last
    if last == 3:
        assert tl.state.source.held and tl.state.destination.reserve_issued
        assert tl.outstanding == (1,)
        (waiting,) = tl.waiting
        assert isinstance(waiting.action, ReserveDestination)


def test_timeline_state_is_the_rebuilt_coordinators() -> None:
    for name in IDS:
        records = golden(name)
        _, coordinator = rebuild(records)
        assert timeline(records).state == coordinator.snapshot()


def test_timeline_before_the_first_step_is_an_error() -> None:
    with pytest.raises(LogCorrupt, match="no step at or before -1"):
        timeline(golden("frontend-cancel"), until=-1)


def test_every_golden_handoff_verifies() -> None:
    for name in IDS:
        assert find_divergence(golden(name)) is None, name
        verify(golden(name))


# --- Tampering, in memory: each way an action can differ is caught at its step ---------------

Tamper = Callable[[list[LoggedRecord]], list[LoggedRecord]]


def _with_action(
    records: list[LoggedRecord], seq: int, make: Callable[[Action], Action]
) -> list[LoggedRecord]:
    out = list(records)
    record = out[seq][1]
    assert isinstance(record, ActionRecord)
    out[seq] = (seq, msgspec.structs.replace(record, action=make(record.action)))
    return out


def _renumbered(records: Sequence[LoggedRecord]) -> list[LoggedRecord]:
    return [(i, r) for i, (_, r) in enumerate(records)]


def _slower(a: Action) -> Action:
    assert isinstance(a, StartTransfer)
    return msgspec.structs.replace(a, delay_ms=a.delay_ms * 2)


def _cancel_source(a: Action) -> Action:
    return CancelSource(a.handoff_id, a.action_id)


def _next_id(a: Action) -> Action:
    return msgspec.structs.replace(a, action_id=a.action_id + 1)


def _other_handoff(a: Action) -> Action:
    return msgspec.structs.replace(a, handoff_id=UUID(int=1))


def _success(a: Action) -> Action:
    assert isinstance(a, Complete)
    return msgspec.structs.replace(a, completion=HandoffCompletion.SUCCESS)


# frontend-cancel: Canceled at seq 5 issues CancelSource(2) at 6 and CancelDestination(3) at 7;
# the last outcome (seq 9) issues Complete(4) at 10.
# source-first-success: DestinationReserved at seq 6 issues StartTransfer(2) at 7.
TAMPERS = [
    pytest.param(
        "source-first-success", lambda r: _with_action(r, 7, _slower), 6, "delay_ms", id="delay"
    ),
    pytest.param(
        "frontend-cancel",
        lambda r: _with_action(r, 7, _cancel_source),
        5,
        "cancel_source",
        id="kind",
    ),
    pytest.param(
        "frontend-cancel", lambda r: _with_action(r, 6, _next_id), 5, "action_id", id="action id"
    ),
    pytest.param(
        "frontend-cancel",
        lambda r: _with_action(r, 6, _other_handoff),
        5,
        "handoff_id",
        id="handoff id",
    ),
    pytest.param(
        "frontend-cancel", lambda r: _with_action(r, 10, _success), 9, "completion", id="field"
    ),
    pytest.param(
        "frontend-cancel",
        lambda r: _renumbered([*r[:6], r[7], r[6], *r[8:]]),
        5,
        "action 1 of the step",
        id="order",
    ),
    pytest.param(
        "frontend-cancel",
        lambda r: _renumbered([*r[:7], *r[8:]]),
        5,
        "logged nothing",
        id="missing",
    ),
    pytest.param(
        "frontend-cancel",
        lambda r: _renumbered([*r[:8], r[7], *r[8:]]),
        5,
        "re-derived nothing",
        id="extra",
    ),
    pytest.param("frontend-cancel", lambda r: r[:10], 9, "logged nothing", id="lost tail"),
]


def stored(records: list[LoggedRecord]) -> list[StoredRecord]:
    """As the worker stores them: with each input's digest."""
    return [
        (seq, input_digest(r.input) if isinstance(r, InputRecord) else None, encode_record(r))
        for seq, r in records
    ]


def _find_stored(records: list[LoggedRecord]) -> Divergence | None:
    check = check_stored(stored(records))
    assert (check.corrupt, check.malformed, check.digest_mismatches) == ((), None, ())
    return check.divergence


FINDERS = [
    pytest.param(find_divergence, id="decoded"),
    pytest.param(_find_stored, id="stored"),
]


@pytest.mark.parametrize("find", FINDERS)
@pytest.mark.parametrize(("scenario", "tamper", "step", "detail"), TAMPERS)
def test_a_tampered_action_diverges_at_the_step_that_issued_it(
    find: Callable[[list[LoggedRecord]], Divergence | None],
    scenario: str,
    tamper: Tamper,
    step: int,
    detail: str,
) -> None:
    records = golden(scenario)
    divergence = find(tamper(records))
    assert divergence is not None
    assert divergence.handoff_id == UUID(IDS[scenario])
    assert divergence.step == step
    assert divergence.input == records[step][1].input  # type: ignore[union-attr]
    assert divergence.logged != divergence.rederived
    assert detail in divergence.detail

    with pytest.raises(ReplayDivergence) as raised:
        verify(tamper(records))
    assert raised.value.step == step
    assert raised.value.handoff_id == UUID(IDS[scenario])
    assert raised.value.context["logged"] == divergence.logged
    assert raised.value.context["rederived"] == divergence.rederived


@pytest.mark.parametrize("name", IDS)
def test_the_stored_fast_path_agrees_with_the_decoded_replay(name: str) -> None:
    records = golden(name)
    assert check_stored(stored(records)).ok
    # Actions logged at another time than their input (so not byte-equal to the re-derived
    # ones) are still the same actions: the slow path must say so, not report a divergence.
    later = [
        (seq, msgspec.structs.replace(r, at_ms=r.at_ms + 1) if isinstance(r, ActionRecord) else r)
        for seq, r in records
    ]
    assert stored(later) != stored(records)
    assert check_stored(stored(later)).ok


def test_a_logged_input_the_coordinator_now_rejects_is_a_divergence() -> None:
    records = golden("frontend-cancel")
    # Seq 8 answers CancelSource(2); make it answer an action that was never issued.
    record = records[8][1]
    assert isinstance(record, InputRecord)
    unknown = ActionOutcome(record.input.handoff_id, 99, APPLIED)
    records[8] = (8, InputRecord(record.at_ms, unknown))
    divergence = find_divergence(records)
    assert divergence is not None
    assert check_stored(stored(records)).divergence == divergence
    assert divergence.step == 8
    assert divergence.rederived == ()
    assert "now rejects" in divergence.detail and "unknown handoff action 99" in divergence.detail

    steps = timeline(records).steps
    assert steps[4].rejection == "unknown handoff action 99"
    assert steps[4].changes == ()


def _first_action(records: list[LoggedRecord]) -> list[LoggedRecord]:
    return [(0, records[1][1]), *_renumbered(records[2:])[1:]]


MALFORMED: list[tuple[str, Callable[[list[LoggedRecord]], list[LoggedRecord]], str]] = [
    ("empty", lambda r: [], "empty handoff log"),
    ("gap", lambda r: [*r[:3], *r[4:]], "skips from sequence 2 to 4"),
    ("starts with an action", lambda r: _renumbered(r[1:]), "begins with an action"),
    ("starts without a start", lambda r: _renumbered(r[2:]), "does not begin with a start"),
]


@pytest.mark.parametrize(
    ("damage", "message"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_a_malformed_log_is_corrupt_not_divergent(
    damage: Callable[[list[LoggedRecord]], list[LoggedRecord]], message: str
) -> None:
    records = damage(golden("frontend-cancel"))
    with pytest.raises(LogCorrupt, match=message):
        find_divergence(records)
    check = check_stored(stored(records))
    assert check.malformed is not None and re.search(message, check.malformed)
    assert check.divergence is None and check.corrupt == ()
    with pytest.raises(LogCorrupt, match=message):
        timeline(records)


def test_repeated_facts_are_steps_without_actions() -> None:
    records = golden("stuck-on-reserve")
    held = records[3][1]
    assert isinstance(held, InputRecord) and isinstance(held.input, SourceHeld)
    again = msgspec.structs.replace(
        held.input, timing=msgspec.structs.replace(held.input.timing, bandwidth_gb_s=10.0)
    )
    records.append((len(records), InputRecord(held.at_ms + 1, again)))
    assert find_divergence(records) is None
    last = timeline(records).steps[-1]
    assert last.actions == () and last.changes == ()
