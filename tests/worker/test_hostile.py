"""The worker against hostile inputs: every failure of one input or one handoff stays there.

A poison input (one that makes decoding, digesting, logging or publishing fail) is rejected: its
rejection is logged, it is acknowledged (never redelivered), and a `rejection` is published on
`rejected.<id>` (or `rejected.unknown`). A handoff whose log cannot be rebuilt is quarantined: its
row says so, the rejections table and a gauge record it, its inputs are rejected, and every other
handoff carries on, at recovery too. Each case runs beside valid handoffs that must still
complete, and ends with the worker alive (the same process, /healthz 200) and every input
settled.

The fuzz test throws arbitrary bytes, arbitrary JSON and well-formed messages with extreme values
at one real worker, on valid and invalid subjects, with valid handoffs beside them.

The input stream takes `in.<token>` only, the subjects its transform can partition, so
JetStream refuses a publish to `in.<id>.more` at its publisher, and the worker never sees it.
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvhandoff.events.messages import (
    SUBMITTED,
    Action,
    ActionOutcome,
    Canceled,
    EngineType,
    Failed,
    HandoffCompletion,
    Input,
    SourceHeld,
    StartHandoff,
    SubmitPrefill,
)
from kvhandoff.worker.engines.healthy import TIMING, success_script
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.tier.planner import LOGGED_PAYLOAD_LIMIT
from tests.eventually import until
from tests.worker.bus_probe import (
    SUBJECTS,
    BusProbe,
    Rejected,
    assert_alive,
    corrupt_record,
    gauge,
    handoff_state,
    listed,
    logged_rejections,
    rejection_subject_matches,
    running,
    takes,
)
from tests.worker.conftest import WorkerProcess
from tests.worker.scripted_engine import Script, ScriptedEngines

DEADLINE_MS = 120_000
QUARANTINED_GAUGE = "kvhandoff_quarantined_handoffs"


def start(engine_type: EngineType = EngineType.VLLM) -> StartHandoff:
    return StartHandoff(uuid.uuid4(), engine_type, "prefill-0", "decode-0", DEADLINE_MS)


def holding_back(held: set[UUID]) -> Script:
    """The success path, except that the source of a held handoff never reports SourceHeld:
    the handoff stays open, awaiting that fact, until the test sends it."""

    def script(action: Action) -> list[Input]:
        if isinstance(action, SubmitPrefill) and action.handoff_id in held:
            return [ActionOutcome(action.handoff_id, action.action_id, SUBMITTED)]
        return success_script(action)

    return script


@pytest.fixture
async def probe(nats_server: EmbeddedNats) -> AsyncIterator[BusProbe]:
    observer = BusProbe(nats_server.url)
    await observer.start()
    yield observer
    await observer.close()


async def completed(
    engines: ScriptedEngines, worker: WorkerProcess, starts: list[StartHandoff]
) -> None:
    """Wait until every one of `starts` completed, and check that each succeeded."""
    ids = {s.handoff_id for s in starts}
    await until(
        lambda: ids <= engines.completions.keys(),
        f"{len(ids)} handoffs",
        within=60,
        guard=running(worker),
    )
    for s in starts:
        completions = [c.completion for c in engines.completions[s.handoff_id]]
        assert completions == [HandoffCompletion.SUCCESS], f"{s.handoff_id}: {completions}"


# --- Targeted poison inputs -----------------------------------------------------------------


@dataclass(frozen=True)
class Victims:
    """Two handoffs a poison input may name: one completed, one open (awaiting SourceHeld)."""

    done: StartHandoff
    open: StartHandoff

    @property
    def done_id(self) -> UUID:
        return self.done.handoff_id

    @property
    def open_id(self) -> UUID:
        return self.open.handoff_id


@dataclass(frozen=True)
class Poison:
    subject: str
    payload: bytes
    #: the handoff ids the rejection may name (None: no id could be read)
    names: frozenset[UUID | None]
    #: words the rejection's reason must contain (case-insensitive)
    says: tuple[str, ...] = ()


def body(**fields: object) -> bytes:
    # json, not msgspec: it writes what the worker's own types would refuse to (2**64, NaN).
    return json.dumps(fields, allow_nan=True).encode()


def start_body(handoff_id: UUID, **overrides: object) -> bytes:
    fields: dict[str, object] = {
        "type": "start_handoff",
        "handoff_id": str(handoff_id),
        "engine_type": "vllm",
        "source": "prefill-0",
        "destination": "decode-0",
        "deadline_ms": DEADLINE_MS,
    }
    return body(**(fields | overrides))


def source_held_body(handoff_id: UUID, **timing: object) -> bytes:
    fields: dict[str, object] = {"mode": "full_prompt", "full_prompt_tokens": 128}
    return body(type="source_held", handoff_id=str(handoff_id), timing=fields | timing)


def on_open(v: Victims, payload: bytes, *says: str) -> Poison:
    """A poison input on the open victim's own subject."""
    return Poison(SUBJECTS.input(v.open_id), payload, frozenset({v.open_id, None}), says)


