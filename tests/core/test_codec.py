"""The codec: strict decoding, round trips, the de-duplication digest, log records (whole and
split), the schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args
from uuid import UUID

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.events import codec
from kvhandoff.events.errors import LogCorrupt
from kvhandoff.events.ids import MAX_EXACT_INT
from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    Action,
    ActionFailed,
    ActionOutcome,
    ActivateDestination,
    CancelDestination,
    Canceled,
    CancelSource,
    Complete,
    DestinationReserved,
    EngineType,
    Failed,
    HandoffCompletion,
    HandoffTransferTiming,
    Input,
    KvTransferTimingMode,
    Outcome,
    Rejection,
    ReleaseSource,
    ReserveDestination,
    SourceHeld,
    StartHandoff,
    StartTransfer,
    SubmitPrefill,
    TimedOut,
    TransferCompleted,
)
from kvhandoff.events.records import SCHEMA_VERSION, TYPE_CODES, VERBATIM, ActionRecord, InputRecord
from kvhandoff.events.reports import EnginesReport
from kvhandoff.worker.cli import main

REPO = Path(__file__).resolve().parents[2]
H = UUID("6f1c2b9e-8a4d-4c3e-9f70-1d2e3f405162")
OTHER = UUID("00000000-0000-0000-0000-00000000dead")
TIMING = HandoffTransferTiming(
    mode=KvTransferTimingMode.DESTINATION_MISSING,
    full_prompt_tokens=MAX_EXACT_INT,
    kv_bytes_per_token=131_072,
    bandwidth_gb_s=12.5,
)

INPUTS: list[Input] = [
    StartHandoff(H, EngineType.VLLM, "prefill-0", "decode-0", deadline_ms=30_000),
    StartHandoff(H, EngineType.SGLANG, "p", "d", deadline_ms=1, fallback_delay_ms=2.5),
    SourceHeld(H, TIMING),
    SourceHeld(H, HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, 0)),
    DestinationReserved(H, MAX_EXACT_INT),
    TransferCompleted(H),
    Failed(H),
    TimedOut(H),
    Canceled(H),
    *(
        ActionOutcome(H, 7, outcome)
        for outcome in (SUBMITTED, ACCEPTED, SCHEDULED, APPLIED, NOOP, ActionFailed("disk full"))
    ),
]

ACTIONS: list[Action] = [
    SubmitPrefill(H, 0),
    ReserveDestination(H, 1),
    StartTransfer(H, 2, 41.943_04),
    ActivateDestination(H, 3),
    ReleaseSource(H, 4),
    CancelSource(H, 5),
    CancelDestination(H, 6),
    Complete(H, 7, HandoffCompletion.SUCCESS),
    Complete(H, 8, HandoffCompletion.CANCELED),
]


def _members(union: Any) -> set[type]:
    return set(get_args(union))


def test_the_examples_cover_every_message_type() -> None:
    assert {type(m) for m in INPUTS} == _members(Input)
    assert {type(m) for m in ACTIONS} == _members(Action)
    outcomes = {type(m.outcome) for m in INPUTS if isinstance(m, ActionOutcome)}
    assert outcomes == _members(Outcome)


# --- strict decoding ------------------------------------------------------------------------


def _json(**fields: Any) -> bytes:
    return json.dumps({"handoff_id": str(H), **fields}).encode()


def _start(**overrides: Any) -> bytes:
    fields: dict[str, Any] = {
        "type": "start_handoff",
        "engine_type": "vllm",
        "source": "prefill-0",
        "destination": "decode-0",
        "deadline_ms": 1000,
    }
    return _json(**(fields | overrides))


REJECTED_INPUTS: list[tuple[str, bytes, str]] = [
    (
        "wrong type",
        _json(type="destination_reserved", transferable_prompt_tokens="many"),
        "$.transferable_prompt_tokens",
    ),
    ("wrong shape", _json(type="source_held", timing=[1, 2]), "$.timing"),
    ("missing field", _json(type="source_held"), "timing"),
    ("unknown tag", _json(type="exploded"), "$.type"),
    (
        "unknown outcome tag",
        _json(type="action_outcome", action_id=1, outcome={"kind": "exploded"}),
        "$.outcome.kind",
    ),
    (
        "negative token count",
        _json(type="destination_reserved", transferable_prompt_tokens=-1),
        "$.transferable_prompt_tokens",
    ),
    (
        "negative full-prompt tokens",
        _json(type="source_held", timing={"mode": "full_prompt", "full_prompt_tokens": -1}),
        "$.timing.full_prompt_tokens",
    ),
    (
        "negative bytes per token",
        _json(
            type="source_held",
            timing={"mode": "full_prompt", "full_prompt_tokens": 1, "kv_bytes_per_token": -1},
        ),
        "$.timing.kv_bytes_per_token",
    ),
    (
        "negative action id",
        _json(type="action_outcome", action_id=-1, outcome={"kind": "noop"}),
        "$.action_id",
    ),
    ("zero deadline", _start(deadline_ms=0), "$.deadline_ms"),
    ("negative fallback", _start(fallback_delay_ms=-1.0), "$.fallback_delay_ms"),
    ("unknown engine type", _start(engine_type="tgi"), "$.engine_type"),
    (
        "malformed uuid",
        json.dumps({"type": "canceled", "handoff_id": "not-a-uuid"}).encode(),
        "$.handoff_id",
    ),
    ("empty engine id", _start(source=""), "$.source"),
    *((f"engine id with {c!r}", _start(source=f"prefill{c}0"), "$.source") for c in ".*> "),
    *((f"engine id with {c!r}", _start(destination=f"decode{c}"), "$.destination") for c in "\t>"),
]


@pytest.mark.parametrize(
    ("raw", "path"),
    [(raw, path) for _, raw, path in REJECTED_INPUTS],
    ids=[n for n, *_ in REJECTED_INPUTS],
)
def test_a_malformed_input_is_a_validation_error_naming_the_path(raw: bytes, path: str) -> None:
    with pytest.raises(msgspec.ValidationError) as excinfo:
        codec.decode_input(raw)
    assert path in str(excinfo.value)


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        (json.dumps({"type": "start_transfer", "handoff_id": str(H), "action_id": 2}), "delay_ms"),
        (
            json.dumps(
                {"type": "complete", "handoff_id": str(H), "action_id": 2, "completion": "ok"}
            ),
            "$.completion",
        ),
        (
            json.dumps({"type": "submit_prefill", "handoff_id": str(H), "action_id": -3}),
            "$.action_id",
        ),
        (json.dumps({"type": "exploded", "handoff_id": str(H), "action_id": 0}), "$.type"),
    ],
)
def test_a_malformed_action_is_a_validation_error_naming_the_path(raw: str, path: str) -> None:
    with pytest.raises(msgspec.ValidationError) as excinfo:
        codec.decode_action(raw.encode())
    assert path in str(excinfo.value)


@pytest.mark.parametrize("raw", [b"\xff\x00garbage", b'{"type":', b"", b"NaN"])
def test_garbage_is_a_decode_error_not_a_validation_error(raw: bytes) -> None:
    with pytest.raises(msgspec.DecodeError) as excinfo:
        codec.decode_input(raw)
    assert not isinstance(excinfo.value, msgspec.ValidationError)


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("message", INPUTS, ids=repr)
def test_every_input_round_trips_through_json(message: Input) -> None:
    decoded = codec.decode_input(codec.encode(message))
    assert decoded == message
    assert type(decoded) is type(message)


@pytest.mark.parametrize("action", ACTIONS, ids=repr)
def test_every_action_round_trips_through_json(action: Action) -> None:
    decoded = codec.decode_action(codec.encode(action))
    assert decoded == action
    assert type(decoded) is type(action)


def test_a_rejection_round_trips_through_json() -> None:
    for rejection in (Rejection(H, "unknown handoff action 9", "{}"), Rejection(None, "bad", "")):
        assert codec.decode_rejection(codec.encode(rejection)) == rejection


@pytest.mark.parametrize(
    "record",
    [
        *(InputRecord(at_ms=1_700_000_000_000 + i, input=m) for i, m in enumerate(INPUTS)),
        *(ActionRecord(at_ms=1_700_000_000_000 + i, action=a) for i, a in enumerate(ACTIONS)),
    ],
    ids=repr,
)
def test_every_record_round_trips_through_the_log_encoding(
    record: InputRecord | ActionRecord,
) -> None:
    decoded = codec.decode_record(codec.encode_record(record))
    assert decoded == record
    assert decoded.v == SCHEMA_VERSION


def test_a_record_from_a_future_schema_version_is_log_corrupt() -> None:
    blob = codec.encode_record(InputRecord(at_ms=1, input=Canceled(H), v=SCHEMA_VERSION + 1))
    with pytest.raises(LogCorrupt, match=f"schema version {SCHEMA_VERSION + 1}"):
        codec.decode_record(blob)


@pytest.mark.parametrize(
    "blob",
    [
        b"\xc1garbage",
        codec.encode_record({"record": "input", "at_ms": 1, "input": {"type": "exploded"}}),
        codec.encode_record(InputRecord(at_ms=1, input=Canceled(H)))[:-3],
    ],
)
def test_an_undecodable_record_is_log_corrupt(blob: bytes) -> None:
    with pytest.raises(LogCorrupt) as excinfo:
        codec.decode_record(blob)
    assert isinstance(excinfo.value.__cause__, msgspec.DecodeError)


# --- split records (the log's layout 2) -----------------------------------------------------

RECORDS = [
    *(InputRecord(at_ms=1_700_000_000_000 + i, input=m) for i, m in enumerate(INPUTS)),
    *(ActionRecord(at_ms=1_700_000_000_000 + i, action=a) for i, a in enumerate(ACTIONS)),
    # Read as written: a bound that postdates the record, and a time before the epoch.
    InputRecord(at_ms=-1, input=StartHandoff(H, EngineType.VLLM, "p", "d", deadline_ms=0)),
    ActionRecord(at_ms=0, action=StartTransfer(H, 2, -1.0)),
]


def test_every_message_type_has_a_type_number_of_its_own() -> None:
    tags = [kind.__struct_config__.tag for kind in (*get_args(Input), *get_args(Action))]
    assert sorted(TYPE_CODES) == sorted(tags)
    numbers = [*TYPE_CODES.values(), VERBATIM]
    assert len(set(numbers)) == len(numbers)


@pytest.mark.parametrize("record", RECORDS, ids=repr)
def test_a_split_record_joins_back_into_its_very_bytes(record: InputRecord | ActionRecord) -> None:
    message = record.input if isinstance(record, InputRecord) else record.action
    code, fields = codec.split_record(record)
    assert code == TYPE_CODES[str(message.__struct_config__.tag)]
    assert message.handoff_id.bytes not in fields and b"handoff_id" not in fields
    joined = codec.join_record(message.handoff_id.bytes, code, record.at_ms, fields)
    assert joined == codec.encode_record(record)
    assert codec.decode_record(joined) == record


def test_a_record_kept_whole_is_joined_as_it_is() -> None:
    blob = codec.encode_record(InputRecord(at_ms=1, input=Canceled(OTHER)))
    assert codec.join_record(H.bytes, VERBATIM, 2, blob) == blob
    assert codec.join_record(H.bytes, VERBATIM, 2, b"\xc1") == b"\xc1"


@pytest.mark.parametrize(
    ("code", "fields", "error"),
    [
        (99, b"\x80", "unknown type 99"),
        ("8", b"\x80", "unknown type '8'"),
        (8, b"", "not a msgpack map"),
        (8, b"\xc1", "not a msgpack map"),
        (8, b"\x8e", "not a msgpack map"),  # too many fields for a message
        (8, "\x80", "are str, not bytes"),
    ],
)
def test_parts_that_cannot_make_a_record_are_log_corrupt(
    code: Any, fields: Any, error: str
) -> None:
    with pytest.raises(LogCorrupt, match=error):
        codec.join_record(H.bytes, code, 1, fields)


@settings(deadline=None, max_examples=300)
@given(
    st.sampled_from([VERBATIM, *TYPE_CODES.values()]), st.integers(-(2**63), 2**63 - 1), st.binary()
)
def test_any_parts_are_a_record_or_log_corrupt(code: int, at_ms: int, fields: bytes) -> None:
    try:
        record = codec.decode_record(codec.join_record(H.bytes, code, at_ms, fields))
    except LogCorrupt:
        return
    # What reads splits and joins again into its own bytes (compared as bytes: it may hold NaN).
    message = record.input if isinstance(record, InputRecord) else record.action
    again, rest = codec.split_record(record)
    joined = codec.join_record(message.handoff_id.bytes, again, record.at_ms, rest)
    assert joined == codec.encode_record(record)


# --- the de-duplication digest --------------------------------------------------------------


def test_equal_inputs_have_equal_digests() -> None:
    # Rebuilt independently, and re-encoded by a "publisher" with its keys in another order.
    for message in INPUTS:
        rebuilt = codec.decode_input(codec.encode(message))
        assert rebuilt is not message
        assert codec.input_digest(rebuilt) == codec.input_digest(message)
        shuffled = dict(reversed(list(json.loads(codec.encode(message)).items())))
        republished = codec.decode_input(json.dumps(shuffled).encode())
        assert codec.input_digest(republished) == codec.input_digest(message)


def test_different_inputs_have_different_digests() -> None:
    near_misses: list[Input] = [
        ActionOutcome(H, 8, SUBMITTED),
        ActionOutcome(OTHER, 7, SUBMITTED),
        ActionOutcome(H, 7, ActionFailed("disk ful")),
        ActionOutcome(H, 7, ActionFailed("")),
        DestinationReserved(H, MAX_EXACT_INT - 1),
        DestinationReserved(OTHER, MAX_EXACT_INT),
        SourceHeld(H, HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, 0, None, 0.0)),
        SourceHeld(H, HandoffTransferTiming(KvTransferTimingMode.FULL_PROMPT, 0, 0)),
        SourceHeld(H, HandoffTransferTiming(KvTransferTimingMode.DESTINATION_MISSING, 0)),
        Canceled(OTHER),
        StartHandoff(H, EngineType.TRTLLM, "prefill-0", "decode-0", deadline_ms=30_000),
        StartHandoff(H, EngineType.VLLM, "prefill-0", "decode-0", deadline_ms=30_001),
    ]
    everything = INPUTS + near_misses
    assert len({codec.input_digest(m) for m in everything}) == len(everything)


_small_inputs = st.one_of(
    st.builds(DestinationReserved, st.sampled_from([H, OTHER]), st.integers(0, 2)),
    st.builds(
        ActionOutcome,
        st.sampled_from([H, OTHER]),
        st.integers(0, 2),
        st.sampled_from([SUBMITTED, APPLIED, ActionFailed("a"), ActionFailed("b")]),
    ),
    st.builds(
        SourceHeld,
        st.just(H),
        st.builds(
            HandoffTransferTiming,
            st.sampled_from(KvTransferTimingMode),
            st.integers(0, 1),
            st.sampled_from([None, 0, 64]),
            st.sampled_from([None, 0.0, 1.5]),
        ),
    ),
    st.sampled_from([Failed, TimedOut, Canceled, TransferCompleted]).map(lambda kind: kind(H)),
)


@settings(deadline=None)
@given(_small_inputs, _small_inputs)
def test_digests_are_equal_exactly_when_inputs_are(a: Input, b: Input) -> None:
    assert (codec.input_digest(a) == codec.input_digest(b)) == (a == b)


# --- the schema -----------------------------------------------------------------------------


def _walk(node: Any) -> Any:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


# In a fixed order: the sets' is by address, and pytest-xdist's workers must collect alike.
_TAGGED: list[type[msgspec.Struct]] = sorted(
    {*_members(Input), *_members(Action), *_members(Outcome), Rejection, EnginesReport},
    key=lambda cls: cls.__name__,
)


def _constants(schema: Any) -> set[Any]:
    found: set[Any] = set()
    for node in _walk(schema):
        if isinstance(node, dict):
            found.update(node.get("enum", []))
            if "const" in node:
                found.add(node["const"])
    return found


def test_the_wire_schema_is_json_schema_shaped() -> None:
    schema = codec.wire_schema()
    json.dumps(schema)  # serializable as it stands
    assert schema["$schema"].startswith("https://json-schema.org/")
    defs = schema["$defs"]
    refs = {n["$ref"] for n in _walk(schema) if isinstance(n, dict) and "$ref" in n}
    assert refs, "the schema has no references"
    assert all(ref.startswith("#/$defs/") for ref in refs)
    assert {ref.removeprefix("#/$defs/") for ref in refs} <= set(defs)
    # No definition may be a bare reference to itself (Rejection once was).
    assert all(d != {"$ref": f"#/$defs/{name}"} for name, d in defs.items())
    for name, union in (("Input", Input), ("Action", Action)):
        members = {m["$ref"].removeprefix("#/$defs/") for m in defs[name]["anyOf"]}
        assert members == {cls.__name__ for cls in _members(union)}


@pytest.mark.parametrize("cls", _TAGGED, ids=lambda cls: cls.__name__)
def test_every_tagged_message_has_a_definition_fixing_its_tag(cls: type[msgspec.Struct]) -> None:
    schema = codec.wire_schema()
    config = cls.__struct_config__
    definition = schema["$defs"][cls.__name__]
    assert definition.get("type") == "object", definition
    tag_schema = definition["properties"][config.tag_field]
    assert tag_schema.get("enum", [tag_schema.get("const")]) == [config.tag]
    assert config.tag_field in definition["required"]
    assert config.tag in _constants(schema)


def test_the_schema_command_prints_the_schema_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(codec.wire_schema()))


# --- the core stays pure --------------------------------------------------------------------


def test_the_core_imports_no_bus_database_or_worker_module() -> None:
    script = (
        "import kvhandoff.events, kvhandoff.events.coordinator, kvhandoff.events.codec, "
        "kvhandoff.events.conformance, kvhandoff.events.records, kvhandoff.events.subjects; "
        "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'nats','aiosqlite','sqlite3'} or m.startswith(('kvhandoff.worker', 'kvhandoff.client'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout == "[]\n"
