"""The phase of one partition's owner, and every move between phases, in one table. Pure: no IO.

Theory of operation. A `worker.tier.owner.PartitionOwner` goes through these phases, and the
phase alone says what it may do next (see worker.tier.owner for each step):

    CLAIMING       it pulls and waits: for a pin (the first batch under a pin id it has not
                   claimed under), or for the partition to be vacant. It appends nothing,
                   acts on nothing. Where every owner starts, and where a doubt or a lost
                   pin sends it back.
    CATCHING_UP    it claims the partition's log (`PartitionLog.claim`), reads who left what
                   unacknowledged, and has the partition caught up (`Partition.claimed`).
    OWNING         claimed under the pin it pulls with: it decides, appends, acts, snapshots.
    OWNING_UNPINNED claimed while nobody was pinned (see "Vacant partitions"), and no batch
                   came since: as OWNING, except that a pull refused with 423 means another
                   worker is pinned, and whose claim fences this one; it stops at once.
    HANDING_OVER   stopped, and the batch in hand finished: it gives back what it holds,
                   logs `HandedOver` if it had claimed, and unpins if pinned.
    HANDED_OVER    ended with a clean hand-over: the next claim counts as a hand-over.
    FENCED         ended because another worker's claim refused an append: it acts no more.
    RELEASED       ended otherwise: it failed, another worker was pinned to a partition it
                   had claimed while vacant, or its hand-over was incomplete (the next owner
                   waits for the priority timeout).

The moves (`Event`, a fact, past tense) and where each leads, per phase, are `MOVES`:

    CLAIMING         claim_began -> CATCHING_UP      doubted -> CLAIMING
                     stopped -> HANDING_OVER          failed -> RELEASED
    CATCHING_UP      claimed -> OWNING                claimed_vacant -> OWNING_UNPINNED
                     doubted -> CLAIMING              fenced -> FENCED
                     failed -> RELEASED
    OWNING           claim_began -> CATCHING_UP (pinned anew: someone may have owned it since)
                     doubted -> CLAIMING              fenced -> FENCED
                     pin_lost -> CLAIMING             stopped -> HANDING_OVER
                     failed -> RELEASED
    OWNING_UNPINNED  pinned -> OWNING                 pin_taken -> RELEASED
                     doubted -> CLAIMING              fenced -> FENCED
                     stopped -> HANDING_OVER          failed -> RELEASED
    HANDING_OVER     handed_over -> HANDED_OVER       incomplete -> RELEASED
                     failed -> RELEASED
    HANDED_OVER, FENCED, RELEASED: none (an owner ends there; the tier starts a new one)

`doubted`: an append, a claim or a read of the bus failed without an answer (NATS out of
reach): whether it landed is unknown, so the owner claims anew, which reads the log and learns
it. `pin_lost`: idle for a while, the owner read that the consumer names another pin than the
one it claimed under, or none, so no delivery will tell it (see "Lapsed pins" in
worker.tier.owner); it waits for a pin, or for the partition to be vacant, as at its start.
`incomplete`: a step of the hand-over failed (a refused `HandedOver` included). `failed`:
an error the owner does not handle ended it; its caller learns the error, the tier logs it and
starts a new owner at its next round.

Invariants. `PartitionPhase.move` is the one place the phase changes. A move the table does
not hold raises `PhaseError` naming the partition, the phase and the event, and leaves the
phase as it was (as h11's `_state.py` does for a connection). The three ends have no move out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from kvhandoff.worker.errors import PhaseError


class Phase(enum.Enum):
    """Where an owner of one partition is (see the module docstring)."""

    CLAIMING = "claiming"
    CATCHING_UP = "catching up"
    OWNING = "owning"
    OWNING_UNPINNED = "owning, not pinned yet"
    HANDING_OVER = "handing over"
    HANDED_OVER = "handed over"
    FENCED = "fenced"
    RELEASED = "released"

    @property
    def claimed(self) -> bool:
        """It holds a claim on the partition's log: it may append and act."""
        return self in (Phase.OWNING, Phase.OWNING_UNPINNED)

    @property
    def ended(self) -> bool:
        """The owner acts no more, and no move leads out."""
        return not MOVES[self]


