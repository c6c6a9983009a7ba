"""Encoders and decoders, built once: JSON on the wire (any language can speak it), msgpack in
the log (compact and fast to replay).

Decoding is strict: a message of the wrong shape, an unknown tag, a negative count or a
malformed id raises `msgspec.ValidationError` naming the path, before anything acts on it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from events.errors import LogCorrupt
from events.messages import Action, Input, Rejection
from events.records import SCHEMA_VERSION, LogRecord

_json_encoder = msgspec.json.Encoder()
_input_decoder = msgspec.json.Decoder(Input)
_action_decoder = msgspec.json.Decoder(Action)
_rejection_decoder = msgspec.json.Decoder(Rejection)
_record_encoder = msgspec.msgpack.Encoder(uuid_format="bytes")
_record_decoder = msgspec.msgpack.Decoder(LogRecord)

encode = _json_encoder.encode
"""Any wire message to JSON bytes."""

decode_input = _input_decoder.decode
decode_action = _action_decoder.decode
decode_rejection = _rejection_decoder.decode

encode_record = _record_encoder.encode


def decode_record(blob: bytes) -> LogRecord:
    """A stored record, upcast to the current schema."""
    try:
        record = _record_decoder.decode(blob)
    except msgspec.DecodeError as exc:
        raise LogCorrupt(f"undecodable log record: {exc}") from exc
    if record.v != SCHEMA_VERSION:
        # Upcasters for older versions go here, keyed by `record.v`; there are none yet.
        raise LogCorrupt(f"log record has schema version {record.v}, this build reads 1")
    return record


def input_digest(message: Input) -> bytes:
    """Identity of an input for durable de-duplication: equal inputs, equal digests.

    Computed over the canonical encoding (fields in declaration order), so re-encodings of
    the same message by different publishers still match.
    """
    return hashlib.blake2b(_record_encoder.encode(message), digest_size=16).digest()


def wire_schema() -> dict[str, Any]:
    """A JSON Schema (2020-12) of everything that crosses the bus, for other languages."""
    (inputs, actions, rejection), components = msgspec.json.schema_components(
        (Input, Action, Rejection), ref_template="#/$defs/{name}"
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvhandoff wire vocabulary",
        "description": "Inputs go to <prefix>.in.<handoff_id>; actions come from the worker.",
        # The unions have no component of their own; a single Struct (Rejection) already
        # is one, and `rejection` is just a reference to it.
        "$defs": {**components, "Input": inputs, "Action": actions},
        "oneOf": [{"$ref": "#/$defs/Input"}, {"$ref": "#/$defs/Action"}, rejection],
    }