def new_start(*says: str, **overrides: object) -> Callable[[Victims], Poison]:
    """A poison StartHandoff for a new handoff, on that handoff's subject."""

    def build(_: Victims) -> Poison:
        fresh = uuid.uuid4()
        payload = start_body(fresh, **overrides)
        return Poison(SUBJECTS.input(fresh), payload, frozenset({fresh, None}), says)

    return build


def deep(opening: bytes, closing: bytes) -> Callable[[Victims], Poison]:
    """A cancel for the open victim carrying an ignored field nested 1,000 levels deep."""

    def build(v: Victims) -> Poison:
        nested = opening * 1000 + b"1" + closing * 1000
        payload = b'{"type": "canceled", "handoff_id": "%s", "x": %s}' % (
            str(v.open_id).encode(),
            nested,
        )
        return on_open(v, payload)

    return build


def mismatched_subject(v: Victims) -> Poison:
    # A cancel for the open victim, sent to another handoff's subject.
    elsewhere = uuid.uuid4()
    payload = body(type="canceled", handoff_id=str(v.open_id))
    return Poison(
        SUBJECTS.input(elsewhere), payload, frozenset({elsewhere, v.open_id, None}), ("subject",)
    )


def subject_without_id(token: str) -> Callable[[Victims], Poison]:
    def build(v: Victims) -> Poison:
        subject = f"{SUBJECTS.prefix}.in.{token.format(open=v.open_id)}"
        payload = body(type="canceled", handoff_id=str(v.open_id))
        return Poison(subject, payload, frozenset({v.open_id, None}), ("subject",))

    return build


def action_id_2_64(v: Victims) -> Poison:
    payload = body(
        type="action_outcome",
        handoff_id=str(v.done_id),
        action_id=2**64,
        outcome={"kind": "applied"},
    )
    return Poison(SUBJECTS.input(v.done_id), payload, frozenset({v.done_id, None}), ("action_id",))


def token_count_2_64(v: Victims) -> Poison:
    payload = source_held_body(v.open_id, full_prompt_tokens=2**64)
    return on_open(v, payload, "full_prompt_tokens")


def infinite_bandwidth(v: Victims) -> Poison:
    return on_open(v, source_held_body(v.open_id, kv_bytes_per_token=1, bandwidth_gb_s=math.inf))


def huge_negative_bandwidth(v: Victims) -> Poison:
    payload = source_held_body(v.open_id, kv_bytes_per_token=1, bandwidth_gb_s=-1.7e308)
    return on_open(v, payload, "bandwidth")


def overflowing_fallback_delay(_: Victims) -> Poison:
    # A JSON number beyond every float (Python would write a bigger float as Infinity).
    fresh = uuid.uuid4()
    payload = start_body(fresh, fallback_delay_ms="HUGE").replace(b'"HUGE"', b"1e999")
    return Poison(SUBJECTS.input(fresh), payload, frozenset({fresh, None}), ("fallback_delay_ms",))


def invalid_utf8_ignored_field(v: Victims) -> Poison:
    # Well-formed but for the bytes of a field the decoder skips: still not JSON.
    payload = (
        b'{"type": "canceled", "handoff_id": "%s", "note": "\xff\xfe"}' % str(v.open_id).encode()
    )
    return on_open(v, payload)