class Event(enum.Enum):
    """What happened to an owner, that moves its phase (see the module docstring)."""

    CLAIM_BEGAN = "claim_began"
    CLAIMED = "claimed"
    CLAIMED_VACANT = "claimed_vacant"
    PINNED = "pinned"
    PIN_TAKEN = "pin_taken"
    PIN_LOST = "pin_lost"
    DOUBTED = "doubted"
    FENCED = "fenced"
    STOPPED = "stopped"
    HANDED_OVER = "handed_over"
    INCOMPLETE = "incomplete"
    FAILED = "failed"


def _moves(table: dict[Phase, dict[Event, Phase]]) -> Mapping[Phase, Mapping[Event, Phase]]:
    return MappingProxyType({phase: MappingProxyType(moves) for phase, moves in table.items()})


MOVES: Mapping[Phase, Mapping[Event, Phase]] = _moves(
    {
        Phase.CLAIMING: {
            Event.CLAIM_BEGAN: Phase.CATCHING_UP,
            Event.DOUBTED: Phase.CLAIMING,
            Event.STOPPED: Phase.HANDING_OVER,
            Event.FAILED: Phase.RELEASED,
        },
        Phase.CATCHING_UP: {
            Event.CLAIMED: Phase.OWNING,
            Event.CLAIMED_VACANT: Phase.OWNING_UNPINNED,
            Event.DOUBTED: Phase.CLAIMING,
            Event.FENCED: Phase.FENCED,
            Event.FAILED: Phase.RELEASED,
        },
        Phase.OWNING: {
            Event.CLAIM_BEGAN: Phase.CATCHING_UP,
            Event.DOUBTED: Phase.CLAIMING,
            Event.FENCED: Phase.FENCED,
            Event.PIN_LOST: Phase.CLAIMING,
            Event.STOPPED: Phase.HANDING_OVER,
            Event.FAILED: Phase.RELEASED,
        },
        Phase.OWNING_UNPINNED: {
            Event.PINNED: Phase.OWNING,
            Event.PIN_TAKEN: Phase.RELEASED,
            Event.DOUBTED: Phase.CLAIMING,
            Event.FENCED: Phase.FENCED,
            Event.STOPPED: Phase.HANDING_OVER,
            Event.FAILED: Phase.RELEASED,
        },
        Phase.HANDING_OVER: {
            Event.HANDED_OVER: Phase.HANDED_OVER,
            Event.INCOMPLETE: Phase.RELEASED,
            Event.FAILED: Phase.RELEASED,
        },
        Phase.HANDED_OVER: {},
        Phase.FENCED: {},
        Phase.RELEASED: {},
    }
)


class PartitionPhase:
    """One owner's phase of one partition; `move` is the only way to change it."""

    def __init__(self, partition: int, phase: Phase = Phase.CLAIMING) -> None:
        self.partition = partition
        self._now = phase

    @property
    def now(self) -> Phase:
        return self._now

    def move(self, event: Event) -> Phase:
        """Move on `event`, as `MOVES` says; the new phase. `PhaseError`, and no change, if
        the table holds no such move from the phase it is in."""
        after = MOVES[self._now].get(event)
        if after is None:
            raise PhaseError(
                f"partition {self.partition}: no move on {event.value!r} from phase "
                f"{self._now.value!r} (it may move on "
                f"{', '.join(repr(e.value) for e in MOVES[self._now]) or 'nothing: it ended'})"
            )
        self._now = after
        return after

    def __repr__(self) -> str:
        return f"PartitionPhase(partition={self.partition}, now={self._now})"
