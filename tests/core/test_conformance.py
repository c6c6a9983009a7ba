"""The reference conformance vectors, through the library and the CLI.

The vectors are a copy, kept in the repository so that any clone can run them, of the
reference implementation's published set; `conformance/README.md` beside them gives their
format and the semantics each expectation encodes.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvhandoff.events import conformance
from kvhandoff.worker.cli import main
from kvhandoff.worker.conformance import vectors as vector_files

VECTORS = Path(__file__).resolve().parent / "conformance" / "vectors.jsonl.gz"
CASES = 1500


@pytest.fixture(scope="module")
def vectors() -> Path:
    assert VECTORS.is_file(), f"conformance vectors not found at {VECTORS}"
    return VECTORS


def _last_line(text: str) -> str:
    return text.rstrip("\n").rsplit("\n", 1)[-1]


def test_every_vector_matches_the_reference(vectors: Path) -> None:
    report = vector_files.run([vectors])
    assert (report.passed, report.failed) == (CASES, 0), "\n".join(map(str, report.mismatches))
    assert report.mismatches == []
    assert report.summary() == f"{CASES} passed, 0 failed"


def test_cli_conformance_passes(vectors: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["conformance", str(vectors)])
    out = capsys.readouterr().out
    assert _last_line(out) == f"{CASES} passed, 0 failed"
    assert code == 0


def _tamper(case: dict[str, Any]) -> tuple[int, int] | None:
    """Change the id of the first expected action in `case`; the (step, new id), or None."""
    for step, expected in enumerate(case[conformance.EXPECTATION]):
        actions = expected["result"].get("ok") or []
        if actions:
            actions[0]["id"] += 1000
            return step, actions[0]["id"]
    return None


def test_cli_conformance_reports_a_tampered_vector(
    vectors: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tampered = tmp_path / "tampered.jsonl"
    target: tuple[str, int, int] | None = None
    with gzip.open(vectors, "rb") as src, tampered.open("wb") as dst:
        for line in src:
            case = msgspec.json.decode(line)
            if target is None and (hit := _tamper(case)) is not None:
                target = (case["case"], *hit)
            dst.write(msgspec.json.encode(case) + b"\n")
    assert target is not None
    case_id, step, bad_id = target

    code = main(["conformance", str(tampered)])
    out = capsys.readouterr().out

    assert code != 0
    assert _last_line(out) == f"{CASES - 1} passed, 1 failed"
    # The mismatch names the case and step and shows both sides, the tampered id included.
    assert f"case {case_id}, step {step}:" in out
    expected_line = next(line for line in out.splitlines() if line.strip().startswith("expected"))
    actual_line = next(line for line in out.splitlines() if line.strip().startswith("actual"))
    assert f"'id': {bad_id}" in expected_line
    assert f"#{bad_id - 1000}" in actual_line
    assert f"#{bad_id}" not in actual_line
