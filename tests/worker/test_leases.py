"""The tier's reading of the lease bucket (`worker.tier.leases.EngineLeases`), entry by entry: which
engines are live, gone or never leased; whom a start is refused for; and which answers it gives
for a gone engine, under which message ids. The bus is a recorder of publishes: the watch and
the publishing are exercised against real processes in tests/client and tests/engines."""

from __future__ import annotations

import asyncio
import uuid
from typing import cast

import msgspec
import pytest

from kvhandoff.events.codec import decode_input
from kvhandoff.events.coordinator import HandoffCoordinator
from kvhandoff.events.leases import LEASE_EXPIRED, EngineLease, answer_id
from kvhandoff.events.messages import (
    NOOP,
    SUBMITTED,
    ActionOutcome,
    CancelSource,
    EngineType,
    Failed,
    Input,
    StartHandoff,
)
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.log.rows import HandoffRow
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.tier.leases import EngineLeases, LeaseState
from kvhandoff.worker.tier.metrics import Metrics
from kvhandoff.worker.tier.planner import OpenHandoff

SOURCE, DESTINATION = "prefill-0", "decode-0"


class Recorder:
    """Stands in for the bus: records each durable publish with its message id."""

    def __init__(self) -> None:
        self.published: list[tuple[Input, str | None]] = []

    async def publish_durable(
        self, subject: str, payload: bytes, *, give_up_after_s: float, msg_id: str | None = None
    ) -> None:
        self.published.append((decode_input(payload), msg_id))


def lease(incarnation: str) -> bytes:
    return msgspec.json.encode(EngineLease(SOURCE, incarnation, 1000))


def leases(*, require: bool = False) -> tuple[EngineLeases, Recorder, list[tuple[str, str]]]:
    recorder = Recorder()
    tier = EngineLeases(cast(Bus, recorder), Subjects(), Metrics(), require=require)
    gone: list[tuple[str, str]] = []
    tier.on_gone(lambda engine, incarnation: gone.append((engine, incarnation)))
    return tier, recorder, gone


def open_handoff() -> OpenHandoff:
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, SOURCE, DESTINATION, 60_000)
    row = HandoffRow(
        start.handoff_id, "vllm", SOURCE, DESTINATION, 0, 60_000, HandoffState.OPEN, None, -1, 0
    )
    handoff = OpenHandoff(start, HandoffCoordinator.for_start(start), row, set())
    handoff.coordinator.handle(start)
    return handoff


def test_an_expiry_and_a_new_incarnation_are_what_make_an_engine_gone() -> None:
    tier, _, gone = leases()
    assert tier.state(SOURCE) is LeaseState.NONE
    tier._on_entry(SOURCE, lease("a"))
    tier._on_entry(SOURCE, lease("a"))  # a renewal
    assert (tier.state(SOURCE), gone) == (LeaseState.LIVE, [])

    tier._on_entry(SOURCE, lease("b"))  # a restart: "a"'s handoffs are a gone engine's
    assert (tier.state(SOURCE), gone) == (LeaseState.LIVE, [(SOURCE, "a")])

    tier._on_entry(SOURCE, None)  # the delete marker of an expiry
    tier._on_entry(SOURCE, None)  # read again: nothing new
    assert (tier.state(SOURCE), gone) == (LeaseState.EXPIRED, [(SOURCE, "a"), (SOURCE, "b")])

    tier._on_entry("prefill-1", None)  # a marker first: expired before this worker started
    assert tier.state("prefill-1") is LeaseState.EXPIRED
    assert gone[-1] == ("prefill-1", "")


def test_a_renewal_of_a_gone_incarnation_stored_late_does_not_revive_it() -> None:
    # The engine was cut off: its last renewal of "a", buffered by its client, is stored once it
    # is back, after the expiry; the engine itself fenced and renews as "b".
    tier, _, gone = leases()
    tier._on_entry(SOURCE, lease("a"))
    tier._on_entry(SOURCE, None)
    tier._on_entry(SOURCE, lease("a"))
    assert (tier.state(SOURCE), gone) == (LeaseState.EXPIRED, [(SOURCE, "a")])

    tier._on_entry(SOURCE, lease("b"))
    tier._on_entry(SOURCE, lease("b"))
    assert (tier.state(SOURCE), gone) == (LeaseState.LIVE, [(SOURCE, "a")])


