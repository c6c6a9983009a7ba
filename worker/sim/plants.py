"""Planted bugs: switches that break the tier the way a plausible change would, for `--plant`.

Why. A simulation that finds nothing proves little until it is shown to find what it should:
each plant here is a bug a tired engineer could write into the tier (a line moved, a check
dropped, a header left out), and the simulation must find each within the CI budget of seeds
(tests/sim/test_plants.py says how many it took).

Theory of operation. The tier's code has no plant switches. A plant names one function or
method of the tier (worker/tier/*, worker/bus/*) and a variant of it, broken in one place: a
wrapper around the real one, or, where the step it breaks is no smaller than the function, a
copy of it with the one line changed. A copy would drift silently when the original changes:
tests/sim/test_plants_copies.py holds each to its original, all but the planted lines.
`planted(name)` replaces the real one by the variant for the length of a `with` block (a run:
worker.sim.world wraps `simulate` in it when `Scenario.plant` names one) and puts it back
after, however the block ends. The variant counts in its `Planting` each time its change made a
difference (an input acknowledged before its append, a 423 ignored, ...): a plant that a run
never reached cannot be found by that run, and the count says so.

Each `Plant` also says what exposes it (`exposed_by`): the fault that makes the broken line
matter and the check that sees the damage. Invariants:

- outside `planted`, and after it, the tier's code is its own: the variant is swapped in by
  `setattr` on the one attribute and the original put back in a `finally`;
- one plant at a time: planting while another is planted raises, since two would make a failure
  impossible to attribute;
- a variant reads clocks and ids only through worker.ambient, as the tier does, so a planted
  run is as deterministic as any other: its seed replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvhandoff.worker import ambient
from kvhandoff.worker.bus import publish as bus_publish
from kvhandoff.worker.bus import pull as bus_pull
from kvhandoff.worker.bus.failures import STATUS
from kvhandoff.worker.bus.pull import Inbound
from kvhandoff.worker.errors import Fenced
from kvhandoff.worker.tier import leases, owner, ownership, partition, timers
from kvhandoff.worker.tier.entries import decode_state, encode_entry
from kvhandoff.worker.tier.ownership import CaughtUp

# A variant is made from the original and the planting it counts its effects in.
Variant = Callable[[Any, "Planting"], Any]


@dataclass(frozen=True)
class Plant:
    """One planted bug: where it goes, the variant that replaces the original there, and what
    finds it."""

    name: str
    description: str  # one line: the change, as its author might have meant it
    target: object  # the class or module whose attribute the variant replaces
    attribute: str
    variant: Variant
    exposed_by: str  # the fault that makes it matter, and the check that sees it


@dataclass
class Planting:
    """A plant in place: how many times its change made a difference so far."""

    plant: Plant | None
    hits: int = 0

    def hit(self, times: int = 1) -> None:
        self.hits += times


# --- The variants -------------------------------------------------------------------------


def _append_without_cas(original: Any, planting: Planting) -> Any:
    """`Publishing.append_expecting`, a copy without `Nats-Expected-Last-Subject-Sequence`:
    "the msg id dedups the retries already"."""

    async def append_expecting(
        self: bus_publish.Publishing,
        subject: str,
        payload: bytes,
        last_seq: int,
        *,
        give_up_after_s: float = 5.0,
        rollup: bool = False,
    ) -> int:
        headers = {"Nats-Msg-Id": ambient.new_id()}
        if rollup:
            headers[bus_publish._ROLLUP] = bus_publish._ROLLUP_SUBJECT
        planting.hit()
        what = f"append to {subject} expecting last sequence {last_seq}"
        return await self._store(subject, payload, headers, give_up_after_s, what)

    return append_expecting


def _ack_before_append(original: Any, planting: Planting) -> Any:
    """`PartitionOwner._handle` acknowledging each delivery as it is handled: "ack on receipt,
    the log has it a moment later"."""

    async def _handle(self: owner.PartitionOwner, batch: list[Inbound]) -> None:
        for inbound in batch:
            await inbound.ack()
        planting.hit(len(batch))
        await original(self, batch)

    return _handle


def _act_when_fenced(original: Any, planting: Planting) -> Any:
    """`PartitionOwner._act_after_append` acting on a batch whose append was fenced, then
    stopping: "what was decided is right; only the log was late"."""

    async def _act_after_append(
        self: owner.PartitionOwner, append: asyncio.Future[int], fresh: list[Inbound]
    ) -> None:
        try:
            await original(self, append, fresh)
        except Fenced:
            planting.hit()
            await self._steps.act(fresh)
            raise

    return _act_after_append


def _publish_before_append(original: Any, planting: Planting) -> Any:
    """`PartitionOwner._act_after_append`, a copy that acts while the append is on its way:
    "it will land". (tests/sim/test_plants_copies.py holds it to the original.)"""

    async def _act_after_append(
        self: owner.PartitionOwner, append: asyncio.Future[int], fresh: list[Inbound]
    ) -> None:
        if not append.done():
            planting.hit()
        await self._steps.act(fresh)
        await append
        self.applied += len(fresh)

    return _act_after_append


