"""The golden logs: every released schema version's files keep decoding and verifying with
this build, the tampered copy is caught at the steps it was tampered with, and the generator
still writes the same logs."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from events.records import SCHEMA_VERSION
from events.replay import check_stored, find_divergence
from tests.tools.conftest import GOLDEN, IDS
from tests.tools.golden.generate import generate
from worker.logreader import open_log

# Every golden log of every version, found on disk so that a new version cannot be forgotten.
LOGS = sorted(p for p in GOLDEN.glob("v*/*") if p.suffix in (".sqlite3", ".jsonl"))
CLEAN = [p for p in LOGS if p.stem != "tampered"]


def test_there_is_a_golden_directory_for_the_current_schema_version() -> None:
    assert (GOLDEN / f"v{SCHEMA_VERSION}" / "log.sqlite3").is_file()
    assert {p.parent.name for p in LOGS} >= {"v1"}


@pytest.mark.parametrize("path", CLEAN, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_golden_logs_decode_and_verify(path: Path) -> None:
    with open_log(path) as log:
        handoffs = log.handoffs()
        assert handoffs
        for row in handoffs:
            assert find_divergence(log.load(row.handoff_id).records()) is None
        scanned = list(log.scan())
    assert len(scanned) == len(handoffs)
    assert all(check_stored(rows, digests=log.keeps_digests).ok for rows in scanned)


def test_the_tampered_log_diverges_exactly_where_it_was_tampered() -> None:
    expected = {IDS["source-first-success"]: 6, IDS["frontend-cancel"]: 5}
    with open_log(GOLDEN / "v1" / "tampered.sqlite3") as log:
        stored = {d.handoff_id: d for rows in log.scan() if (d := check_stored(rows).divergence)}
        decoded = {
            h.handoff_id: d
            for h in log.handoffs()
            if (d := find_divergence(log.load(h.handoff_id).records()))
        }
    assert {str(h): d.step for h, d in stored.items()} == expected
    assert decoded == stored


def test_golden_files_are_read_in_place_without_a_trace() -> None:
    path = GOLDEN / "v1" / "log.sqlite3"
    before = path.read_bytes()
    with open_log(path) as log:
        log.load(log.resolve(IDS["frontend-cancel"]))
        list(log.scan())
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir() if "sqlite3-" in p.name) == []


def _rows(path: Path) -> dict[str, list[tuple[object, ...]]]:
    with sqlite3.connect(path) as db:
        return {
            table: db.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
            for table in ("meta", "handoffs", "events", "rejections")
        }


def test_the_generator_rewrites_the_current_golden_logs_row_for_row(tmp_path: Path) -> None:
    generate(tmp_path)
    current = GOLDEN / f"v{SCHEMA_VERSION}"
    for name in ("log.sqlite3", "tampered.sqlite3"):
        assert _rows(tmp_path / name) == _rows(current / name), name
    jsonl = "frontend-cancel.jsonl"
    assert (tmp_path / jsonl).read_bytes() == (current / jsonl).read_bytes()
    with open_log(tmp_path / "log.sqlite3") as log:
        assert all(check_stored(rows).ok for rows in log.scan())