def invalid_utf8_engine_id(_: Victims) -> Poison:
    fresh = uuid.uuid4()
    payload = start_body(fresh, source="SOURCE").replace(b'"SOURCE"', b'"pre\xc3\x28"')
    return Poison(SUBJECTS.input(fresh), payload, frozenset({fresh, None}))


def megabyte_outcome(v: Victims) -> Poison:
    # Rejected by the coordinator, whose reason quotes the outcome: a 1 MB reason.
    payload = body(
        type="action_outcome",
        handoff_id=str(v.open_id),
        action_id=99,
        outcome={"kind": "failed", "reason": "x" * 1_000_000},
    )
    return on_open(v, payload)


def megabyte_of_binary(v: Victims) -> Poison:
    return on_open(v, bytes(range(256)) * 3900)


def unknown_tag(v: Victims) -> Poison:
    return on_open(v, body(type="no_such_message", handoff_id=str(v.open_id)))


POISONS = [
    pytest.param(deep(b"[", b"]"), id="json-arrays-1000-deep"),
    pytest.param(deep(b'{"a": ', b"}"), id="json-objects-1000-deep"),
    pytest.param(action_id_2_64, id="action-id-2**64-for-a-completed-handoff"),
    pytest.param(token_count_2_64, id="token-count-2**64-for-an-open-handoff"),
    pytest.param(new_start("deadline_ms", deadline_ms=2**63 - 1), id="deadline-ms-2**63-1"),
    pytest.param(new_start("deadline_ms", deadline_ms=2**64), id="deadline-ms-2**64"),
    pytest.param(overflowing_fallback_delay, id="fallback-delay-overflows"),
    pytest.param(new_start(fallback_delay_ms=math.nan), id="fallback-delay-nan"),
    pytest.param(infinite_bandwidth, id="bandwidth-infinity"),
    pytest.param(huge_negative_bandwidth, id="bandwidth-huge-negative"),
    pytest.param(new_start("source", source="prefill\x00-0"), id="nul-in-source-engine-id"),
    pytest.param(new_start("destination", destination="decode\x1b[2J"), id="esc-in-engine-id"),
    pytest.param(invalid_utf8_ignored_field, id="invalid-utf8-in-an-ignored-field"),
    pytest.param(invalid_utf8_engine_id, id="invalid-utf8-in-an-engine-id"),
    pytest.param(megabyte_outcome, id="1mb-outcome-for-an-action-never-issued"),
    pytest.param(megabyte_of_binary, id="1mb-of-binary"),
    pytest.param(unknown_tag, id="unknown-tag"),
    pytest.param(mismatched_subject, id="subject-names-another-handoff"),
    pytest.param(subject_without_id("x"), id="subject-without-an-id"),
    pytest.param(subject_without_id("{open}.more"), id="subject-with-a-token-after-the-id"),
]


@pytest.mark.parametrize("make_poison", POISONS)
async def test_a_poison_input_is_rejected_and_the_worker_carries_on(
    worker: WorkerProcess,
    engines: ScriptedEngines,
    probe: BusProbe,
    make_poison: Callable[[Victims], Poison],
) -> None:
    assert worker.process is not None
    pid = worker.process.pid
    victims = Victims(start(), start())
    engines.script = holding_back({victims.open_id})
    for command in (victims.done, victims.open):
        await engines.start_handoff(command)
    await completed(engines, worker, [victims.done])
    await until(
        lambda: bool(engines.actions_of(victims.open_id)),
        "the open victim",
        within=60,
        guard=running(worker),
    )

    poison = make_poison(victims)
    stored = takes(poison.subject)
    if stored:
        await probe.publish(poison.subject, poison.payload)
    else:  # refused to its publisher: the worker never sees it
        assert await probe.refused(poison.subject, poison.payload)
    after = [start(EngineType.SGLANG), start(EngineType.TRTLLM)]
    for command in after:
        await engines.start_handoff(command)
    await completed(engines, worker, after)
    # The open victim goes on from where it was: the poison changed nothing in it.
    await engines.send(SourceHeld(victims.open_id, TIMING))
    await completed(engines, worker, [victims.open, victims.done])

    await probe.wait_settled(worker, within=30)
    await probe.nc.flush()
    if not stored:
        assert not probe.rejected and not probe.undecodable, probe.rejected or probe.undecodable
        assert_alive(worker, pid)
        return
    # Settled means acknowledged, and the rejection is published before that.
    await probe.wait_rejections(lambda r: True, "the poison's rejection", worker, within=10)
    await probe.nc.flush()
    assert not probe.undecodable, f"not rejection messages: {probe.undecodable}"
    assert len(probe.rejected) == 1, [r.rejection for r in probe.rejected]
    rejected = probe.rejected[0]
    assert rejection_subject_matches(rejected), rejected
    assert rejected.rejection.handoff_id in poison.names, rejected.rejection
    reason = rejected.rejection.reason
    assert reason
    for word in poison.says:
        assert word in reason.lower(), f"the reason does not mention {word!r}: {reason[:300]}"
    assert_alive(worker, pid)


