"""A real engine in minutes: `examples/engine.py`, written with the client alone, serves the one
engine id that `kvhandoff demo --external-engine` leaves to it, and handoffs through it complete.
Both run as real processes; the demo waits for the example before it starts the load."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import msgspec

from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.loadgen.generator import LoadReport
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.log.schema import HandoffState

ROOT = Path(__file__).resolve().parents[2]
EXTERNAL = "vllm-prefill-0"


async def test_the_example_engine_serves_the_id_the_demo_leaves_to_it(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    report_path, db = tmp_path / "report.json", tmp_path / "demo.db"
    demo = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvhandoff.worker.cli",
        "demo",
        "--quiet",
        "--nats-url",
        nats_server.url,
        "--external-engine",
        EXTERNAL,
        "--handoffs",
        "300",
        "--concurrency",
        "32",
        "--json",
        str(report_path),
        "--db",
        str(db),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        start_new_session=True,
    )
    assert demo.stdout is not None
    printed: list[str] = []
    async with asyncio.timeout(120):  # the demo starts the worker and the mock engines first
        while not any("waiting for engine" in line for line in printed):
            line = (await demo.stdout.readline()).decode()
            assert line, "the demo ended before it waited:\n" + "".join(printed)
            printed.append(line)
    command = printed[-1].split("run:", 1)[1].split()
    assert command == [
        "python",
        "examples/engine.py",
        "--nats-url",
        nats_server.url,
        "source",
        EXTERNAL,
    ]

    example = await asyncio.create_subprocess_exec(
        sys.executable,
        *command[1:],
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        rest, _ = await asyncio.wait_for(demo.communicate(), timeout=600)
        output = "".join(printed) + rest.decode(errors="replace")
        assert demo.returncode == 0, output
    finally:
        if example.returncode is None:
            example.send_signal(signal.SIGTERM)
        example_output, _ = await asyncio.wait_for(example.communicate(), timeout=60)
    assert example.returncode == 0, example_output.decode(errors="replace")

    report = msgspec.json.decode(report_path.read_bytes(), type=LoadReport)
    assert report.completed + report.canceled == report.handoffs == 300
    # The example answers report requests, so the summary counts its leaks too.
    assert report.unreported == []
    assert f"external engine {EXTERNAL}: reported, 0 leaks" in output
    with open_log(db) as log:
        through_the_example = [
            row for row in log.handoffs([HandoffState.SUCCEEDED]) if row.source == EXTERNAL
        ]
    assert through_the_example, "no handoff succeeded with the example engine as its source"