def _ignore_423(original: Any, planting: Planting) -> Any:
    """`Pull._on_status` taking a 423 for a sign of life, like a heartbeat: "423 only says
    someone else asked; our requests are fine". It keeps its pin id, and the owner never hears
    that another worker is pinned."""

    def _on_status(self: bus_pull.Pull, subject: bytes, headers: dict[str, str]) -> None:
        if headers.get(STATUS, "") == "423":
            planting.hit()
            headers = {**headers, STATUS: "100"}  # the change: read as an idle heartbeat
        original(self, subject, headers)

    return _on_status


def _orphans_in_stream_order(original: Any, planting: Planting) -> Any:
    """worker.tier.owner's `unacknowledged`, as a claim reads it, answering nothing: "JetStream
    redelivers what the old owner left first, in stream order", so no input waits for an
    orphan of its handoff (see "Order" in worker.tier.owner)."""

    async def unacknowledged(*args: Any, **kwargs: Any) -> list[tuple[int, str]]:
        left: list[tuple[int, str]] = await original(*args, **kwargs)
        planting.hit(len(left))
        return []

    return unacknowledged


def _timer_fires_twice(original: Any, planting: Planting) -> Any:
    """`HandoffTimers._expire` putting the deadline back after it fired, as the path for a
    `TimedOut` that could not be published does: "in case the publish was lost"."""

    async def _expire(self: timers.HandoffTimers, handoff_id: Any) -> None:
        await original(self, handoff_id)
        if handoff_id in self._planner.open:
            planting.hit()
            self._deadlines.schedule(handoff_id, ambient.wall_s() + timers._PUBLISH_FAILED_PAUSE_S)

    return _expire


def _timer_fires_early(original: Any, planting: Planting) -> Any:
    """`HandoffTimers.rearm` giving each adopted handoff's deadline the retry's due time, one
    interval from now, rather than its row's deadline (the line beside it, copied)."""

    def rearm(self: timers.HandoffTimers, adopted: Any) -> None:
        adopted = list(adopted)
        original(self, adopted)
        retry_at = ambient.wall_s() + self._retry_interval_s
        for handoff in adopted:
            if handoff.row.deadline_at_ms / 1000 > retry_at:
                planting.hit()
            self._deadlines.schedule(handoff.start.handoff_id, retry_at)

    return rearm


def _no_outbox_barrier(original: Any, planting: Planting) -> Any:
    """`Publishing.confirm`, the barrier a partition's publishes wait for, returning at once:
    "the publish returned, so NATS has it". A lot of actions that a lost connection swallowed
    is marked published and never published again."""

    async def confirm(
        self: bus_publish.Publishing, connection: int, stored: Sequence[asyncio.Future[int]]
    ) -> None:
        planting.hit()

    return confirm


def _snapshot_without_tombstones(original: Any, planting: Planting) -> Any:
    """`Partition.snapshot` leaving out the tombstones: "a snapshot holds the live state, and
    ended handoffs are not live". A claim that reads it forgets that those handoffs ended, and
    takes a late input of one for a handoff it never heard of."""

    async def snapshot(self: partition.Partition) -> bytes:
        state = decode_state(await original(self), "a snapshot being written")
        if state.tombstones:
            planting.hit()
        return encode_entry(msgspec.structs.replace(state, tombstones=[]))

    return snapshot


def _lease_expiry_ignored(original: Any, planting: Planting) -> Any:
    """`EngineLeases._on_entry` skipping a key without a value ("nothing to decode"): an
    engine whose lease expired stays live to the tier, which admits starts naming it and never
    answers for it (until a new incarnation replaces it)."""

    def _on_entry(self: leases.EngineLeases, engine_id: str, value: bytes | None) -> None:
        if value is None:
            planting.hit()
            return
        original(self, engine_id, value)

    return _on_entry


def _claim_forgets_applied(original: Any, planting: Planting) -> Any:
    """`PartitionLog.claim` handing its owner no applied inputs: "a new claim starts from a
    clean slate". The redeliveries of what the previous owner appended and did not acknowledge
    are applied again."""

    async def claim(self: ownership.PartitionLog) -> CaughtUp:
        caught: CaughtUp = await original(self)
        planting.hit(len(caught.applied))
        caught.applied = set()
        return caught

    return claim


# --- The plants ---------------------------------------------------------------------------

_FORK = "two owners at once (a paused owner, pin overlap)"