async def test_inputs_that_together_outgrow_a_log_entry_are_rejected_and_nothing_wedges(
    worker: WorkerProcess, engines: ScriptedEngines, probe: BusProbe
) -> None:
    """A batch's rows go to the partition's replicated log as one message, which the bus
    bounds (a megabyte by default): inputs near that size, several at once or one alone, are
    rejected like any poison (the log keeps the first 64 KiB of each), the batches around them
    are cut to fit, and valid handoffs beside them complete."""
    assert worker.process is not None
    pid = worker.process.pid
    victim = start()
    engines.script = holding_back({victim.handoff_id})
    await engines.start_handoff(victim)
    await until(
        lambda: bool(engines.actions_of(victim.handoff_id)),
        "the victim",
        within=60,
        guard=running(worker),
    )
    largest = probe.nc.max_payload - 1024  # room for JetStream's headers
    subject = SUBJECTS.input(victim.handoff_id)
    for size in (largest, 900_000, 900_000, 900_000):
        await probe.publish(subject, bytes(range(256)) * (size // 256))
    valid = [start(), start(EngineType.SGLANG)]
    for command in valid:
        await engines.start_handoff(command)
    await completed(engines, worker, valid)

    await probe.wait_settled(worker, within=60)
    await until(
        lambda: len(probe.rejected) == 4, "four rejections", within=10, guard=running(worker)
    )
    assert all(r.rejection.handoff_id == victim.handoff_id for r in probe.rejected)
    assert_alive(worker, pid)
    assert worker.terminate() == 0  # the file committed in full
    with closing(sqlite3.connect(worker.db)) as connection:
        kept = connection.execute(
            "SELECT length(payload) FROM rejections WHERE handoff_id = ?",
            (str(victim.handoff_id),),
        ).fetchall()
    assert kept == [(LOGGED_PAYLOAD_LIMIT,)] * 4


# --- Handoffs whose log cannot be rebuilt ---------------------------------------------------


async def assert_quarantined(
    probe: BusProbe, worker: WorkerProcess, handoff_id: UUID, engines: ScriptedEngines
) -> None:
    """The handoff is set aside, visibly, and an input for it is rejected as quarantined."""

    def names_it(rejected: Rejected) -> bool:
        r = rejected.rejection
        return r.handoff_id == handoff_id and "quarantined" in r.reason.lower()

    await probe.wait_rejections(names_it, f"an input for {handoff_id} rejected", worker)
    assert handoff_state(worker.db, handoff_id) == "quarantined"
    reasons = logged_rejections(worker.db, handoff_id)
    assert any(r.startswith("quarantined:") for r in reasons), reasons
    assert gauge(worker.metrics(), QUARANTINED_GAUGE) == 1.0, worker.metrics()
    assert listed(worker.db, "--state", "quarantined") == {handoff_id}
    # It stays quarantined: a later input for it is rejected too, and changes nothing.
    already = sum(names_it(r) for r in probe.rejected)
    await engines.send(Failed(handoff_id))
    await until(
        lambda: sum(names_it(r) for r in probe.rejected) > already,
        "a second",
        within=60,
        guard=running(worker),
    )
    assert handoff_state(worker.db, handoff_id) == "quarantined"


async def test_an_input_for_a_completed_handoff_with_a_corrupt_log_quarantines_only_it(
    worker: WorkerProcess, engines: ScriptedEngines, probe: BusProbe
) -> None:
    assert worker.process is not None
    pid = worker.process.pid
    corrupt, intact, held = start(), start(EngineType.SGLANG), start()
    engines.script = holding_back({held.handoff_id})
    for command in (corrupt, intact, held):
        await engines.start_handoff(command)
    await completed(engines, worker, [corrupt, intact])

    corrupt_record(worker.db, corrupt.handoff_id, seq=1)  # beside the running worker
    await engines.send(Canceled(corrupt.handoff_id))  # the worker must load its log for this
    after = [start(EngineType.TRTLLM), start(EngineType.SGLANG)]
    for command in after:
        await engines.start_handoff(command)
    await completed(engines, worker, after)
    await assert_quarantined(probe, worker, corrupt.handoff_id, engines)

    # Everything else carries on: the open handoff completes, and a completed one with an
    # intact log still loads, reopens cleanup for a late cancel and completes again.
    await engines.send(SourceHeld(held.handoff_id, TIMING))
    await completed(engines, worker, [held])
    await engines.send(Canceled(intact.handoff_id))
    await until(
        lambda: len(engines.completions[intact.handoff_id]) == 2,
        "a recancel",
        within=60,
        guard=running(worker),
    )
    assert engines.completions[intact.handoff_id][1].completion is HandoffCompletion.CANCELED
    assert len(engines.completions[corrupt.handoff_id]) == 1
    await probe.wait_settled(worker, within=30)
    assert_alive(worker, pid)


async def test_an_open_handoff_with_a_corrupt_log_is_quarantined_at_recovery(
    worker: WorkerProcess, engines: ScriptedEngines, probe: BusProbe
) -> None:
    corrupt, other, done = start(), start(EngineType.TRTLLM), start(EngineType.SGLANG)
    engines.script = holding_back({corrupt.handoff_id, other.handoff_id})
    for command in (corrupt, other, done):
        await engines.start_handoff(command)
    await completed(engines, worker, [done])
    held = {corrupt.handoff_id, other.handoff_id}
    await until(
        lambda: all(engines.actions_of(h) for h in held),
        "both held handoffs",
        within=60,
        guard=running(worker),
    )
    await probe.wait_settled(worker, within=30)  # the Submitted outcomes are in the log
    assert worker.terminate() == 0

    corrupt_record(worker.db, corrupt.handoff_id, seq=1)
    worker.start()  # must come up, and recover every other open handoff
    assert worker.process is not None
    pid = worker.process.pid
    metrics = worker.metrics()
    assert gauge(metrics, QUARANTINED_GAUGE) == 1.0, worker.logs()
    assert gauge(metrics, "kvhandoff_recovered_handoffs") == 2.0, metrics  # the corrupt one too
    assert gauge(metrics, "kvhandoff_open_handoffs") == 1.0, metrics
    await engines.send(SourceHeld(corrupt.handoff_id, TIMING))
    await assert_quarantined(probe, worker, corrupt.handoff_id, engines)

    await engines.send(SourceHeld(other.handoff_id, TIMING))
    fresh = start()
    await engines.start_handoff(fresh)
    await completed(engines, worker, [other, fresh, done])
    assert corrupt.handoff_id not in engines.completions
    await probe.wait_settled(worker, within=30)
    assert_alive(worker, pid)


# --- Fuzz -----------------------------------------------------------------------------------

TARGETS = 2  # handoffs per example that the fuzzed messages may name

#: A fuzzed message's handoff id: an int picks one of the example's targets (started before
#: the fuzz, so known to the worker), a UUID is a handoff nobody started, a str is no id.
Ref = int | UUID | str

targets = st.integers(0, TARGETS - 1)
refs: st.SearchStrategy[Ref] = targets | st.uuids() | st.text(max_size=40)
known_refs: st.SearchStrategy[Ref] = targets | targets | st.uuids()
boundaries = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100, -1, -(2**63), -(2**64)]
extreme_ints = st.sampled_from(boundaries) | st.integers(-(2**80), 2**80)
extreme_floats = (
    st.sampled_from(
        [
            -0.0,
            5e-324,
            1e-320,
            1.7976931348623157e308,
            -1.7976931348623157e308,
            math.inf,
            -math.inf,
            math.nan,
        ]
    )
    | st.floats()
)
odd_engine_ids = st.sampled_from(
    ["a" * 128, "a" * 129, "", "x\x00y", "\x1b[2J", "\x7f", "é", "\u2028", "a.b", "a*", "a>"]
) | st.text(max_size=40)


def sometimes(usual: object, odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field that is usually valid, so that one extreme value gets past the others."""
    return st.just(usual) | st.just(usual) | odd


@dataclass(frozen=True)
class Long:
    """A long text, kept short in hypothesis's reports until it goes on the wire."""

    length: int


outcomes = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(
            ["submitted", "accepted", "scheduled", "applied", "noop", "failed", "unheard_of"]
        )
    },
    optional={"reason": st.text(max_size=50) | st.builds(Long, st.integers(10_000, 900_000))},
)
timings = st.fixed_dictionaries(
    {
        "mode": sometimes("full_prompt", st.sampled_from(["destination_missing", "other"])),
        "full_prompt_tokens": sometimes(128, extreme_ints),
    },
    optional={
        "kv_bytes_per_token": sometimes(1024, extreme_ints | st.none()),
        "bandwidth_gb_s": sometimes(10.0, extreme_floats | st.none()),
    },
)
#: Well-formed messages (a real tag, the right fields) with extreme values in some fields.
extreme_messages = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("start_handoff"),
            "handoff_id": refs,
            "engine_type": sometimes("vllm", st.sampled_from(["sglang", "trtllm", "other"])),
            "source": sometimes("prefill-0", odd_engine_ids),
            "destination": sometimes("decode-0", odd_engine_ids),
            "deadline_ms": sometimes(60_000, extreme_ints),
        },
        optional={"fallback_delay_ms": extreme_floats},
    ),
    st.fixed_dictionaries(
        {"type": st.just("source_held"), "handoff_id": known_refs, "timing": timings}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("destination_reserved"),
            "handoff_id": known_refs,
            "transferable_prompt_tokens": extreme_ints | extreme_floats,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["transfer_completed", "failed", "timed_out", "canceled"]),
            "handoff_id": known_refs,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("action_outcome"),
            "handoff_id": known_refs,
            "action_id": sometimes(0, extreme_ints),
            "outcome": outcomes,
        }
    ),
)
json_values = st.recursive(
    st.none() | st.booleans() | extreme_ints | extreme_floats | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=30,
)
tags = st.sampled_from(
    [
        "start_handoff",
        "source_held",
        "destination_reserved",
        "transfer_completed",
        "failed",
        "timed_out",
        "canceled",
        "action_outcome",
        "complete",
        "rejection",
        "no_such_type",
    ]
)
#: Arbitrary JSON, some of it shaped like a message (a real tag and an id, then anything).
arbitrary_json = json_values | st.builds(
    lambda tag, ref, extra: {**extra, "type": tag, "handoff_id": ref},
    tags,
    refs,
    st.dictionaries(st.text(max_size=20), json_values, max_size=4),
)


