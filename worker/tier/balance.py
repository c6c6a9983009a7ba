"""Which worker should own which partition: the balance rule of the tier, pure (no IO, no clock).

Partitions. The input stream is split into P partitions (see "Partitions" in worker.tier.streams):
the stream's transform `{{partition(P,1)}}` puts a handoff in partition FNV-1a-32(its id) mod P, the
id hashed as the text token of its subject. `partition_of` is that same function, so that a worker
can check the partition an input arrived in, and a test can aim inputs at a partition.

The share. Every worker that the membership bucket lists (and the worker itself, which always
counts itself live: its own key may have lapsed while NATS was out of reach) computes the same
`assign(P, live)` from the same set of names, whatever order it read them in. Each live worker
gets floor(P / live) or ceil(P / live) partitions (the issue's ceil(P / live) is the most any
worker gets), and every partition gets exactly one worker. The rule is rendezvous hashing with
bounded loads: partition by partition, in order, the worker that ranks highest for it (by a hash
of the partition and the worker's name) among those with room takes it; a worker has room while
it holds less than floor(P / live), or exactly that while fewer than P mod live workers hold
ceil. Enough room always remains, because the quotas sum to P.

What it is not. The assignment is a target, not ownership: a worker pulls only the partitions
`assign` gives it, and hands over the others (drain, ack, unpin), but who owns a partition is
decided by its consumer's pin and fenced by the compare-and-set log (worker.tier.ownership). Two
workers that briefly disagree on the member set (one saw a key expire, the other not yet) both
pull a partition at worst; the pin serves one of them and the fence refuses the other's writes.
Nor is the rule minimal in movement: when a worker joins, the partitions it takes move, and a
few others may move between the old workers as the quotas shift (measured: for P = 16 and
2 to 8 workers, at most 5 beyond those the newcomer takes).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from uuid import UUID

_FNV32_OFFSET = 0x811C9DC5
_FNV32_PRIME = 0x01000193
_FNV64_OFFSET = 0xCBF29CE484222325
_FNV64_PRIME = 0x100000001B3
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _fnv1a(data: bytes, offset: int, prime: int, mask: int) -> int:
    value = offset
    for byte in data:
        value = ((value ^ byte) * prime) & mask
    return value


def partition_of(handoff_id: UUID, partitions: int) -> int:
    """The partition the input stream's transform puts `handoff_id` in (nats-server's
    `getHashPartition`: FNV-1a, 32 bits, of the subject token, modulo the count)."""
    if partitions < 1:
        raise ValueError(f"partition_of: {partitions} partitions; there must be at least 1")
    token = str(handoff_id).encode()
    return _fnv1a(token, _FNV32_OFFSET, _FNV32_PRIME, _MASK32) % partitions


def fair_share(partitions: int, live: int) -> int:
    """The most partitions any one of `live` workers is assigned: ceil(P / live)."""
    if partitions < 1 or live < 1:
        raise ValueError(f"fair_share: {partitions} partitions over {live} workers")
    return -(-partitions // live)


def _rank(partition: int, worker: str) -> int:
    return _fnv1a(f"{partition}/{worker}".encode(), _FNV64_OFFSET, _FNV64_PRIME, _MASK64)


def assign(partitions: int, workers: Collection[str]) -> dict[int, str]:
    """Each partition's worker among `workers` (names, each unique; see the module docstring)."""
    if partitions < 1 or not workers:
        raise ValueError(f"assign: {partitions} partitions over {len(workers)} workers")
    names = sorted(set(workers))
    floor, at_ceil_left = divmod(partitions, len(names))
    load = dict.fromkeys(names, 0)
    owners: dict[int, str] = {}
    for partition in range(partitions):
        # Highest rank first; the name breaks a (vanishingly unlikely) tie, so order never counts.
        for name in sorted(names, key=lambda n: (-_rank(partition, n), n)):
            if load[name] < floor or (load[name] == floor and at_ceil_left):
                if load[name] == floor:
                    at_ceil_left -= 1
                load[name] += 1
                owners[partition] = name
                break
    return owners


@dataclass(frozen=True, slots=True)
class Moves:
    """What one worker should do to reach its share: partitions to take, and to hand over."""

    take: frozenset[int]
    hand_over: frozenset[int]


def rebalance(partitions: int, live: Collection[str], me: str, owned: Collection[int]) -> Moves:
    """The partitions `me` should start pulling and those it should hand over, given the live
    workers (`me` counts as live whether or not it is listed) and the partitions it owns."""
    target = {p for p, name in assign(partitions, {*live, me}).items() if name == me}
    held = set(owned)
    return Moves(take=frozenset(target - held), hand_over=frozenset(held - target))
