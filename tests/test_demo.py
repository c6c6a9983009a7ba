"""The README's first command, at full size: every handoff ends and no engine leaks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec

from kvhandoff.worker.loadgen import LoadReport


def test_the_demo_ends_every_handoff_without_leaks(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    db = tmp_path / "demo.db"
    # The demo keeps its logs in a fresh temporary folder; keep that inside tmp_path.
    environment = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "kvhandoff.worker.cli", "demo", "--quiet",
         "--json", str(report_path), "--db", str(db)],
        capture_output=True, text=True, timeout=600, check=False, env=environment,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr

    report = msgspec.json.decode(report_path.read_bytes(), type=LoadReport)
    assert report.handoffs == 3000
    assert report.completed + report.canceled == report.handoffs
    # Every handoff is left succeeded or canceled; the summary shows those final states too.
    assert report.final.succeeded + report.final.canceled == report.handoffs
    row = next(line for line in done.stdout.splitlines() if "final: canceled" in line)
    assert str(report.final.canceled) in row.split()
    assert report.canceled > 0  # the injected faults and frontend cancels did happen
    assert report.timed_out == 0
    assert report.rejected == 0
    assert report.leaks == 0
    assert report.engine_processes == 1
    # It points at its log with a command that works.
    replay = next(line for line in done.stdout.splitlines() if "kvhandoff replay" in line)
    command = replay.split(":", 1)[1].split()
    assert command[:3] == ["kvhandoff", "replay", str(db)]
    shown = subprocess.run(
        [sys.executable, "-m", "kvhandoff.worker.cli", *command[1:]],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "canceled" in shown.stdout