@dataclass(frozen=True)
class Nested:
    """A cancel whose ignored field nests `depth` arrays or objects."""

    handoff_id: Ref
    depth: int
    objects: bool


nested = st.builds(Nested, known_refs, st.integers(1, 3000), st.booleans())
Body = bytes | Nested | dict[str, Any] | list[Any] | str | int | float | bool | None
bodies: st.SearchStrategy[Body] = st.one_of(
    st.binary(max_size=600), arbitrary_json, extreme_messages, extreme_messages, nested
)
#: Where a message is sent: None is its own handoff's subject, else a ref or a bad token.
subject_tokens = st.none() | st.none() | refs | st.sampled_from(["x", "-", "{target}.more"])
fuzzed = st.lists(st.tuples(subject_tokens, bodies), min_size=1, max_size=30)


def resolve(ref: object, target_ids: list[UUID]) -> object:
    """A ref as it goes on the wire: a target's id, a UUID's text, anything else as it is."""
    if isinstance(ref, bool) or not isinstance(ref, int | UUID):
        return ref
    if isinstance(ref, int):
        return str(target_ids[ref]) if 0 <= ref < len(target_ids) else ref
    return str(ref)


def expand(value: object) -> object:
    """json.dumps's fallback for what it cannot write: the fuzz's placeholders."""
    assert isinstance(value, Long), value
    return "r" * value.length


