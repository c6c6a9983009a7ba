"""`worker.harness.child`, the one wrapper of child processes that the demo, the tests and the
benches share: what it says when a child fails to come up, and how it stops one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvhandoff.worker.errors import ChildError
from kvhandoff.worker.harness.child import Child, metric_sum


class NeverReady(Child):
    def ready(self) -> bool:
        return False


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_child_that_exits_before_it_is_ready_is_a_child_error_quoting_its_output(
    tmp_path: Path,
) -> None:
    child = NeverReady(python("print('no config here'); raise SystemExit(3)"), tmp_path / "c.log")
    with pytest.raises(ChildError, match=r"(?s)c exited 3: no config here"):
        child.start()


def test_a_child_not_ready_in_time_is_a_child_error_and_is_stopped_on_exit(
    tmp_path: Path,
) -> None:
    with NeverReady(python("import time; time.sleep(600)"), tmp_path / "slow.log") as child:
        with pytest.raises(ChildError, match=r"slow not ready in 0\.2s"):
            child.start(timeout_s=0.2)
        assert child.running()
    assert not child.running()
    # SIGTERM ended it (the polite stop), not SIGKILL.
    assert child.terminate() == -15


def test_a_restart_appends_to_the_same_output(tmp_path: Path) -> None:
    child = Child(python("print('ran')"), tmp_path / "twice.log")
    for _ in range(2):
        child.start()
        assert child.process is not None and child.process.wait(timeout=60) == 0
    assert child.logs().split() == ["ran", "ran"]


def test_kill_is_sigkill(tmp_path: Path) -> None:
    child = Child(python("import time; time.sleep(600)"), tmp_path / "victim.log")
    child.start()
    child.kill()
    assert child.terminate() == -9
    child.stop()  # nothing left to stop


def test_metric_sum_adds_every_label_set_of_one_family_only() -> None:
    text = "\n".join(
        [
            "# HELP kvhandoff_inputs_total inputs",
            'kvhandoff_inputs_total{kind="start"} 3.0',
            'kvhandoff_inputs_total{kind="fact"} 4.0',
            "kvhandoff_inputs_total_created 1.7e9",
            "kvhandoff_open_handoffs 2.0",
        ]
    )
    assert metric_sum(text, "kvhandoff_inputs_total") == 7.0
    assert metric_sum(text, "kvhandoff_open_handoffs") == 2.0
