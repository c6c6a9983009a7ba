"""One worker per event log, with real processes: a second `kvhandoff run` on a log in use exits
2 at once naming the first; a worker killed with SIGKILL leaves nothing that blocks its restart;
the offline tools and `compact` keep working beside a live worker."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid

from kvhandoff.events.messages import EngineType, StartHandoff
from kvhandoff.worker.harness.natsserver import free_port
from tests.worker.conftest import WorkerProcess
from tests.worker.scripted_engine import ScriptedEngines


def kvhandoff(*argv: object, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvhandoff.worker.cli", *map(str, argv)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def pid_of(worker: WorkerProcess) -> int:
    assert worker.process is not None
    return worker.process.pid


def test_a_second_worker_is_refused_until_the_first_dies(worker: WorkerProcess) -> None:
    # A NATS URL that nobody serves: a second worker that got as far as connecting would retry
    # until the timeout, so exiting at all shows it stopped before NATS.
    nowhere = f"nats://127.0.0.1:{free_port()}"
    began = time.monotonic()
    second = kvhandoff("run", "--nats-url", nowhere, "--db", worker.db, "--metrics-port", "0")
    took = time.monotonic() - began

    assert second.returncode == 2, second.stderr
    assert second.stdout == ""
    [line] = second.stderr.splitlines()
    assert line.startswith(f"kvhandoff run: event log {worker.db} is in use by another worker:")
    assert f" pid {pid_of(worker)} on host " in line
    assert took < 15, f"the second worker took {took:.1f}s to give up"
    assert worker.healthy()  # the first carries on

    # The OS releases a killed worker's lock: its successor starts, and holds the log in turn.
    first = pid_of(worker)
    worker.kill()
    worker.start()
    assert pid_of(worker) != first
    third = kvhandoff("run", "--nats-url", nowhere, "--db", worker.db, "--metrics-port", "0")
    assert third.returncode == 2
    assert f" pid {pid_of(worker)} on host " in third.stderr


async def test_the_offline_tools_and_compact_work_beside_a_live_worker(
    worker: WorkerProcess, engines: ScriptedEngines
) -> None:
    done = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    await engines.start_handoff(done)
    await engines.wait_complete({done.handoff_id})
    export = worker.db.parent / "export.jsonl"

    for argv in [
        ("list", worker.db),
        ("stuck", worker.db, "--older-than", "1s"),
        ("replay", worker.db, done.handoff_id),
        ("verify", worker.db),
        ("export", worker.db, done.handoff_id, "-o", export),
    ]:
        code, out, err = await run(*argv)
        assert code == 0, f"{argv[0]}: {err}"
    assert str(done.handoff_id) in export.read_text()

    # compact writes to the log the worker is writing, through SQLite's own locking.
    code, out, err = await run("compact", worker.db, "--older-than", "0")
    assert code == 0, err
    assert out.startswith("removed 1 handoff completed and 0 rejections logged before")

    # And the worker goes on writing after it.
    later = StartHandoff(uuid.uuid4(), EngineType.SGLANG, "prefill-0", "decode-0", 60_000)
    await engines.start_handoff(later)
    await engines.wait_complete({later.handoff_id})
    code, out, err = await run("list", worker.db)
    assert code == 0, err
    assert str(later.handoff_id) in out and str(done.handoff_id) not in out


async def run(*argv: object) -> tuple[int, str, str]:
    """`kvhandoff ARGS...` in a child process, without blocking the event loop."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvhandoff.worker.cli",
        *map(str, argv),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()
