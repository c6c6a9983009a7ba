"""What the event log stores: one record per accepted input and per issued action.

A handoff's log is its `InputRecord`s and `ActionRecord`s in sequence order; replaying the
inputs through a fresh coordinator must re-derive exactly the logged actions. Every record
carries the schema version it was written with (`v`); `events.codec.decode_record` is the one
place that upcasts an older form when a stored shape changes.

Schema history:
    1  first release.

A record's self-contained form is the msgpack map of its Struct (`events.codec.encode_record`).
The SQLite log's layout 2 stores it split instead (`events.codec.split_record`): the handoff id
once per handoff, in the handoff's row, rather than in every record; the message type as a
number (`TYPE_CODES`) rather than its tag; the time in a column; and only the message's other
fields as msgpack. `events.codec.join_record` puts a row back together into the very bytes of
the self-contained form, so a split record is still a schema-1 record, read by the same decoder.
A later schema version needs its own type numbers, or a new layout, to tell its rows apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from msgspec import Struct

from kvhandoff.events.messages import Action, Input

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

#: The number that stands for each message type (by its tag) in a split record. Like the tags,
#: the numbers are stored, so they never change, and a new message type takes a new number.
TYPE_CODES: Final[Mapping[str, int]] = MappingProxyType(
    {
        # Inputs.
        "start_handoff": 1,
        "source_held": 2,
        "destination_reserved": 3,
        "transfer_completed": 4,
        "failed": 5,
        "timed_out": 6,
        "canceled": 7,
        "action_outcome": 8,
        # Actions.
        "submit_prefill": 9,
        "reserve_destination": 10,
        "start_transfer": 11,
        "activate_destination": 12,
        "release_source": 13,
        "cancel_source": 14,
        "cancel_destination": 15,
        "complete": 16,
    }
)

#: The type number of a record kept whole, in its self-contained form, rather than split: one
#: that did not decode when a layout-1 log was converted, kept as it was written.
VERBATIM: Final = 0
