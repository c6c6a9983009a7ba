"""The README's first command, at full size: every handoff ends and no engine leaks; and its
`--cluster` form, with a small load, through the failure it stages midway."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec

from kvhandoff.worker.commands._demo_cluster import ClusterReport
from kvhandoff.worker.loadgen.generator import LoadReport


def run_demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`kvhandoff demo ARGS` to its end; it keeps its logs in a fresh temporary folder, kept
    inside tmp_path. A failed run fails the test with what it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "kvhandoff.worker.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_the_demo_ends_every_handoff_without_leaks(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    db = tmp_path / "demo.db"
    done = run_demo(tmp_path, "--quiet", "--json", str(report_path), "--db", str(db))

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
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert "canceled" in shown.stdout


def test_the_cluster_demo_survives_a_killed_worker_and_node_with_every_handoff_ended(
    tmp_path: Path,
) -> None:
    """`kvhandoff demo --cluster`, with a small load: a worker and the input stream's leading
    node are killed midway; the summary shows the takeover, and every handoff ended."""
    report_path = tmp_path / "report.json"
    done = run_demo(
        tmp_path,
        "--cluster",
        "--quiet",
        "--handoffs",
        "200",
        "--concurrency",
        "32",
        "--json",
        str(report_path),
    )

    report = msgspec.json.decode(report_path.read_bytes(), type=ClusterReport)
    assert report.ok
    load = report.load
    assert load.handoffs == 200
    assert load.completed + load.canceled == load.handoffs
    assert load.timed_out == load.rejected == load.leaks == 0
    # The logs agree: every handoff is ended in some worker's file, and every file verifies.
    assert report.log_states.get("open", 0) == report.log_states.get("quarantined", 0) == 0
    assert sum(report.log_states.values()) == load.handoffs
    assert set(report.verify_bad) >= {"w2", "w3"} and not any(report.verify_bad.values())
    # The strike happened midway, on the input stream's leader, and the failover was seen:
    # every partition the killed worker owned was claimed by a survivor.
    assert report.strike is not None and report.strike.node_led_input_stream
    assert report.strike.next_leader not in (None, report.strike.node)
    killed = next(share for share in report.shares if share.killed)
    assert killed.worker == report.strike.worker and killed.before and not killed.after
    assert {t.partition for t in report.takeovers} == set(killed.before)
    assert not report.not_taken_over
    assert {t.by for t in report.takeovers} <= {"w2", "w3"}
    assert report.failover_s is not None and report.failover_s > 0
    assert f"within {report.failover_s:.1f} s of its SIGKILL" in done.stdout
    survivors = [share for share in report.shares if not share.killed]
    assert sorted(p for share in survivors for p in share.after) == list(range(16))


def test_the_demo_with_an_engine_killed_midway_still_ends_every_handoff(tmp_path: Path) -> None:
    """`kvhandoff demo --kill-engine`: the engine's lease expires, and the handoffs it held end
    through it rather than at their deadline."""
    report_path = tmp_path / "report.json"
    done = run_demo(
        tmp_path,
        "--quiet",
        "--handoffs",
        "600",
        "--kill-engine",
        "vllm-prefill-0",
        "--json",
        str(report_path),
    )

    report = msgspec.json.decode(report_path.read_bytes(), type=LoadReport)
    assert report.completed + report.canceled + report.rejected == report.handoffs
    assert (report.timed_out, report.leaks) == (0, 0)
    line = next(line for line in done.stdout.splitlines() if line.startswith("midway: SIGKILL"))
    ended_by_lease = int(line.split(" handoffs it held")[0].rsplit(" ", 1)[1])
    assert ended_by_lease > 0, line