def materialise(token: object, message: Body, target_ids: list[UUID]) -> tuple[str, bytes]:
    """The subject and payload of one fuzzed message, with its refs filled in."""
    own: object = None
    match message:
        case bytes():
            payload = message
        case Nested(handoff_id=ref, depth=depth, objects=objects):
            own = resolve(ref, target_ids)
            opening, closing = (b'{"a": ', b"}") if objects else (b"[", b"]")
            inner = opening * depth + b"0" + closing * depth
            head = json.dumps({"type": "canceled", "handoff_id": own}).encode()
            payload = head[:-1] + b', "x": ' + inner + b"}"
        case dict():
            if "handoff_id" in message:
                own = resolve(message["handoff_id"], target_ids)
                message = {**message, "handoff_id": own}
            payload = json.dumps(message, allow_nan=True, default=expand).encode()
        case _:
            payload = json.dumps(message, allow_nan=True).encode()
    if token is None:
        token = own if isinstance(own, str) else uuid.uuid4()
    elif token == "{target}.more":
        token = f"{target_ids[0]}.more"
    # Subject tokens are visible characters: anything else could not even be published.
    text = str(resolve(token, target_ids))
    safe = "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "_" for c in text)
    return f"{SUBJECTS.prefix}.in." + ".".join(t or "_" for t in safe.split(".")), payload