_PLANTS: Sequence[Plant] = (
    Plant(
        "append-without-cas",
        "the log's appends leave out their expected last sequence: nobody is ever fenced",
        bus_publish.Publishing,
        "append_expecting",
        _append_without_cas,
        "any run: the chain check reads each entry's expected sequence (with two owners at "
        "once, a fork too)",
    ),
    Plant(
        "ack-before-append",
        "an owner acknowledges each input as it handles it, before its append",
        owner.PartitionOwner,
        "_handle",
        _ack_before_append,
        "any run: the ack-after-append check; with a worker crash, a lost input (liveness)",
    ),
    Plant(
        "act-when-fenced",
        "an owner whose append was fenced publishes that batch's actions anyway, then stops",
        owner.PartitionOwner,
        "_act_after_append",
        _act_when_fenced,
        f"{_FORK}, or a fence after an election or lost acks; the actions check",
    ),
    Plant(
        "ignore-423",
        "the pull takes a 423 for a heartbeat: it keeps its stale pin id and never re-pins",
        bus_pull.Pull,
        "_on_status",
        _ignore_423,
        "a pin lost while its owner runs (an unpin by a hand-over, a pause past the priority "
        "timeout); liveness: the partition's handoffs never end",
    ),
    Plant(
        "orphans-in-stream-order",
        "a new owner trusts redeliveries to come in stream order: no input waits for orphans",
        owner,
        "unacknowledged",
        _orphans_in_stream_order,
        "a failover with inputs left unacknowledged (crash, pause); the final-states-by-the-"
        "core check",
    ),
    Plant(
        "publish-before-append",
        "an owner acts on a batch while its append is on its way, before it returned",
        owner.PartitionOwner,
        "_act_after_append",
        _publish_before_append,
        "any run: actions-only-from-appended-entries (published before their entry); "
        f"{_FORK} for actions of an entry that never landed",
    ),
    Plant(
        "timer-fires-twice",
        "a deadline that fired is put back, as if its TimedOut had not been published",
        timers.HandoffTimers,
        "_expire",
        _timer_fires_twice,
        "a deadline that fires while its handoff's TimedOut, published and acknowledged, waits "
        "a second to be applied (silent engines, a backlog); the timed-out-again check",
    ),
    Plant(
        "timer-fires-early",
        "a claim rearms each adopted handoff's deadline one retry interval from now",
        timers.HandoffTimers,
        "rearm",
        _timer_fires_early,
        "a claim with open handoffs (crash, pause, churn); the timers-never-early check",
    ),
    Plant(
        "no-outbox-barrier",
        "a partition takes its publishes as confirmed without the barrier",
        bus_publish.Publishing,
        "confirm",
        _no_outbox_barrier,
        "a reset or a NATS node loss while actions are in flight: the outbox check (a mark of "
        "an action the server never read), or a Complete that never comes",
    ),
    Plant(
        "snapshot-without-tombstones",
        "snapshots leave out the tombstones of the handoffs that ended lately",
        partition.Partition,
        "snapshot",
        _snapshot_without_tombstones,
        "any run that snapshots a partition after a handoff of it ended: the snapshots check "
        "(a snapshot forgets a handoff its log started); its damage, a late input of the "
        "ended handoff refused as unknown by a claim from that snapshot, needs a worker "
        "without the file (crash without its file, churn) too",
    ),
    Plant(
        "lease-expiry-ignored",
        "the tier ignores a lease's delete marker: a gone engine's handoffs wait for it",
        leases.EngineLeases,
        "_on_entry",
        _lease_expiry_ignored,
        "the engines' host down past a lease TTL (its leases expire) while starts still name "
        "its engines; the lease check: a start accepted a TTL after its engine's lease expired",
    ),
    Plant(
        "claim-forgets-applied",
        "a claim hands its owner no applied inputs: redeliveries are applied again",
        ownership.PartitionLog,
        "claim",
        _claim_forgets_applied,
        "a failover with inputs appended but not acknowledged (crash, pause, lost acks); "
        "the applied-exactly-once check",
    ),
)

PLANTS: Mapping[str, Plant] = {plant.name: plant for plant in _PLANTS}

_active: list[Planting] = []  # the planting in place, if any (one at a time)


@contextlib.contextmanager
def planted(name: str | None) -> Iterator[Planting]:
    """Plant `name` for the length of the block (None: nothing, the tier as it is); the
    `Planting` counts what the plant changed. `ValueError` for an unknown name, `RuntimeError`
    if another plant is in place."""
    if name is None:
        yield Planting(None)
        return
    plant = PLANTS.get(name)
    if plant is None:
        raise ValueError(f"no plant named {name!r}; the plants are: {', '.join(PLANTS)}")
    if _active:
        raise RuntimeError(
            f"cannot plant {name!r}: {_active[0].plant.name if _active[0].plant else '?'} is "
            "planted already, and two at once could not be told apart"
        )
    original = vars(plant.target)[plant.attribute]
    planting = Planting(plant)
    setattr(plant.target, plant.attribute, plant.variant(original, planting))
    _active.append(planting)
    try:
        yield planting
    finally:
        _active.clear()
        setattr(plant.target, plant.attribute, original)
