"""The order a partition's new owner applies inputs in (worker.tier.input_order), without NATS,
property-based: whatever order the orphans (inputs the old owner was given and never had
acknowledged) come back in, interleaved with newer inputs and with redeliveries of anything,
each handoff's inputs are admitted in stream order, each once, and all of them in the end.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.worker.tier.input_order import InputOrder


@dataclass(frozen=True)
class Delivered:
    stream_seq: int
    subject: str


@dataclass(frozen=True)
class Failover:
    inputs: list[Delivered]
    applied: set[int]  # before the claim, by the old owner
    orphans: list[tuple[int, str]]
    batches: list[list[Delivered]]


@st.composite
def failovers(draw: st.DrawFn) -> Failover:
    """The partition's inputs; those applied before the claim; the orphans; the new owner's
    batches of deliveries."""
    count = draw(st.integers(min_value=0, max_value=40))
    subjects = [draw(st.sampled_from("abcd")) for _ in range(count)]
    inputs = [Delivered(seq, subject) for seq, subject in enumerate(subjects, start=1)]
    delivered_up_to = draw(st.integers(min_value=0, max_value=count))
    # The old owner applied (and maybe acknowledged) some of what it was given.
    applied = {i.stream_seq for i in inputs[:delivered_up_to] if draw(st.booleans())}
    orphans = [i for i in inputs[:delivered_up_to] if i.stream_seq not in applied]
    newer = inputs[delivered_up_to:]
    # Orphans come back in any order, among the newer inputs (which come in stream order),
    # and anything may come again.
    order = draw(st.permutations(orphans + newer))
    newer_positions = sorted(order.index(i) for i in newer)
    for position, item in zip(newer_positions, newer, strict=True):
        order[position] = item
    again = draw(st.lists(st.sampled_from(order), max_size=10)) if order else []
    stream = list(order)
    for item in again:  # a redelivery comes after the first delivery
        first = stream.index(item)
        stream.insert(draw(st.integers(min_value=first + 1, max_value=len(stream))), item)
    cuts = sorted(draw(st.sets(st.integers(min_value=0, max_value=len(stream)))))
    batches = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    return Failover(inputs, applied, [(o.stream_seq, o.subject) for o in orphans], batches)


@given(failovers())
def test_each_handoff_is_admitted_in_stream_order_once_and_completely(
    failover: Failover,
) -> None:
    order: InputOrder[Delivered] = InputOrder(failover.orphans)
    admitted: list[Delivered] = []
    for batch in failover.batches:
        admitted += order.admit(batch)
    by_subject: dict[str, list[int]] = defaultdict(list)
    for delivery in admitted:
        by_subject[delivery.subject].append(delivery.stream_seq)
    for subject, seqs in by_subject.items():
        assert seqs == sorted(seqs), f"{subject} admitted out of order: {seqs}"
    assert len(admitted) == len({d.stream_seq for d in admitted})
    assert {d.stream_seq for d in admitted} == {i.stream_seq for i in failover.inputs} - (
        failover.applied
    )
    assert order.done


def test_a_newer_input_waits_for_its_handoffs_orphan_and_others_do_not() -> None:
    order: InputOrder[Delivered] = InputOrder([(3, "h"), (5, "h")])
    assert order.admit([Delivered(9, "h"), Delivered(10, "g")]) == [Delivered(10, "g")]
    assert order.admit([Delivered(5, "h")]) == []  # 3 comes first
    assert order.held == 2 and order.orphans == 2
    assert order.admit([Delivered(3, "h"), Delivered(9, "h")]) == [
        Delivered(3, "h"),
        Delivered(5, "h"),
        Delivered(9, "h"),
    ]
    assert order.done
    assert order.admit([Delivered(5, "h")]) == []  # a late redelivery of what was admitted


def test_an_input_given_back_is_admitted_again_and_holds_nothing_back() -> None:
    """An orphan that the coordinator found early is deferred (given back): its redelivery is
    admitted again, and the handoff's newer inputs do not wait for it."""
    order: InputOrder[Delivered] = InputOrder([(3, "h")])
    assert order.admit([Delivered(3, "h"), Delivered(4, "g")]) == [
        Delivered(3, "h"),
        Delivered(4, "g"),
    ]
    order.give_back([3])
    assert order.admit([Delivered(7, "h")]) == [Delivered(7, "h")]
    assert order.admit([Delivered(3, "h"), Delivered(4, "g")]) == [Delivered(3, "h")]
    assert order.done


def test_orphans_a_reconnect_adds_hold_newer_inputs_but_not_what_is_held_or_returned() -> None:
    """A reconnect loses what the server sent on the old connection: those orphans are added,
    and the handoff's newer inputs wait for them; what the order holds or returned already is
    no orphan."""
    order: InputOrder[Delivered] = InputOrder([(3, "h")])
    assert order.admit([Delivered(5, "h"), Delivered(3, "h")]) == [
        Delivered(3, "h"),
        Delivered(5, "h"),
    ]
    assert order.admit([Delivered(8, "g")]) == [Delivered(8, "g")]
    order.add_orphans([(3, "h"), (6, "h"), (7, "g")])  # 3 was returned
    assert order.orphans == 2
    assert order.admit([Delivered(9, "h"), Delivered(10, "g")]) == []
    assert order.held_subjects() == {9: "h", 10: "g"}
    order.add_orphans([(9, "h")])  # held: not an orphan
    assert order.orphans == 2
    assert order.admit([Delivered(7, "g"), Delivered(6, "h")]) == [
        Delivered(6, "h"),
        Delivered(7, "g"),
        Delivered(9, "h"),
        Delivered(10, "g"),
    ]
    assert order.done