def test_fuzzed_inputs_never_stop_the_worker(tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()
    store = tmp_path / "nats"
    store.mkdir()
    server = EmbeddedNats(store_dir=store)
    server.start()
    worker = WorkerProcess(server.url, tmp_path / "kvhandoff.db")
    engines = ScriptedEngines(server.url)
    observer = BusProbe(server.url)
    try:
        worker.start()
        assert worker.process is not None
        pid = worker.process.pid
        loop.run_until_complete(engines.start())
        loop.run_until_complete(observer.start())

        async def example(messages: list[tuple[object, Body]]) -> None:
            named = [start(engine_type) for engine_type in (EngineType.VLLM, EngineType.SGLANG)]
            for command in named:
                await engines.start_handoff(command)
            target_ids = [t.handoff_id for t in named]
            for token, message in messages:
                subject, payload = materialise(token, message, target_ids)
                if takes(subject):
                    await observer.publish(subject, payload)
                else:
                    assert await observer.refused(subject, payload), subject
            # Handoffs that nothing fuzzed names: they must succeed beside the fuzz.
            valid = [start(EngineType.TRTLLM), start(EngineType.SGLANG)]
            for command in valid:
                await engines.start_handoff(command)
            await completed(engines, worker, valid)
            assert_alive(worker, pid)

        @settings(
            max_examples=40,
            deadline=None,
            # No shrinking: the worker is one process, and once an input killed it every
            # smaller example fails too. The failing example is reported as generated.
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(fuzzed)
        def run(messages: list[tuple[object, Body]]) -> None:
            loop.run_until_complete(example(messages))

        run()
        # Every fuzzed message is settled in the end: acknowledged, applied or rejected
        # (an early fact for a handoff that never starts is rejected after its redeliveries).
        loop.run_until_complete(observer.wait_settled(worker, within=120))
        assert_alive(worker, pid)
        assert not observer.undecodable, observer.undecodable[:3]
        wrong = [r for r in observer.rejected if not rejection_subject_matches(r)]
        assert not wrong, wrong[:3]
        assert all(r.rejection.reason for r in observer.rejected)
    finally:
        loop.run_until_complete(observer.close())
        loop.run_until_complete(engines.close())
        loop.close()
        worker.stop()
        server.close()
