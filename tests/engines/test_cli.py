"""`kvhandoff engines` and `kvhandoff load` as other tools run them: child processes, exit codes,
the JSON report and the leak report at exit."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvhandoff.events.messages import ActionOutcome, SourceHeld, SubmitPrefill
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.engines.harness import FAST, SOURCE, WorkerSide

KVHANDOFF = [sys.executable, "-m", "kvhandoff.worker.cli"]
FAST_ENGINES = ["--sources", "1", "--destinations", "1", "--speedup", "1000"]


def bus_options(nats_server: EmbeddedNats, subjects: Subjects) -> list[str]:
    return ["--nats-url", nats_server.url, "--subject-prefix", subjects.prefix]


def test_load_reports_json_and_exits_0_and_the_engines_exit_0_without_leaks(
    nats_server: EmbeddedNats, subjects: Subjects, worker: Path, tmp_path: Path
) -> None:
    bus = bus_options(nats_server, subjects)
    engines = subprocess.Popen(
        [*KVHANDOFF, "engines", *bus, *FAST_ENGINES], stdout=subprocess.PIPE, text=True
    )
    try:
        report_path = tmp_path / "report.json"
        command = [
            *KVHANDOFF,
            "load",
            *bus,
            "--sources",
            "1",
            "--destinations",
            "1",
            "--handoffs",
            "20",
            "--concurrency",
            "4",
            "--cancel-share",
            "0.2",
            "--json",
            str(report_path),
        ]
        load = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        assert load.returncode == 0, load.stdout + load.stderr
        assert "completed" in load.stdout  # the summary table
        report = json.loads(report_path.read_text())
        assert report["handoffs"] == 20
        assert report["completed"] + report["canceled"] == 20
        assert (report["timed_out"], report["rejected"], report["leaks"]) == (0, 0, 0)
        assert report["throughput_per_s"] > 0
        assert set(report["latency_ms"]) >= {"p50", "p90", "p99"}
    finally:
        engines.send_signal(signal.SIGINT)
        out, _ = engines.communicate(timeout=30)
    assert engines.returncode == 0, out
    assert "no leaks" in out


def test_usage_errors_exit_2(nats_server: EmbeddedNats) -> None:
    for command in (
        ["load", "--nats-url", nats_server.url, "--handoffs", "0"],
        ["engines", "--nats-url", nats_server.url, "--fail-rate", "2"],
    ):
        result = subprocess.run([*KVHANDOFF, *command], capture_output=True, text=True, check=False)
        assert result.returncode == 2, result.stderr


async def test_engines_exit_1_and_name_the_leak_when_stopped_holding_a_completed_handoff(
    nats_server: EmbeddedNats, subjects: Subjects, worker_side: WorkerSide
) -> None:
    engines = await asyncio.create_subprocess_exec(
        *KVHANDOFF,
        "engines",
        *bus_options(nats_server, subjects),
        *FAST_ENGINES,
        "--engine-types",
        "vllm",
        "--prompt-tokens",
        "100:100",
        stdout=asyncio.subprocess.PIPE,
    )
    h = uuid.uuid4()
    # The engines may not listen yet: send the action again until it is answered.
    while True:
        await worker_side.send(SOURCE, SubmitPrefill(h, 0))
        try:
            answer = await worker_side.next(h, wait_s=0.2)
            break
        except TimeoutError:
            continue
    assert isinstance(answer, ActionOutcome)
    while not isinstance(await worker_side.next(h), SourceHeld):
        pass  # repeated answers to the extra sends
    assert FAST.prompt_of(h) == 100
    await worker_side.complete(h)
    await worker_side.report_until(lambda report: bool(report.leaks))

    engines.send_signal(signal.SIGINT)
    out, _ = await asyncio.wait_for(engines.communicate(), 30)
    assert engines.returncode == 1
    assert str(h) in out.decode()


@pytest.mark.parametrize("command", [["engines", *FAST_ENGINES], ["load", "--handoffs", "1"]])
def test_credentials_that_nats_refuses_exit_2_at_once_naming_the_setting(
    tmp_path: Path, command: list[str]
) -> None:
    # Like the worker: a refusal is final, where nats-py alone would retry it for ever.
    config = "authorization { user: worker, password: secret }"
    with EmbeddedNats(tmp_path, config=config) as server:
        result = subprocess.run(
            [
                *KVHANDOFF,
                command[0],
                "--nats-url",
                server.url,
                "--nats-user",
                "worker",
                "--nats-password",
                "wrong",
                *command[1:],
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert result.returncode == 2, result.stderr
    assert f"NATS at {server.url} refused the connection" in result.stderr
    assert "check --nats-user/--nats-password" in result.stderr
