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

`split_record` and `join_record` convert a record between its self-contained form and the parts
the SQLite log's layout 2 stores (see `events.records`). They work on the encoded bytes, so
that the worker and `verify` pay one ordinary encode or decode per record and a join of bytes,
not a second pass through msgspec. The join is the exact inverse: a record that went through
`split_record` comes back as the bytes `encode_record` makes of it, so layout 2 changes nothing
that reads a record, `verify`'s comparison of encodings included.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from types import NoneType
from typing import Any, TypeVar, cast, get_args
from uuid import UUID

import msgspec
import msgspec.inspect as mi

from kvhandoff.events.errors import LogCorrupt
from kvhandoff.events.messages import Action, Input, Rejection
from kvhandoff.events.records import (
    SCHEMA_VERSION,
    TYPE_CODES,
    VERBATIM,
    ActionRecord,
    InputRecord,
    LogRecord,
)
from kvhandoff.events.reports import EnginesReport

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


# --- Split records (the SQLite log's layout 2) ----------------------------------------------
#
# msgspec encodes a Struct as a map: its tag first, then its fields in the order they are
# declared. Every message declares `handoff_id` first, so its encoding is a one-byte map header
# (a msgpack fixmap, at most 15 entries), the tag, the handoff id, then the other fields, and a
# record's encoding is its tag, its time, the message and its version. The parts below are those
# prefixes, built once from the Structs themselves.


_FIXMAP_MAX = 15  # entries in a map whose header is one byte, 0x80 | entries
_BYTES = [bytes((b,)) for b in range(256)]


def _key(name: str) -> bytes:
    return _record_encoder.encode(name)


# The handoff id's key and the header of its 16 bytes.
_ID_ENTRY = _key("handoff_id") + _record_encoder.encode(bytes(16))[:-16]
_VERSION_ENTRY = _key("v") + _record_encoder.encode(SCHEMA_VERSION)


@dataclass(frozen=True, slots=True)
class _Split:
    """Where one message type's record is cut, and what the cut takes away."""

    code: int
    message_head: bytes  # the message's tag and the handoff id's key, up to the id's 16 bytes
    fields_at: int  # where the message's other fields begin in its encoding
    record_head: bytes  # the record's map header, its tag, and the key of its time
    # What comes between the time and the handoff id's 16 bytes: the key of the message, its
    # map header, its tag and the id's key, by how many other fields the message has.
    middles: tuple[bytes, ...]


def _splits() -> dict[type, _Split]:
    splits: dict[type, _Split] = {}
    for record_type, union in ((InputRecord, Input), (ActionRecord, Action)):
        config = record_type.__struct_config__
        at_ms, message_field, version = record_type.__struct_fields__
        assert (at_ms, version) == ("at_ms", "v"), record_type
        assert isinstance(config.tag_field, str) and isinstance(config.tag, str)
        entries = 1 + len(record_type.__struct_fields__)
        record_head = _BYTES[0x80 | entries] + _key(config.tag_field) + _key(config.tag)
        record_head += _key(at_ms)
        for message_type in get_args(union):
            message = message_type.__struct_config__
            assert isinstance(message.tag_field, str) and isinstance(message.tag, str)
            fields = message_type.__struct_fields__
            if fields[0] != "handoff_id" or len(fields) >= _FIXMAP_MAX:
                raise TypeError(f"{message_type.__name__} cannot be split: {fields}")
            head = _key(message.tag_field) + _key(message.tag) + _ID_ENTRY
            middles = tuple(
                _key(message_field) + _BYTES[0x80 | (others + 2)] + head
                for others in range(_FIXMAP_MAX - 1)
            )
            code = TYPE_CODES[message.tag]
            splits[message_type] = _Split(code, head, 1 + len(head) + 16, record_head, middles)
    return splits


_SPLITS = _splits()
# By type number, what `join_record` puts around a record's time and fields.
_JOINS = {split.code: (split.record_head, split.middles) for split in _SPLITS.values()}
_LAST_HEADER = 0x80 | (_FIXMAP_MAX - 2)  # the largest map of fields a message can have


def split_record(record: LogRecord) -> tuple[int, bytes]:
    """The parts of a record that the log's layout 2 stores beside its handoff id and its time:
    the number of its message's type (`events.records.TYPE_CODES`) and the message's other
    fields, a msgpack map without the tag and the handoff id."""
    message = record.input if isinstance(record, InputRecord) else record.action
    split = _SPLITS[type(message)]
    encoded = _record_encoder.encode(message)
    if not encoded.startswith(split.message_head, 1):
        raise AssertionError(f"{type(message).__name__} is not encoded tag and id first")
    return split.code, _BYTES[encoded[0] - 2] + encoded[split.fields_at :]


def join_record(handoff_id: bytes, code: int, at_ms: int, fields: bytes) -> bytes:
    """A record from the parts layout 2 stores (the 16 bytes of its handoff id, its type
    number, its time, its other fields), in its self-contained form: exactly the bytes
    `encode_record` makes of the record. A `VERBATIM` record is its fields as they are.

    Raises `LogCorrupt` when the parts cannot make a record: an unknown type number, or fields
    that are not a msgpack map. (A time that is not one makes bytes that do not decode.)
    """
    if not isinstance(fields, bytes):  # a column of the wrong type, in a damaged log
        raise LogCorrupt(f"log record's fields are {type(fields).__name__}, not bytes")
    if code == VERBATIM:
        return fields
    join = _JOINS.get(code)
    if join is None:
        raise LogCorrupt(f"log record of unknown type {code!r}")
    if not fields or not 0x80 <= fields[0] <= _LAST_HEADER:
        raise LogCorrupt("log record's fields are not a msgpack map of a message's fields")
    # `verify` joins every record it reads: one join of bytes, no more.
    record_head, middles = join
    return b"".join(
        (
            record_head,
            _record_encoder.encode(at_ms),
            middles[fields[0] & 0xF],
            handoff_id,
            fields[1:],
            _VERSION_ENTRY,
        )
    )


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
        case mi.BoolType():
            return msgspec.convert(value, bool)
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
    (inputs, actions, rejection, report), components = msgspec.json.schema_components(
        (Input, Action, Rejection, EnginesReport), ref_template="#/$defs/{name}"
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvhandoff wire vocabulary",
        "description": (
            "Inputs go to <prefix>.in.<handoff_id>; actions come from the worker; an "
            "EnginesReport answers a request on <prefix>.engines.report. Every "
            "number is bounded (minimum, maximum) so that any peer, the log and a timer hold "
            "it; engine ids and reasons are bounded and free of control characters. A "
            "message outside the bounds is rejected. The contract (who sends what, when, and "
            "what to answer) is docs/contract.md."
        ),
        # The unions have no component of their own; a single Struct (Rejection,
        # EnginesReport) already is one, and its entry is just a reference to it.
        "$defs": {**components, "Input": inputs, "Action": actions},
        "oneOf": [{"$ref": "#/$defs/Input"}, {"$ref": "#/$defs/Action"}, rejection, report],
    }
