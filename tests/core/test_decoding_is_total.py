"""Decoding is total: for any bytes, a wire decoder returns a message or raises
`msgspec.DecodeError`, and `decode_record` returns a record or raises `LogCorrupt`; nothing
else escapes. And whatever decodes is usable: it digests, encodes for the wire and the log, and
round-trips through both.

The worker decodes every input from the bus before it acknowledges it; anything else escaping
the decoder (`RecursionError` on deep nesting, `OverflowError` from the digest of a huge
integer) crashed the worker on that input at every restart.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar, get_args
from uuid import UUID

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvhandoff.events import codec
from kvhandoff.events.errors import LogCorrupt
from kvhandoff.events.ids import MAX_BANDWIDTH_GB_S, MAX_EXACT_INT, MAX_TIMER_MS
from kvhandoff.events.messages import (
    Action,
    Canceled,
    Failed,
    HandoffTransferTiming,
    Input,
    Outcome,
    Rejection,
)
from kvhandoff.events.records import ActionRecord, InputRecord

H = UUID("6f1c2b9e-8a4d-4c3e-9f70-1d2e3f405162")
INPUT_TYPES = get_args(Input)
ACTION_TYPES = get_args(Action)

# --- arbitrary JSON, leaning on the edges ---------------------------------------------------

EDGE_INTS = [
    0,
    1,
    -1,
    MAX_TIMER_MS,
    MAX_TIMER_MS + 1,
    MAX_EXACT_INT,
    MAX_EXACT_INT + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    -(2**63) - 1,
    10**100,
]
EDGE_FLOATS = [
    0.0,
    -0.0,
    5e-324,
    -5e-324,
    1.5,
    MAX_BANDWIDTH_GB_S,
    math.nextafter(MAX_BANDWIDTH_GB_S, math.inf),
    float(MAX_TIMER_MS),
    math.nextafter(MAX_TIMER_MS, math.inf),
    sys.float_info.max,
    -sys.float_info.max,
    math.inf,  # json.dumps writes Infinity and NaN, which are not JSON
    math.nan,
]
EDGE_TEXT = [
    "",
    "prefill-0",
    "decode-0\n",
    "\x1b[2J",
    "\x00",
    "\x7f",
    "\x9b",
    "a.b",
    "*",
    ">",
    "r" * 1025,
    "p" * 129,
    str(H),
]

ints = st.integers() | st.sampled_from(EDGE_INTS)
floats = st.floats() | st.sampled_from(EDGE_FLOATS)
texts = st.text() | st.sampled_from(EDGE_TEXT)
json_values = st.recursive(
    st.none() | st.booleans() | ints | floats | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=24,
)


def _counts(highest: int) -> st.SearchStrategy[int]:
    return st.integers(0, highest) | st.sampled_from(EDGE_INTS)


def _floats(highest: float) -> st.SearchStrategy[float]:
    return st.floats(0.0, highest) | st.sampled_from(EDGE_FLOATS)


@st.composite
def _object(draw: st.DrawFn, cls: type[msgspec.Struct]) -> dict[str, Any]:
    """The JSON object of a `cls`, each field mostly plausible but sometimes missing or
    anything at all, among unknown fields (which a decoder skips, but still parses)."""
    config = cls.__struct_config__
    fields = {config.tag_field: st.just(config.tag)} if config.tag_field else {}
    fields |= {f.encode_name: PLAUSIBLE[f.encode_name] for f in msgspec.structs.fields(cls)}
    obj = draw(st.dictionaries(texts, json_values, max_size=2))
    for name, plausible in fields.items():
        roll = draw(st.integers(0, 11))
        if roll == 0:
            obj.pop(name, None)
        else:
            obj[name] = draw(json_values if roll == 1 else plausible)
    return obj


def _one_of(types: tuple[type[msgspec.Struct], ...]) -> st.SearchStrategy[dict[str, Any]]:
    return st.sampled_from(types).flatmap(_object)


PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "handoff_id": st.just(str(H)) | st.uuids().map(str),
    "engine_type": st.sampled_from(["vllm", "sglang", "trtllm"]),
    "source": st.sampled_from(["prefill-0", "p" * 128, "prefill¡0"]) | texts,
    "destination": st.sampled_from(["decode-0", "d"]) | texts,
    "deadline_ms": st.integers(1, MAX_TIMER_MS) | st.sampled_from(EDGE_INTS),
    "fallback_delay_ms": _floats(MAX_TIMER_MS),
    "transferable_prompt_tokens": _counts(MAX_EXACT_INT),
    "mode": st.sampled_from(["full_prompt", "destination_missing"]),
    "full_prompt_tokens": _counts(MAX_EXACT_INT),
    "kv_bytes_per_token": st.none() | _counts(MAX_EXACT_INT),
    "bandwidth_gb_s": st.none() | _floats(MAX_BANDWIDTH_GB_S),
    "action_id": _counts(MAX_EXACT_INT),
    "reason": texts,
    "by_tier": st.booleans(),
    "delay_ms": _floats(sys.float_info.max),
    "completion": st.sampled_from(["success", "canceled"]),
    "payload": texts,
}
PLAUSIBLE["timing"] = _object(HandoffTransferTiming)
PLAUSIBLE["outcome"] = _one_of(get_args(Outcome))

input_json = _one_of(INPUT_TYPES)
action_json = _one_of(ACTION_TYPES)
rejection_json = _object(Rejection)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _mangled(raw: bytes) -> st.SearchStrategy[bytes]:
    """`raw` with a stretch of it replaced by arbitrary bytes."""
    return st.tuples(st.integers(0, len(raw)), st.integers(0, 8), st.binary(max_size=8)).map(
        lambda cut: raw[: cut[0]] + cut[2] + raw[cut[0] + cut[1] :]
    )


# --- what every decoded message must survive ------------------------------------------------

T = TypeVar("T")


def _decoded(decode: Callable[[bytes], T], raw: bytes) -> T | None:
    """What a wire decoder makes of `raw`, or None where it raises `DecodeError`, the one
    refusal allowed; hypothesis counts which it was."""
    try:
        decoded = decode(raw)
    except msgspec.DecodeError:
        event("rejected")
        return None
    event("decoded")
    return decoded


def _check_input(raw: bytes) -> None:
    message = _decoded(codec.decode_input, raw)
    if message is None:
        return
    assert isinstance(message, INPUT_TYPES)
    assert len(codec.input_digest(message)) == 16
    assert codec.decode_input(codec.encode(message)) == message
    record = InputRecord(at_ms=1_700_000_000_000, input=message)
    blob = codec.encode_record(record)
    assert msgspec.msgpack.decode(blob, type=InputRecord) == record  # within today's bounds
    assert codec.decode_record(blob) == record


def _check_action(raw: bytes) -> None:
    action = _decoded(codec.decode_action, raw)
    if action is None:
        return
    assert isinstance(action, ACTION_TYPES)
    assert codec.decode_action(codec.encode(action)) == action
    record = ActionRecord(at_ms=1_700_000_000_000, action=action)
    assert codec.decode_record(codec.encode_record(record)) == record


def _check_rejection(raw: bytes) -> None:
    rejection = _decoded(codec.decode_rejection, raw)
    if rejection is None:
        return
    assert isinstance(rejection, Rejection)
    assert codec.decode_rejection(codec.encode(rejection)) == rejection


def _check_record(blob: bytes) -> None:
    try:
        record = codec.decode_record(blob)
    except LogCorrupt:
        event("corrupt")
        return
    event("read")
    stored = codec.encode_record(record)
    # Compared as bytes, since history may hold a NaN, which equals nothing.
    assert codec.encode_record(codec.decode_record(stored)) == stored


@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(input_json)
def test_any_json_is_an_input_or_a_decode_error(message: dict[str, Any]) -> None:
    _check_input(_dumps(message))


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(action_json)
def test_any_json_is_an_action_or_a_decode_error(message: dict[str, Any]) -> None:
    _check_action(_dumps(message))


@settings(deadline=None, max_examples=100)
@given(rejection_json)
def test_any_json_is_a_rejection_or_a_decode_error(message: dict[str, Any]) -> None:
    _check_rejection(_dumps(message))


@settings(deadline=None, max_examples=300)
@given(st.binary() | input_json.map(_dumps).flatmap(_mangled))
def test_any_bytes_are_a_message_or_a_decode_error(raw: bytes) -> None:
    _check_input(raw)
    _check_action(raw)
    _check_rejection(raw)


def _packed(value: Any) -> bytes | None:
    try:
        return msgspec.msgpack.encode(value)
    except OverflowError:  # msgpack holds no integer outside [-2**63, 2**64)
        return None


records = st.one_of(
    st.fixed_dictionaries({"record": st.just("input"), "at_ms": ints, "input": input_json}),
    st.fixed_dictionaries({"record": st.just("action"), "at_ms": ints, "action": action_json}),
    json_values,
)


@settings(deadline=None, max_examples=300)
@given(st.binary() | records.map(_packed).filter(lambda blob: blob is not None))
def test_any_blob_is_a_record_or_log_corrupt(blob: bytes) -> None:
    _check_record(blob)


# --- deep nesting ---------------------------------------------------------------------------


def _arrays(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _objects(depth: int) -> bytes:
    return b'{"a":' * depth + b"0" + b"}" * depth


DEPTHS = [1_000, 10_000, 1_000_000]
HB = str(H).encode()
# (where, decoder, the message up to the nesting, the rest): each decoder must parse the
# nesting to decode the message, and each recursed into it before.
NESTINGS: list[tuple[str, Callable[[bytes], object], bytes, bytes]] = [
    (
        "input, an ignored field",
        codec.decode_input,
        b'{"type":"failed","handoff_id":"%s","x":' % HB,
        b"}",
    ),
    ("input, before its tag", codec.decode_input, b'{"x":', b',"type":"failed"}'),
    ("input, its tag", codec.decode_input, b'{"type":', b"}"),
    (
        "input, an ignored field of its outcome",
        codec.decode_input,
        b'{"type":"action_outcome","handoff_id":"%s","action_id":1,"outcome":{"kind":"noop","x":'
        % HB,
        b"}}",
    ),
    (
        "action, an ignored field",
        codec.decode_action,
        b'{"type":"submit_prefill","handoff_id":"%s","action_id":1,"x":' % HB,
        b"}",
    ),
    ("action, before its tag", codec.decode_action, b'{"x":', b',"type":"complete"}'),
    (
        "rejection, an ignored field",
        codec.decode_rejection,
        b'{"type":"rejection","handoff_id":null,"reason":"r","payload":"p","x":',
        b"}",
    ),
]


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("nest", [_arrays, _objects], ids=["arrays", "objects"])
@pytest.mark.parametrize(
    ("decode", "before", "after"),
    [(decode, before, after) for _, decode, before, after in NESTINGS],
    ids=[name for name, *_ in NESTINGS],
)
def test_deep_nesting_is_a_decode_error(
    decode: Callable[[bytes], object],
    before: bytes,
    after: bytes,
    nest: Callable[[int], bytes],
    depth: int,
) -> None:
    with pytest.raises(msgspec.DecodeError, match="nested too deeply") as excinfo:
        decode(before + nest(depth) + after)
    assert not isinstance(excinfo.value, msgspec.ValidationError)


def test_shallow_nesting_in_an_ignored_field_is_still_ignored() -> None:
    raw = b'{"type":"failed","handoff_id":"%s","x":%s}' % (str(H).encode(), _arrays(100))
    assert codec.decode_input(raw) == Failed(H)


def test_nesting_is_never_a_recursion_error_even_from_deep_in_the_stack() -> None:
    # msgspec's limit is Python's recursion limit, which on CPython 3.11 it shares with the
    # caller's frames: called with little headroom left, even modest nesting runs out.
    raw = b'{"type":"failed","handoff_id":"%s","x":%s}' % (str(H).encode(), _arrays(200))
    frame, depth = inspect.currentframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1

    def call_at_depth(frames: int) -> Input | msgspec.DecodeError:
        if frames:
            return call_at_depth(frames - 1)
        try:
            return codec.decode_input(raw)
        except msgspec.DecodeError as exc:
            return exc

    result = call_at_depth(sys.getrecursionlimit() - depth - 100)
    assert result == Failed(H) or isinstance(result, msgspec.DecodeError)


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize(
    "where",
    [
        # Skipped by the typed decoder, which recursed into it.
        b"\x83\xa6record\xa5input\xa5at_ms\x01\xa1x",
        # Refused at once by the typed decoder, then read as written, which decodes it all.
        b"\x83\xa6record\xa5input\xa5at_ms\x01\xa5input",
        b"",
    ],
    ids=["an ignored field", "the input", "the whole record"],
)
def test_a_deeply_nested_record_is_log_corrupt(where: bytes, depth: int) -> None:
    with pytest.raises(LogCorrupt):
        codec.decode_record(where + b"\x91" * depth + b"\xc0")  # a list of a list of ... nil


@pytest.mark.parametrize(
    "decode", [codec.decode_input, codec.decode_action, codec.decode_rejection]
)
def test_bytes_that_are_not_utf8_are_a_decode_error_even_where_ignored(
    decode: Callable[[bytes], object],
) -> None:
    """msgspec would skip an unknown field's bytes unread; JSON is UTF-8 throughout."""
    handoff = b'"handoff_id":"6f1b3c1e-53f5-4a8e-9d59-0f3f0c5f2d11"'
    message = b'{"type":"canceled",' + handoff + b',"note":"\xff\xfe"}'
    with pytest.raises(msgspec.DecodeError, match="not UTF-8"):
        decode(message)
    assert codec.decode_input(message.replace(b"\xff\xfe", "é".encode())) == Canceled(
        UUID("6f1b3c1e-53f5-4a8e-9d59-0f3f0c5f2d11")
    )
