"""The schema is the contract: every message that the worker, the mock engines (the engine
client) and the load generator (the frontend client) publish during a full demo run validates
against `kvhandoff schema`, checked with a standard JSON Schema validator (`jsonschema`, with
its format checker, so a `handoff_id` must be a UUID), as an engine in another language would.

The demo runs as a real process against this test's nats-server, and a subscriber to every
kvhandoff subject captures what crosses the bus, by subject: inputs on `<prefix>.in.*`, actions
on `<prefix>.engine.*.actions`, completions on `<prefix>.done.*`, rejections on
`<prefix>.rejected.*`. (The engines' report requests on `<prefix>.engines.report` carry an empty
body and no message of the vocabulary, and the worker's appends to its own replicated log on
`<prefix>.log.<p>` are its records, read by no other party.) The replies to report requests
travel on inboxes, so a second test asks the mock engines for them and holds them to the schema.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from kvhandoff.client import Connection
from kvhandoff.events.messages import EngineType
from kvhandoff.worker.bus.connection import Bus, Message
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.engines import EnginesConfig, MockEngines, Roster
from kvhandoff.worker.harness.natsserver import EmbeddedNats

HANDOFFS = 300


def validator(schema: dict[str, Any], definition: str) -> Draft202012Validator:
    """A validator of one kind of message, against the schema's own definitions."""
    document = {
        "$schema": schema["$schema"],
        "$defs": schema["$defs"],
        "$ref": f"#/$defs/{definition}",
    }
    Draft202012Validator.check_schema(document)
    return Draft202012Validator(document, format_checker=Draft202012Validator.FORMAT_CHECKER)


def kind_of(subject: str) -> str | None:
    """Which definition a subject's messages must match, or None for the report requests and
    the worker's log."""
    parts = subject.split(".")
    match parts[1:]:
        case ["in", _]:
            return "Input"
        case ["engine", _, "actions"]:
            return "Action"
        case ["done", _]:
            return "Action"  # a Complete
        case ["rejected", _]:
            return "Rejection"
        case ["engines", "report"]:
            return None
        case ["log", _]:
            return None  # the worker's own replicated log: not a message between parties
    raise AssertionError(f"a message on an unexpected subject: {subject}")


async def printed_schema() -> dict[str, Any]:
    printed = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvhandoff.worker.cli", "schema", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await printed.communicate()
    assert printed.returncode == 0
    schema: dict[str, Any] = json.loads(out)
    return schema


async def test_every_message_of_a_demo_run_validates_against_the_published_schema(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    schema = await printed_schema()
    validators = {kind: validator(schema, kind) for kind in ("Input", "Action", "Rejection")}

    captured: list[Message] = []

    async def capture(msg: Message) -> None:
        captured.append(msg)

    bus = await Bus.connect(NatsSettings(url=nats_server.url), "schema-capture")
    try:
        await bus.subscribe("kvhandoff.>", capture)
        await bus.flush()
        demo = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvhandoff.worker.cli",
            "demo",
            "--quiet",
            "--nats-url",
            nats_server.url,
            "--handoffs",
            str(HANDOFFS),
            "--concurrency",
            "32",
            "--db",
            str(tmp_path / "demo.db"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
        output, _ = await asyncio.wait_for(demo.communicate(), timeout=600)
        assert demo.returncode == 0, output.decode(errors="replace")
        await bus.flush()  # everything published before the demo ended has reached us
    finally:
        await bus.close()

    tags: Counter[tuple[str, str]] = Counter()
    started: set[str] = set()
    invalid = []
    for msg in captured:
        kind = kind_of(msg.subject)
        if kind is None:
            continue
        document = json.loads(msg.data)
        errors = [error.message for error in validators[kind].iter_errors(document)]
        if errors:
            invalid.append(f"{msg.subject}: {msg.data!r}: {errors}")
        tags[(kind, document.get("type", "?"))] += 1
        if kind == "Input" and document.get("type") == "start_handoff":
            started.add(document["handoff_id"])
    assert not invalid, f"{len(invalid)} messages break the schema, e.g.\n" + "\n".join(
        invalid[:10]
    )
    # The run exercised the whole vocabulary that engines and frontends send and receive.
    inputs = {
        "start_handoff",
        "source_held",
        "destination_reserved",
        "transfer_completed",
        "failed",
        "canceled",
        "action_outcome",
    }
    actions = {
        "submit_prefill",
        "reserve_destination",
        "start_transfer",
        "activate_destination",
        "release_source",
        "cancel_source",
        "cancel_destination",
        "complete",
    }
    assert inputs <= {tag for kind, tag in tags if kind == "Input"}, tags
    assert actions <= {tag for kind, tag in tags if kind == "Action"}, tags
    # (By id: a publish retried after a lost acknowledgement reaches core subscribers twice.)
    assert len(started) == HANDOFFS


async def test_the_engines_report_validates_against_the_published_schema(
    nats_server: EmbeddedNats,
) -> None:
    check = validator(await printed_schema(), "EnginesReport")
    roster = Roster(engine_types=(EngineType.SGLANG,), sources=1, destinations=1)
    async with await Connection.open(NatsSettings(url=nats_server.url), "engines") as connection:
        engines = MockEngines(connection, EnginesConfig(roster=roster))
        await engines.start()
        try:
            replies = await connection.gather(
                connection.subjects.engines_report, first_reply_s=5.0, quiet_s=0.2
            )
        finally:
            await engines.stop()
    assert len(replies) == 1
    document = json.loads(replies[0])
    assert [error.message for error in check.iter_errors(document)] == []
    assert {e["engine_id"] for e in document["engines"]} == set(roster.engine_ids())
    # What a foreign engine that keeps no accounting sends is enough.
    engine = "sglang-decode-9"
    minimal = {
        "type": "engines_report",
        "process": "rust-7",
        "engines": [{"engine_id": engine, "engine_type": "sglang", "role": "destination"}],
        "leaks": [{"engine_id": engine, "handoff_id": str(uuid.uuid4()), "state": "held"}],
    }
    assert [error.message for error in check.iter_errors(minimal)] == []
