"""The golden logs: every released layout's files keep decoding and verifying with this build,
the tampered copies are caught at the steps they were tampered with, the logs of both layouts
hold the same handoffs and replay to the same timelines, and the generator still writes the
current layout's logs."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from kvhandoff.events.replay import StoredRecord, check_stored, find_divergence, timeline
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.log.schema import LAYOUT_VERSION
from tests.tools.conftest import GOLDEN, IDS, V1, V2
from tests.tools.golden.generate import generate

# Every golden log of every layout, found on disk so that a new layout cannot be forgotten.
LOGS = sorted(p for p in GOLDEN.glob("v*/*") if p.suffix in (".sqlite3", ".jsonl"))
CLEAN = [p for p in LOGS if p.stem != "tampered"]
LAYOUTS = [V1, V2]


def test_there_is_a_golden_directory_for_the_current_layout() -> None:
    assert (GOLDEN / f"v{LAYOUT_VERSION}" / "log.sqlite3").is_file()
    assert {p.parent for p in LOGS} == set(LAYOUTS)


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


@pytest.mark.parametrize("directory", LAYOUTS, ids=lambda p: p.name)
def test_the_tampered_log_diverges_exactly_where_it_was_tampered(directory: Path) -> None:
    expected = {IDS["source-first-success"]: 6, IDS["frontend-cancel"]: 5}
    with open_log(directory / "tampered.sqlite3") as log:
        stored = {d.handoff_id: d for rows in log.scan() if (d := check_stored(rows).divergence)}
        decoded = {
            h.handoff_id: d
            for h in log.handoffs()
            if (d := find_divergence(log.load(h.handoff_id).records()))
        }
    assert {str(h): d.step for h, d in stored.items()} == expected
    assert decoded == stored


@pytest.mark.parametrize("name", ["log.sqlite3", "tampered.sqlite3", "frontend-cancel.jsonl"])
def test_both_layouts_hold_the_same_handoffs_and_replay_them_alike(name: str) -> None:
    with open_log(V1 / name) as v1, open_log(V2 / name) as v2:
        assert v2.handoffs() == v1.handoffs()
        for row in v1.handoffs():
            old, new = v1.load(row.handoff_id), v2.load(row.handoff_id)
            assert new.records() == old.records()
            assert timeline(new.records()) == timeline(old.records())
            # Layout 2 keeps one outbox mark per handoff, not a time per action.
            assert [e.published_at_ms is None for e in new.events] == [
                e.published_at_ms is None for e in old.events
            ]
            # Every record put back together is the very bytes layout 1 stored.
            assert _blobs(v2.stored(row.handoff_id)) == _blobs(v1.stored(row.handoff_id))
        # One run per handoff, in either layout's order.
        assert sorted(map(_blobs, v2.scan())) == sorted(map(_blobs, v1.scan()))


def _blobs(rows: list[StoredRecord]) -> list[tuple[int, bytes]]:
    return [(seq, blob) for seq, _, blob in rows]


@pytest.mark.parametrize("directory", LAYOUTS, ids=lambda p: p.name)
def test_golden_files_are_read_in_place_without_a_trace(directory: Path) -> None:
    path = directory / "log.sqlite3"
    before = path.read_bytes()
    with open_log(path) as log:
        log.load(log.resolve(IDS["frontend-cancel"]))
        list(log.scan())
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir() if "sqlite3-" in p.name) == []


def _rows(path: Path) -> dict[str, list[tuple[object, ...]]]:
    with closing(sqlite3.connect(path)) as db:
        tables = [
            name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        ]
        return {
            table: db.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall() for table in tables
        }


# Tables added to layout 2 after its goldens were frozen, without a new version: a file of
# this build has them, empty until a snapshot fills them (worker.log.schema.TOMBSTONES).
ADDED_TO_LAYOUT_2 = {"tombstones"}


def test_the_generator_rewrites_the_current_golden_logs_row_for_row(tmp_path: Path) -> None:
    generate(tmp_path)
    current = GOLDEN / f"v{LAYOUT_VERSION}"
    for name in ("log.sqlite3", "tampered.sqlite3"):
        written, golden = _rows(tmp_path / name), _rows(current / name)
        added = {table: written.pop(table) for table in set(written) - set(golden)}
        assert added == {table: [] for table in ADDED_TO_LAYOUT_2}, name
        assert written == golden, name
    jsonl = "frontend-cancel.jsonl"
    assert (tmp_path / jsonl).read_bytes() == (current / jsonl).read_bytes()
    with open_log(tmp_path / "log.sqlite3") as log:
        assert all(check_stored(rows, digests=False).ok for rows in log.scan())
