"""The bounds on every value of the wire vocabulary (`events.ids`), table-driven.

A message exactly at a bound decodes, digests, and encodes for the wire and the log; one past it
is a `msgspec.ValidationError` naming the path. The JSON Schema states every bound. The log is
history: a record written before the bounds existed still reads back exactly as it was written,
while a record of the wrong shape is still `LogCorrupt`.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from typing import Any
from uuid import UUID

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.events import codec
from kvhandoff.events.errors import LogCorrupt
from kvhandoff.events.ids import MAX_BANDWIDTH_GB_S, MAX_EXACT_INT, MAX_REASON_LENGTH, MAX_TIMER_MS
from kvhandoff.events.messages import (
    NOOP,
    ActionFailed,
    ActionOutcome,
    Canceled,
    CancelSource,
    Complete,
    DestinationReserved,
    EngineType,
    HandoffCompletion,
    HandoffTransferTiming,
    Input,
    KvTransferTimingMode,
    SourceHeld,
    StartHandoff,
    StartTransfer,
    SubmitPrefill,
)
from kvhandoff.events.records import ActionRecord, InputRecord, LogRecord

H = UUID("6f1c2b9e-8a4d-4c3e-9f70-1d2e3f405162")
INF = math.inf


def _start(**overrides: Any) -> dict[str, Any]:
    fields = {
        "type": "start_handoff",
        "handoff_id": str(H),
        "engine_type": "vllm",
        "source": "prefill-0",
        "destination": "decode-0",
        "deadline_ms": 30_000,
    }
    return fields | overrides


def _held(**timing: Any) -> dict[str, Any]:
    fields = {"mode": "full_prompt", "full_prompt_tokens": 4096}
    return {"type": "source_held", "handoff_id": str(H), "timing": fields | timing}


def _reserved(tokens: int) -> dict[str, Any]:
    return {
        "type": "destination_reserved",
        "handoff_id": str(H),
        "transferable_prompt_tokens": tokens,
    }


def _outcome(action_id: int = 0, outcome: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "type": "action_outcome",
        "handoff_id": str(H),
        "action_id": action_id,
        "outcome": outcome or {"kind": "noop"},
    }


def _reason(text: str) -> dict[str, Any]:
    return _outcome(outcome={"kind": "failed", "reason": text})


# (name, message from a value, the value at the bound, the value one past it, the path named)
PAIRS: list[tuple[str, Callable[[Any], dict[str, Any]], Any, Any, str]] = [
    ("action id, lowest", _outcome, 0, -1, "$.action_id"),
    ("action id, highest", _outcome, MAX_EXACT_INT, MAX_EXACT_INT + 1, "$.action_id"),
    (
        "full-prompt tokens, highest",
        lambda v: _held(full_prompt_tokens=v),
        MAX_EXACT_INT,
        MAX_EXACT_INT + 1,
        "$.timing.full_prompt_tokens",
    ),
    (
        "kv bytes per token, highest",
        lambda v: _held(kv_bytes_per_token=v),
        MAX_EXACT_INT,
        MAX_EXACT_INT + 1,
        "$.timing.kv_bytes_per_token",
    ),
    (
        "bandwidth, lowest",
        lambda v: _held(kv_bytes_per_token=64, bandwidth_gb_s=v),
        0.0,
        -5e-324,
        "$.timing.bandwidth_gb_s",
    ),
    (
        "bandwidth, highest",
        lambda v: _held(kv_bytes_per_token=64, bandwidth_gb_s=v),
        MAX_BANDWIDTH_GB_S,
        math.nextafter(MAX_BANDWIDTH_GB_S, INF),
        "$.timing.bandwidth_gb_s",
    ),
    ("transferable tokens, lowest", _reserved, 0, -1, "$.transferable_prompt_tokens"),
    (
        "transferable tokens, highest",
        _reserved,
        MAX_EXACT_INT,
        MAX_EXACT_INT + 1,
        "$.transferable_prompt_tokens",
    ),
    ("deadline, shortest", lambda v: _start(deadline_ms=v), 1, 0, "$.deadline_ms"),
    (
        "deadline, longest",
        lambda v: _start(deadline_ms=v),
        MAX_TIMER_MS,
        MAX_TIMER_MS + 1,
        "$.deadline_ms",
    ),
    (
        "fallback delay, shortest",
        lambda v: _start(fallback_delay_ms=v),
        0.0,
        -5e-324,
        "$.fallback_delay_ms",
    ),
    (
        "fallback delay, longest",
        lambda v: _start(fallback_delay_ms=v),
        float(MAX_TIMER_MS),
        math.nextafter(MAX_TIMER_MS, INF),
        "$.fallback_delay_ms",
    ),
    (
        "engine id, longest",
        lambda v: _start(source=v),
        "p" * 128,
        "p" * 129,
        "$.source",
    ),
    (
        "reason, longest",
        _reason,
        "r" * MAX_REASON_LENGTH,
        "r" * (MAX_REASON_LENGTH + 1),
        "$.outcome.reason",
    ),
]

# Control characters: C0 (NUL, TAB, LF, ESC, US), DEL, C1 (PAD, CSI, APC). ESC and CSI start
# terminal escape sequences; the tools print engine ids and reasons.
CONTROL = ["\x00", "\t", "\n", "\x1b", "\x1f", "\x7f", "\x80", "\x9b", "\x9f"]

# Values the issue found crashing the worker, and other ways past a bound.
REJECTED: list[tuple[str, dict[str, Any], str]] = [
    ("action id 2**64 (crashed the digest)", _outcome(2**64), "$.action_id"),
    ("action id 2**63", _outcome(2**63), "$.action_id"),
    ("deadline near 2**63 (crashed the commit)", _start(deadline_ms=2**63 - 1), "$.deadline_ms"),
    ("deadline 2**64", _start(deadline_ms=2**64), "$.deadline_ms"),
    ("tokens 2**64", _reserved(2**64), "$.transferable_prompt_tokens"),
    ("fallback delay 1e308", _start(fallback_delay_ms=1e308), "$.fallback_delay_ms"),
    (
        "bandwidth 1e308",
        _held(kv_bytes_per_token=64, bandwidth_gb_s=1e308),
        "$.timing.bandwidth_gb_s",
    ),
    ("engine id ending in a newline", _start(destination="decode-0\n"), "$.destination"),
    ("reason ending in a newline", _reason("disk full\n"), "$.outcome.reason"),
    ("terminal escape in an engine id", _start(source="\x1b[2J\x1b[Hp"), "$.source"),
    *((f"source with {c!r}", _start(source=f"prefill{c}0"), "$.source") for c in CONTROL),
    *(
        (f"destination ending in {c!r}", _start(destination=f"decode-0{c}"), "$.destination")
        for c in CONTROL
    ),
    *((f"reason with {c!r}", _reason(f"disk{c}full"), "$.outcome.reason") for c in CONTROL),
]

# Printable neighbours of the control ranges, and text that is not ASCII, stay accepted.
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("engine id with '~' (0x7e)", _start(source="prefill~0")),
    ("engine id with '¡' (0xa1)", _start(source="prefill¡0")),
    ("engine id in Greek", _start(destination="αποκωδικοποίηση-0")),
    ("empty reason", _reason("")),
    ("reason with a no-break space (0xa0)", _reason("disk\xa0full")),
    ("reason with quotes, backslashes and emoji", _reason('"disk" \\ full 🙂')),
]


def _raw(message: dict[str, Any]) -> bytes:
    return json.dumps(message, ensure_ascii=False).encode()


def _assert_usable(message: Input) -> None:
    """Everything the worker does with an input it decoded succeeds and loses nothing."""
    assert len(codec.input_digest(message)) == 16
    assert codec.decode_input(codec.encode(message)) == message
    record = InputRecord(at_ms=1_700_000_000_000, input=message)
    assert codec.decode_record(codec.encode_record(record)) == record


@pytest.mark.parametrize(
    ("build", "value", "path"),
    [(build, at, path) for _, build, at, _, path in PAIRS],
    ids=[name for name, *_ in PAIRS],
)
def test_a_value_at_its_bound_is_accepted(
    build: Callable[[Any], dict[str, Any]], value: Any, path: str
) -> None:
    message = codec.decode_input(_raw(build(value)))
    decoded: Any = message
    for key in path.removeprefix("$.").split("."):
        decoded = getattr(decoded, key)
    assert decoded == value
    _assert_usable(message)


@pytest.mark.parametrize(
    ("build", "value", "path"),
    [(build, past, path) for _, build, _, past, path in PAIRS],
    ids=[name for name, *_ in PAIRS],
)
def test_a_value_one_past_its_bound_is_rejected_naming_the_path(
    build: Callable[[Any], dict[str, Any]], value: Any, path: str
) -> None:
    with pytest.raises(msgspec.ValidationError) as excinfo:
        codec.decode_input(_raw(build(value)))
    assert path in str(excinfo.value)


@pytest.mark.parametrize(
    ("message", "path"),
    [(message, path) for _, message, path in REJECTED],
    ids=[name for name, *_ in REJECTED],
)
def test_an_out_of_bounds_value_is_rejected_naming_the_path(
    message: dict[str, Any], path: str
) -> None:
    with pytest.raises(msgspec.ValidationError) as excinfo:
        codec.decode_input(_raw(message))
    assert path in str(excinfo.value)


@pytest.mark.parametrize("message", [m for _, m in ACCEPTED], ids=[n for n, _ in ACCEPTED])
def test_printable_text_is_accepted(message: dict[str, Any]) -> None:
    _assert_usable(codec.decode_input(_raw(message)))


@pytest.mark.parametrize(
    ("delay", "accepted"),
    [(0.0, True), (sys.float_info.max, True), (-5e-324, False), (-1.0, False)],
)
def test_a_transfer_delay_is_finite_and_not_negative(delay: float, accepted: bool) -> None:
    raw = _raw({"type": "start_transfer", "handoff_id": str(H), "action_id": 2, "delay_ms": delay})
    if accepted:
        assert codec.decode_action(raw) == StartTransfer(H, 2, delay)
    else:
        with pytest.raises(msgspec.ValidationError, match=r"\$\.delay_ms"):
            codec.decode_action(raw)


# --- the schema states the bounds -----------------------------------------------------------


def _walk(node: Any) -> Any:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def test_every_number_in_the_schema_is_bounded_on_both_sides() -> None:
    numbers = [
        node
        for node in _walk(codec.wire_schema())
        if isinstance(node, dict) and node.get("type") in ("integer", "number")
    ]
    assert len(numbers) >= 8
    for node in numbers:
        assert {"minimum", "exclusiveMinimum"} & node.keys(), node
        assert {"maximum", "exclusiveMaximum"} & node.keys(), node
        assert node.get("description"), node  # says why


@pytest.mark.parametrize(
    ("definition", "field", "bounds"),
    [
        ("ActionOutcome", "action_id", {"minimum": 0, "maximum": MAX_EXACT_INT}),
        ("StartHandoff", "deadline_ms", {"exclusiveMinimum": 0, "maximum": MAX_TIMER_MS}),
        ("StartHandoff", "fallback_delay_ms", {"minimum": 0, "maximum": MAX_TIMER_MS}),
        ("DestinationReserved", "transferable_prompt_tokens", {"maximum": MAX_EXACT_INT}),
        ("StartHandoff", "source", {"minLength": 1, "maxLength": 128}),
        ("ActionFailed", "reason", {"maxLength": MAX_REASON_LENGTH}),
    ],
)
def test_the_schema_states_each_bound(definition: str, field: str, bounds: dict[str, Any]) -> None:
    schema = codec.wire_schema()["$defs"][definition]["properties"][field]
    assert {key: schema[key] for key in bounds} == bounds


@pytest.mark.parametrize(
    ("definition", "field"), [("StartHandoff", "source"), ("ActionFailed", "reason")]
)
def test_the_schema_pattern_refuses_control_characters(definition: str, field: str) -> None:
    # The schema's regex is what engines in other languages check; it must agree with ours.
    pattern = codec.wire_schema()["$defs"][definition]["properties"][field]["pattern"]
    compiled = re.compile(pattern)
    assert compiled.search("prefill-0")
    for c in CONTROL:
        assert not compiled.search(f"prefill{c}0")
    assert not compiled.search("prefill-0\n")


# --- the log is history ---------------------------------------------------------------------

# Records the worker could log before the bounds existed (constructing a Struct checks
# nothing), each with values the wire now refuses.
HISTORY: list[tuple[str, LogRecord]] = [
    (
        "engine ids with an escape and a newline, a deadline of 2**62, a fallback of 2**40",
        InputRecord(
            1,
            StartHandoff(H, EngineType.VLLM, "\x1b[31mprefill", "decode-0\n", 2**62, float(2**40)),
        ),
    ),
    (
        "timing at int64 and uint64, a bandwidth of 1e300",
        InputRecord(
            2,
            SourceHeld(
                H,
                HandoffTransferTiming(
                    KvTransferTimingMode.DESTINATION_MISSING, 2**63 - 1, 2**64 - 1, 1e300
                ),
            ),
        ),
    ),
    ("tokens at uint64", InputRecord(3, DestinationReserved(H, 2**64 - 1))),
    (
        "a long reason with NUL",
        InputRecord(4, ActionOutcome(H, 2**60, ActionFailed("disk\x00full" + "." * 5000))),
    ),
    ("action id 2**53", InputRecord(5, ActionOutcome(H, 2**53, NOOP))),
    ("an infinite delay", ActionRecord(6, StartTransfer(H, 2**60, INF))),
    ("action id at int64", ActionRecord(7, Complete(H, 2**63 - 1, HandoffCompletion.CANCELED))),
]


@pytest.mark.parametrize("record", [r for _, r in HISTORY], ids=[n for n, _ in HISTORY])
def test_a_record_logged_before_the_bounds_reads_back_as_written(record: LogRecord) -> None:
    blob = codec.encode_record(record)
    with pytest.raises(msgspec.ValidationError):  # out of today's bounds indeed
        msgspec.msgpack.decode(blob, type=LogRecord)
    decoded = codec.decode_record(blob)
    assert decoded == record
    assert type(decoded) is type(record)
    assert codec.encode_record(decoded) == blob  # exports and re-reads keep it byte for byte


def _stored(**input_fields: Any) -> bytes:
    fields = {"type": "destination_reserved", "handoff_id": H.bytes} | input_fields
    return codec.encode_record({"record": "input", "at_ms": 1, "input": fields})


# Reading history as written skips the bounds only: a record of the wrong shape is refused.
MISSHAPEN: list[tuple[str, bytes]] = [
    ("a string count", _stored(transferable_prompt_tokens="many")),
    ("a float count", _stored(transferable_prompt_tokens=2.0**60)),
    ("a boolean count", _stored(transferable_prompt_tokens=True)),
    ("no count", _stored(tokens=2**63)),
    ("a short uuid", _stored(handoff_id=b"\x00" * 15, transferable_prompt_tokens=2**60)),
    ("a uuid that is a number", _stored(handoff_id=2**64 - 1, transferable_prompt_tokens=1)),
    ("an unknown tag", _stored(type="exploded", transferable_prompt_tokens=2**60)),
    (
        "an unknown engine type",
        _stored(
            type="start_handoff", engine_type="tgi", source="\x1b", destination="d", deadline_ms=0
        ),
    ),
    ("a timing that is a list", _stored(type="source_held", timing=[2**63, 1])),
    (
        "an outcome without its reason",
        _stored(type="action_outcome", action_id=2**60, outcome={"kind": "failed"}),
    ),
    (
        "an action record holding an input",
        codec.encode_record({"record": "action", "at_ms": 2**63, "input": {}}),
    ),
    ("a record that is a list", codec.encode_record([2**63, "input"])),
]


@pytest.mark.parametrize("blob", [b for _, b in MISSHAPEN], ids=[n for n, _ in MISSHAPEN])
def test_a_misshapen_record_is_still_log_corrupt(blob: bytes) -> None:
    with pytest.raises(LogCorrupt, match="undecodable log record") as excinfo:
        codec.decode_record(blob)
    assert isinstance(excinfo.value.__cause__, msgspec.ValidationError)


_int64ish = st.integers(-(2**63), 2**64 - 1)  # all msgpack holds
_any_float = st.floats(allow_nan=False)  # NaN != NaN, so equality cannot check it
_inputs = st.one_of(
    st.builds(
        StartHandoff,
        st.uuids(),
        st.sampled_from(EngineType),
        st.text(),
        st.text(),
        _int64ish,
        _any_float,
    ),
    st.builds(
        SourceHeld,
        st.uuids(),
        st.builds(
            HandoffTransferTiming,
            st.sampled_from(KvTransferTimingMode),
            _int64ish,
            st.none() | _int64ish,
            st.none() | _any_float,
        ),
    ),
    st.builds(DestinationReserved, st.uuids(), _int64ish),
    st.builds(
        ActionOutcome, st.uuids(), _int64ish, st.just(NOOP) | st.builds(ActionFailed, st.text())
    ),
    st.builds(Canceled, st.uuids()),
)
_actions = st.one_of(
    st.builds(StartTransfer, st.uuids(), _int64ish, _any_float),
    st.builds(Complete, st.uuids(), _int64ish, st.sampled_from(HandoffCompletion)),
    st.builds(SubmitPrefill, st.uuids(), _int64ish),
    st.builds(CancelSource, st.uuids(), _int64ish),
)
_records = st.one_of(
    st.builds(InputRecord, _int64ish, _inputs),
    st.builds(ActionRecord, _int64ish, _actions),
)


@settings(deadline=None, max_examples=300)
@given(_records)
def test_any_record_reads_back_as_written(record: LogRecord) -> None:
    assert codec.decode_record(codec.encode_record(record)) == record
