"""The engine report: the reply to a report request on `<prefix>.engines.report`.

A report request is a core NATS request with an empty body; every engine process answers with
one `EnginesReport` naming the engines it serves and the leaks it found. It is how the demo and
the load generator account for every engine, whatever it is written in, so it is part of the
wire contract (`kvhandoff schema`). A leak is a handoff whose `Complete` the engine saw while it
still holds (or still waits for) blocks or a slot for it, other than a destination whose decode
runs after activation.

Only what any engine can say is required (its id, type and role); the capacity and the counters
are the mock engines' accounting and default to zero for an engine that keeps none.
"""

from __future__ import annotations

from msgspec import Struct, field

from kvhandoff.events.ids import Count, EngineId, HandoffId, Reason
from kvhandoff.events.messages import EngineType, Role


class EngineCounters(Struct):
    """What one engine did since it started (mutable: the mock engines count in it)."""

    executed: Count = 0  # action ids executed (first receipts)
    repeated: Count = 0  # repeated action ids answered with the stored outcome
    malformed: Count = 0  # messages that did not decode as an action
    dropped: Count = 0  # receipts dropped by fault injection
    ignored: Count = 0  # receipts ignored while silent
    delayed: Count = 0  # receipts delayed by fault injection
    duplicated: Count = 0  # outcomes and facts published twice
    injected_failures: Count = 0


class EngineStatus(Struct, frozen=True):
    """One engine of the process: who it is and, if it keeps them, its capacity and counters."""

    engine_id: EngineId
    engine_type: EngineType
    role: Role
    silent: bool = False
    blocks_total: Count = 0
    blocks_held: Count = 0
    blocks_decoding: Count = 0
    slots_total: Count = 0
    slots_held: Count = 0
    waiting: Count = 0
    open_handoffs: Count = 0
    counters: EngineCounters = field(default_factory=EngineCounters)


class Leak(Struct, frozen=True):
    """Blocks or a slot held (or still awaited) for a handoff that the worker completed."""

    engine_id: EngineId
    handoff_id: HandoffId
    state: Reason
    blocks: Count = 0
    waiting: bool = False


class EnginesReport(Struct, frozen=True, tag="engines_report", tag_field="type"):
    """One engine process's answer on `<prefix>.engines.report`."""

    process: Reason
    engines: list[EngineStatus]
    leaks: list[Leak]
