"""What the event log stores: one record per accepted input and per issued action.

A handoff's log is its `InputRecord`s and `ActionRecord`s in sequence order; replaying the
inputs through a fresh coordinator must re-derive exactly the logged actions. Every record
carries the schema version it was written with (`v`); `events.codec.decode_record` is the one
place that upcasts an older form when a stored shape changes.

Schema history:
    1  first release.
"""

from __future__ import annotations

from msgspec import Struct

from events.messages import Action, Input

SCHEMA_VERSION = 1


class InputRecord(Struct, frozen=True, tag="input", tag_field="record"):
    """An input the coordinator accepted, with the worker's clock when it was logged."""

    at_ms: int
    input: Input
    v: int = SCHEMA_VERSION


class ActionRecord(Struct, frozen=True, tag="action", tag_field="record"):
    """An action the coordinator issued in response to the input logged just before it."""

    at_ms: int
    action: Action
    v: int = SCHEMA_VERSION


LogRecord = InputRecord | ActionRecord
