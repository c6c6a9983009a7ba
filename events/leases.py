"""Engine leases: what an engine keeps alive in the tier's lease bucket, and the names of the
answers the tier gives for an engine whose lease is gone. Part of the wire contract.

An engine built on `kvhandoff.client.Engine` holds a lease on its engine id: the key
`<engine_id>` of the bucket `Subjects.lease_bucket`, whose value is an `EngineLease` and whose
message expires after the lease's TTL unless the engine stores it again (`client.lease`). A
fresh `incarnation` per lease taken tells a restarted engine, or one that fenced itself and came
back, from the one before it.

When a lease expires, or a new incarnation replaces it, the tier answers for the old incarnation
(`worker.tier.leases`): a `Failed(reason=LEASE_EXPIRED)` for each of its handoffs still active, and
`ActionOutcome(Noop, by_tier=True)` for each cleanup it owes. Each answer is published with the
message id `answer_id` names, so that two workers answering the same expiry (a failover, a
redelivered watch) store it once.
"""

from __future__ import annotations

from uuid import UUID

from msgspec import Struct

from kvhandoff.events.ids import EngineId

LEASE_EXPIRED = "engine lease expired"
ENGINE_UNAVAILABLE = "engine unavailable"


class EngineLease(Struct, frozen=True, tag="engine_lease", tag_field="type"):
    """The value of an engine's key in the lease bucket."""

    engine_id: EngineId
    incarnation: str
    ttl_ms: int


def answer_id(handoff_id: UUID, engine_id: str, incarnation: str, what: str) -> str:
    """The `Nats-Msg-Id` of the tier's answer `what` (`failed`, or an action id) for one
    incarnation of an engine in one handoff: the same from whichever worker gives it."""
    return f"lease:{handoff_id}:{engine_id}:{incarnation}:{what}"
