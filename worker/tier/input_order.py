"""Which inputs a partition's new owner may apply now: each handoff's in stream order, across a
failover. Pure: no IO, no clock.

Why. A dead or paused owner leaves inputs delivered and never acknowledged. JetStream
redelivers them to the new owner once their ack waits run out, in that order, not in stream
order, and meanwhile delivers newer inputs (measured in tests/cluster/test_failover.py), so a
handoff's inputs can arrive out of order. The coordinator must see them in order.

Theory of operation. At its claim, the new owner learns the inputs the partition's consumer
delivered and never had acknowledged (`Bus.unacknowledged`) that the log does not say were
applied: the *orphans*, each with its subject (one subject per handoff). No one else can apply
them any more (the old owner is fenced), so each will come back to this owner. `admit` takes a
batch of deliveries and returns, in stream order, those that may be applied now; it holds the
others, to return them from a later `admit`. A delivery may be applied when no orphan of its
subject with a lower stream sequence is still unapplied, nor any delivery of its subject with a
lower sequence still held. Invariants:

- per subject, `admit` returns inputs in increasing stream order, across calls;
- each stream sequence is returned at most once (a redelivery of a held or returned input
  replaces the held one, or is dropped), unless it was given back (`give_back`: deferred);
- nothing is held for ever, once every orphan has been delivered: an orphan is never held
  behind a newer input, and a held input is released when the orphans before it are.

A reconnect orphans inputs too, without a change of owner: what the server sent on the lost
connection comes again only after its ack wait, behind newer inputs. The owner then reads the
orphans again and adds them (`add_orphans`), those it holds excepted.

What it is not: it orders only across the claims and reconnects it was told of, and only what
was left unacknowledged; a handoff's first deliveries come in stream order anyway.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar


class Delivery(Protocol):
    """What the order reads of a delivered input (`worker.bus.pull.Inbound` is one)."""

    @property
    def stream_seq(self) -> int: ...
    @property
    def subject(self) -> str: ...


D = TypeVar("D", bound=Delivery)


class InputOrder(Generic[D]):
    """The orphans of one claim, and the deliveries held behind them (see the module docstring)."""

    def __init__(self, orphans: Iterable[tuple[int, str]]) -> None:
        self._orphans: dict[str, list[int]] = {}  # subject -> unapplied orphans, ascending
        self._held: dict[int, D] = {}
        self._returned: set[int] = set()
        self.add_orphans(orphans)

    def add_orphans(self, orphans: Iterable[tuple[int, str]]) -> None:
        """More orphans (after a reconnect): those neither held nor returned already."""
        for seq, subject in orphans:
            waiting = self._orphans.setdefault(subject, [])
            if seq not in self._held and seq not in self._returned and seq not in waiting:
                bisect.insort(waiting, seq)
            if not waiting:
                del self._orphans[subject]

    def held_subjects(self) -> Mapping[int, str]:
        """The deliveries held: stream sequence -> subject."""
        return {seq: delivery.subject for seq, delivery in self._held.items()}

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def orphans(self) -> int:
        return sum(len(seqs) for seqs in self._orphans.values())

    @property
    def done(self) -> bool:
        """Every orphan applied and nothing held: from now on deliveries come in order, and
        the owner may drop this order (with the sequences it remembers)."""
        return not self._orphans and not self._held

    def take_held(self) -> list[D]:
        """The deliveries held, taken out (an owner handing over settles them)."""
        held = [self._held[seq] for seq in sorted(self._held)]
        self._held.clear()
        return held

    def give_back(self, seqs: Iterable[int]) -> None:
        """These inputs, returned by `admit`, were not applied but deferred (early: see
        worker.tier.planner): a redelivery of one may be admitted again. Their orphans stay
        counted as applied, so the handoff's newer inputs are not held behind them: an early
        input waits for its redelivery, not the handoff."""
        self._returned.difference_update(seqs)

    def admit(self, deliveries: Sequence[D]) -> list[D]:
        """Of these deliveries and those held, the ones that may be applied now, in stream
        order; the rest are held. A delivery of an input returned before is dropped."""
        for delivery in deliveries:
            if delivery.stream_seq not in self._returned:
                self._held[delivery.stream_seq] = delivery  # the latest delivery is the one to ack
        ready: list[D] = []
        blocked: set[str] = set()
        for seq in sorted(self._held):
            delivery = self._held[seq]
            subject = delivery.subject
            waiting = self._orphans.get(subject)
            if subject in blocked or (waiting and waiting[0] != seq):
                blocked.add(subject)
                continue
            if waiting:
                waiting.pop(0)
                if not waiting:
                    del self._orphans[subject]
            del self._held[seq]
            self._returned.add(seq)
            ready.append(delivery)
        return ready
