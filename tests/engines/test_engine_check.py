"""`kvhandoff engine-check`: the mock engines and examples/engine.py keep every rule of the wire
contract, and an engine that breaks one rule (`broken_engine.Break`) fails that rule alone.

The mock engines and the example run as real processes, checked by the real command; the broken
engine runs in the test's loop on its own connection, checked by `EngineCheck` itself.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvhandoff.events.messages import Role
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.conformance import engine_check as kit
from kvhandoff.worker.conformance.engine_check import EngineCheck, role_of
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.engines.broken_engine import Break, BrokenEngine
from tests.engines.conftest import StartEngines
from tests.engines.harness import SOURCE

ROOT = Path(__file__).resolve().parents[2]
KVHANDOFF = [sys.executable, "-m", "kvhandoff.worker.cli"]
RULES = set(kit.RULES)
# The broken engine's slow part ends within milliseconds of what the rules watch for.
QUIET_S = 0.3


async def serving(command: list[str], listening: str) -> asyncio.subprocess.Process:
    """Start an engine process and return once its log says it listens."""
    process = await asyncio.create_subprocess_exec(
        *command, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert process.stdout is not None
    printed: list[str] = []
    async with asyncio.timeout(60):
        while listening not in (printed or [""])[-1]:
            line = (await process.stdout.readline()).decode()
            assert line, "the engine ended before it listened:\n" + "".join(printed)
            printed.append(line)
    return process


async def engine_check(engine_id: str, *options: str) -> tuple[int, list[str]]:
    checked = await asyncio.create_subprocess_exec(
        *KVHANDOFF,
        "engine-check",
        engine_id,
        *options,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(checked.communicate(), timeout=120)
    assert checked.returncode is not None
    return checked.returncode, out.decode().splitlines()


def rules_passed(lines: list[str]) -> set[str]:
    return {line.split()[1] for line in lines if line.startswith("PASS ")}


async def stopped(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
    await asyncio.wait_for(process.communicate(), timeout=30)


async def test_the_mock_engines_pass_every_rule(
    nats_server: EmbeddedNats, subjects: Subjects
) -> None:
    bus = ["--nats-url", nats_server.url, "--subject-prefix", subjects.prefix]
    engines = await serving(
        [
            *KVHANDOFF,
            "engines",
            *bus,
            "--engine-types",
            "sglang",
            "--sources",
            "1",
            "--destinations",
            "1",
            "--speedup",
            "100",
        ],
        "mock engines listening",
    )
    try:
        for engine_id in ("sglang-prefill-0", "sglang-decode-0"):
            code, lines = await engine_check(engine_id, *bus, "--quiet", "0.5")
            assert code == 0, "\n".join(lines)
            assert rules_passed(lines) == RULES
    finally:
        await stopped(engines)


async def test_the_example_engine_passes_every_rule(nats_server: EmbeddedNats) -> None:
    # The example connects with the default subject prefix, so it gets engine ids of its own.
    bus = ["--nats-url", nats_server.url]
    for role, engine_id in (("source", "trtllm-prefill-7"), ("destination", "trtllm-decode-7")):
        example = await serving(
            [sys.executable, "examples/engine.py", *bus, role, engine_id], "is listening"
        )
        try:
            code, lines = await engine_check(engine_id, *bus, "--quiet", "0.5")
        finally:
            await stopped(example)
        assert code == 0, "\n".join(lines)
        assert rules_passed(lines) == RULES


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    connected = await Bus.connect(NatsSettings(url=nats_server.url), "engine-check-test")
    yield connected
    await connected.close()


@pytest.mark.parametrize("role", [Role.SOURCE, Role.DESTINATION])
@pytest.mark.parametrize(
    "broken", [None, *Break], ids=lambda b: f"breaks-{b}" if b else "keeps-all"
)
async def test_an_engine_that_breaks_one_rule_fails_that_rule_alone(
    nats_server: EmbeddedNats, subjects: Subjects, bus: Bus, role: Role, broken: Break | None
) -> None:
    engine_id = "vllm-prefill-0" if role is Role.SOURCE else "vllm-decode-0"
    engine = BrokenEngine(bus, subjects, engine_id, role, broken)
    await engine.start()
    try:
        check = EngineCheck(bus, subjects, engine_id, role, wait_s=2.0, quiet_s=QUIET_S)
        verdicts = await check.run()
    finally:
        await engine.stop()
    failed = {verdict.rule for verdict in verdicts if not verdict.passed}
    assert failed == ({broken.value} if broken else set()), [v.line() for v in verdicts]
    assert {verdict.rule for verdict in verdicts} == RULES


def test_the_broken_engine_breaks_every_rule_in_turn() -> None:
    assert {rule.value for rule in Break} == RULES


def test_the_role_comes_from_the_engine_id_naming() -> None:
    assert role_of("vllm-prefill-0") is Role.SOURCE
    assert role_of("sglang-decode-12") is Role.DESTINATION
    assert role_of("my-engine") is None


async def test_an_engine_nobody_serves_fails_every_rule_and_the_command_exits_1(
    nats_server: EmbeddedNats, subjects: Subjects
) -> None:
    bus = ["--nats-url", nats_server.url, "--subject-prefix", subjects.prefix]
    code, lines = await engine_check("vllm-decode-9", *bus, "--wait", "0.3", "--quiet", "0.1")
    assert code == 1
    failed = [line for line in lines if line.startswith("FAIL ")]
    assert {line.split()[1] for line in failed} == RULES
    probe = next(line for line in failed if line.split()[1] == "probe")
    assert "no reply" in probe and "→ empty request" in probe  # what it sent, what came back
    assert lines[-1] == "vllm-decode-9 (destination): 0 passed, 10 failed"


async def test_an_id_that_names_no_role_needs_role(nats_server: EmbeddedNats) -> None:
    code, lines = await engine_check("my-engine", "--nats-url", nats_server.url)
    assert code == 2
    assert "--role" in "\n".join(lines)


async def test_beside_a_worker_the_check_uses_its_stream_and_still_sees_everything(
    subjects: Subjects, worker: Path, start_engines: StartEngines, bus: Bus
) -> None:
    # The worker's input stream stores the engine's inputs (the checker makes none of its own)
    # and the worker rejects them, for handoffs it never started; the checker reads them as a
    # core subscriber all the same.
    await start_engines()
    check = EngineCheck(bus, subjects, SOURCE, Role.SOURCE, quiet_s=QUIET_S)
    verdicts = await check.run()
    assert [v.line() for v in verdicts if not v.passed] == []
    assert {verdict.rule for verdict in verdicts} == RULES
