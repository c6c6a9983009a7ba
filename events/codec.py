"""Encoders and decoders, built once: JSON on the wire (any language can speak it), msgpack in
the log (compact and fast to replay).

Decoding from the wire is total and strict. For any bytes at all, `decode_input`,
`decode_action` and `decode_rejection` return a message or raise `msgspec.DecodeError`, and
nothing else:

- `msgspec.ValidationError` (a subclass) when the JSON is well-formed but not a message: a wrong
  shape, an unknown tag, a negative count, a malformed id, or any value outside its bound in
  `events.ids`. It names the path.
- a plain `msgspec.DecodeError` when the bytes are not JSON, including bytes that are not UTF-8
  anywhere (even inside a field that is ignored), and JSON nested so deeply that
  decoding it would recurse past Python's limit (msgspec recurses even through a field that it
  ignores, and raises `RecursionError` there; we translate it).

A message that decodes can always be digested (`input_digest`) and encoded again, for the wire
(`encode`) and for the log (`encode_record`): the bounds guarantee it.

`decode_record` reads the log. It raises `LogCorrupt` for anything it cannot read, but reads a
value outside today's bounds as it was written: the log is history, and a record logged before
a bound existed must stay readable by the tools.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from types import NoneType
from typing import Any, TypeVar, cast
from uuid import UUID

import msgspec
import msgspec.inspect as mi

from events.errors import LogCorrupt
from events.messages import Action, Input, Rejection
from events.records import SCHEMA_VERSION, LogRecord

T = TypeVar("T")

_json_encoder = msgspec.json.Encoder()
_input_decoder = msgspec.json.Decoder(Input)
_action_decoder = msgspec.json.Decoder(Action)
_rejection_decoder = msgspec.json.Decoder(Rejection)
_record_encoder = msgspec.msgpack.Encoder(uuid_format="bytes")
_record_decoder = msgspec.msgpack.Decoder(LogRecord)
_raw_record_decoder = msgspec.msgpack.Decoder()
_record_type = mi.type_info(LogRecord)

encode = _json_encoder.encode
"""Any wire message to JSON bytes."""

encode_record = _record_encoder.encode


def _malformed(what: str, exc: Exception) -> msgspec.DecodeError:
    return msgspec.DecodeError(f"JSON is malformed: {what} ({exc})")


def _checked(data: bytes | str) -> bytes | str:
    # msgspec skips an unknown field's bytes without checking them, but JSON is UTF-8 throughout
    # and a message that is not must not be half-read; `isascii` keeps the usual case cheap.
    if isinstance(data, bytes) and not data.isascii():
        data.decode()
    return data


def _total(decoder: msgspec.json.Decoder[T], what: str) -> Callable[[bytes | str], T]:
    """`decoder.decode`, made total: any failure to decode is a `msgspec.DecodeError`."""

    def decode(data: bytes | str) -> T:
        try:
            return decoder.decode(_checked(data))
        except RecursionError as exc:
            raise _malformed("nested too deeply", exc) from exc
        except UnicodeDecodeError as exc:
            raise _malformed("not UTF-8", exc) from exc

    decode.__doc__ = f"{what} from its JSON; any other bytes raise `msgspec.DecodeError`."
    return decode


decode_input = _total(_input_decoder, "An input")
decode_action = _total(_action_decoder, "An action")
decode_rejection = _total(_rejection_decoder, "A rejection")


def decode_record(blob: bytes) -> LogRecord:
    """A stored record, upcast to the current schema; `LogCorrupt` if it cannot be read.

    A record holding a value outside today's bounds (see `events.ids`) is read as written.
    """
    try:
        record = _record_decoder.decode(blob)
    except msgspec.ValidationError as exc:
        # Maybe only a bound that postdates the record; its shape is still checked.
        try:
            record = cast(LogRecord, _as_written(_record_type, _raw_record_decoder.decode(blob)))
        except (msgspec.DecodeError, RecursionError):
            raise LogCorrupt(f"undecodable log record: {exc}") from exc
    except (msgspec.DecodeError, RecursionError) as exc:
        raise LogCorrupt(f"undecodable log record: {exc}") from exc
    if record.v != SCHEMA_VERSION:
        # Upcasters for older versions go here, keyed by `record.v`; there are none yet.
        raise LogCorrupt(f"log record has schema version {record.v}, this build reads 1")
    return record


def _as_written(info: mi.Type, value: Any) -> Any:
    """`value`, a record decoded without a type, as an instance of the type `info` describes.

    Checks every type, tag and required field the way the typed decoder does, but no bound
    (`Meta` constraint). Raises `msgspec.ValidationError` where the shape differs.
    """
    match info:
        case mi.Metadata(type=annotated):
            return _as_written(annotated, value)
        case mi.StructType(cls=cls, fields=fields, tag_field=tag_field, tag=tag):
            if not isinstance(value, dict):
                raise msgspec.ValidationError(f"not a {cls.__name__}: not a map")
            if tag_field is not None and value.get(tag_field) != tag:
                raise msgspec.ValidationError(f"not a {cls.__name__}: {tag_field} is not {tag!r}")
            present = {}
            for field in fields:
                if field.encode_name in value:
                    present[field.name] = _as_written(field.type, value[field.encode_name])
                elif field.required:
                    raise msgspec.ValidationError(f"{cls.__name__} lacks {field.encode_name}")
            return cls(**present)
        case mi.UnionType(types=members):
            for member in members:
                try:
                    return _as_written(member, value)
                except msgspec.ValidationError:
                    continue
            raise msgspec.ValidationError(f"none of {len(members)} types")
        # The leaves, converted to their type without its constraints.
        case mi.EnumType(cls=enum_type):
            return msgspec.convert(value, enum_type)
        case mi.IntType():
            return msgspec.convert(value, int)
        case mi.FloatType():
            return msgspec.convert(value, float)
        case mi.StrType():
            return msgspec.convert(value, str)
        case mi.UUIDType():
            return msgspec.convert(value, UUID)
        case mi.NoneType():
            return msgspec.convert(value, NoneType)
    raise TypeError(f"a log record holds a {info}, which _as_written does not read yet")


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
        "description": (
            "Inputs go to <prefix>.in.<handoff_id>; actions come from the worker. Every "
            "number is bounded (minimum, maximum) so that any peer, the log and a timer hold "
            "it; engine ids and reasons are bounded and free of control characters. A "
            "message outside the bounds is rejected."
        ),
        # The unions have no component of their own; a single Struct (Rejection) already
        # is one, and `rejection` is just a reference to it.
        "$defs": {**components, "Input": inputs, "Action": actions},
        "oneOf": [{"$ref": "#/$defs/Input"}, {"$ref": "#/$defs/Action"}, rejection],
    }