@pytest.mark.parametrize(
    ("require", "entry", "refusal"),
    [
        (False, lease("a"), None),
        (False, None, f"engine unavailable: {SOURCE}'s lease expired"),
        (False, b"not a lease", None),  # ignored: never leased, served as before
        (True, b"not a lease", f"engine unavailable: {SOURCE} holds no lease (--require-leases)"),
        (True, lease("a"), f"engine unavailable: {DESTINATION} holds no lease (--require-leases)"),
    ],
)
def test_a_start_is_refused_for_a_gone_engine_and_with_require_for_an_unleased_one(
    require: bool, entry: bytes | None, refusal: str | None
) -> None:
    tier, _, _ = leases(require=require)
    tier._on_entry(SOURCE, entry)
    assert tier.admit(open_handoff().start) == refusal


async def test_for_a_gone_engine_an_active_handoff_fails_and_its_cleanups_are_answered_noop() -> (
    None
):
    tier, recorder, _ = leases()
    handoff = open_handoff()
    h = handoff.start.handoff_id
    tier._on_entry(SOURCE, lease("a"))
    tier._on_entry(DESTINATION, lease("d"))
    tier.sweep([handoff])
    assert recorder.published == []  # nobody is gone

    tier._on_entry(SOURCE, None)
    tier.sweep([handoff], {SOURCE: "a"})
    await asyncio.gather(*tier._tasks)
    assert recorder.published == [(Failed(h, LEASE_EXPIRED), answer_id(h, SOURCE, "a", "failed"))]

    # The Failed applied: cleanup issues a cancel to the gone source, answered as it is sent.
    handoff.coordinator.handle(ActionOutcome(h, 0, SUBMITTED))
    (cancel,) = handoff.coordinator.handle(Failed(h, LEASE_EXPIRED))
    assert isinstance(cancel, CancelSource)
    tier.sent(handoff, cancel)
    await asyncio.gather(*tier._tasks)
    assert recorder.published[1:] == [
        (ActionOutcome(h, cancel.action_id, NOOP, by_tier=True), answer_id(h, SOURCE, "a", "1"))
    ]


async def test_for_a_replaced_engine_an_active_handoff_fails_and_no_cleanup_is_answered() -> None:
    # The watch learnt of "b" late: the handoff may be "b"'s, which is live and answers its
    # cleanups itself; a Noop given for it would be a cleanup "b" never runs.
    tier, recorder, gone = leases()
    active, cleaning = open_handoff(), open_handoff()
    tier._on_entry(SOURCE, lease("a"))
    tier._on_entry(DESTINATION, lease("d"))
    c = cleaning.start.handoff_id
    cleaning.coordinator.handle(ActionOutcome(c, 0, SUBMITTED))
    (cancel,) = cleaning.coordinator.handle(Failed(c, None))
    assert isinstance(cancel, CancelSource)

    tier._on_entry(SOURCE, lease("b"))
    assert gone == [(SOURCE, "a")]
    tier.sweep([active, cleaning], {SOURCE: "a"})
    await asyncio.gather(*tier._tasks)
    h = active.start.handoff_id
    assert recorder.published == [(Failed(h, LEASE_EXPIRED), answer_id(h, SOURCE, "a", "failed"))]
    tier.sent(cleaning, cancel)  # published to the live "b": not answered for
    assert not tier._tasks


async def test_when_both_engines_are_gone_the_source_is_answered_for_first() -> None:
    # The first Failed applied is the one the handoff records: which it is must follow the
    # start, not the order of a set of engine ids (which is Python's hash seed's).
    tier, recorder, _ = leases()
    handoff = open_handoff()
    h = handoff.start.handoff_id
    tier.sweep([handoff], {DESTINATION: "d", SOURCE: "a"})
    await asyncio.gather(*tier._tasks)
    assert recorder.published == [
        (Failed(h, LEASE_EXPIRED), answer_id(h, SOURCE, "a", "failed")),
        (Failed(h, LEASE_EXPIRED), answer_id(h, DESTINATION, "d", "failed")),
    ]
