"""`worker.log.reader`: both forms of the log, and both layouts of the SQLite one, behind one
interface, read-only, with the JSONL export round-tripping exactly and every record passing the
codec's version check."""

from __future__ import annotations

import io
import sqlite3
from pathlib import Path
from uuid import UUID

import msgspec
import pytest

from kvhandoff.events.codec import decode_record, input_digest
from kvhandoff.events.errors import LogCorrupt
from kvhandoff.events.records import InputRecord
from kvhandoff.worker.commands.verify import verify_log
from kvhandoff.worker.errors import StoreCorrupt, StoreError
from kvhandoff.worker.log.reader import (
    ExportHeader,
    JsonlLog,
    SqliteLog,
    open_log,
    read_jsonl,
    write_jsonl,
)
from kvhandoff.worker.log.schema import HandoffState
from tests.tools.conftest import IDS, V1, V2

CANCEL = UUID(IDS["frontend-cancel"])


def test_open_log_tells_the_forms_apart_by_content(tmp_path: Path) -> None:
    renamed = tmp_path / "handoff.log"  # no telling extension
    renamed.write_bytes((V1 / "frontend-cancel.jsonl").read_bytes())
    with open_log(V1 / "log.sqlite3") as db, open_log(renamed) as export:
        assert isinstance(db, SqliteLog) and isinstance(export, JsonlLog)
        assert export.load(CANCEL) == db.load(CANCEL)
        (exported,) = export.scan()
        # The same records; an export keeps no digests.
        assert exported == [(seq, None, blob) for seq, _, blob in db.stored(CANCEL)]
        assert (export.keeps_digests, db.keeps_digests) == (False, True)
    with open_log(V2 / "log.sqlite3") as v2:
        assert isinstance(v2, SqliteLog) and not v2.keeps_digests
        assert (v2.form, db.form, export.form) == ("a layout-2 log", "a layout-1 log", "an export")


def test_scan_gives_each_handoffs_stored_records_in_id_order() -> None:
    with SqliteLog(V1 / "log.sqlite3") as log:
        scanned = list(log.scan())
        rows = sorted(log.handoffs(), key=lambda h: str(h.handoff_id))
        assert len(scanned) == len(rows)
        for row, stored in zip(rows, scanned, strict=True):
            loaded = log.load(row.handoff_id)
            assert stored == log.stored(row.handoff_id)
            assert [seq for seq, _, _ in stored] == list(range(row.last_seq + 1))
            assert [decode_record(blob) for _, _, blob in stored] == [
                e.record for e in loaded.events
            ]
            assert [digest for _, digest, _ in stored] == [
                input_digest(e.record.input) if isinstance(e.record, InputRecord) else None
                for e in loaded.events
            ]
        assert log.owners([(0, 2), (5, 3)]) == [
            [UUID(IDS["stuck-on-reserve"])] * 2,
            [UUID(IDS["stuck-on-transfer"])] * 3,
        ]


def test_layout_2_scans_each_handoffs_records_in_start_order() -> None:
    with SqliteLog(V2 / "log.sqlite3") as log:
        scanned = list(log.scan())
        rows = log.handoffs()  # start order, which is also the order of their keys
        assert len(scanned) == len(rows)
        for row, stored in zip(rows, scanned, strict=True):
            assert stored == log.stored(row.handoff_id)
            assert [seq for seq, _, _ in stored] == list(range(row.last_seq + 1))
            assert [decode_record(blob) for _, _, blob in stored] == [
                e.record for e in log.load(row.handoff_id).events
            ]
            assert {digest for _, digest, _ in stored} == {None}
        first, second = (len(rows) for rows in scanned[:2])
        assert log.owners([(0, 2), (first + 1, second - 1)]) == [
            [rows[0].handoff_id] * 2,
            [rows[1].handoff_id] * (second - 1),
        ]


@pytest.mark.parametrize(
    ("lost", "seqs", "error"),
    [
        # The first handoff in id order.
        ("stuck-on-reserve", (0,), "log begins at sequence 1, not 0"),
        # One whose events, from seq 1, follow those of the handoff before it in id order
        # (reopened-after-success, whose last seq is 18).
        ("frontend-cancel", (0,), "log begins at sequence 1, not 0"),
        # One whose events, from seq 2, run on from those of the handoff before it in id order
        # (just-started, whose last seq is 1) as if they were one log.
        ("reopened-after-success", (0, 1), "log begins at sequence 2, not 0"),
    ],
)
def test_a_handoff_that_lost_its_first_events_is_the_one_reported(
    writable_log: Path, lost: str, seqs: tuple[int, ...], error: str
) -> None:
    with sqlite3.connect(writable_log) as db:
        for seq in seqs:
            db.execute("DELETE FROM events WHERE handoff_id = ? AND seq = ?", (IDS[lost], seq))
    with SqliteLog(writable_log) as log:
        report = verify_log(log)
    (finding,) = report.findings
    assert (str(finding.handoff_id), finding.kind, finding.detail) == (IDS[lost], "sequence", error)
    assert (report.handoffs, report.events) == (9, 93 - len(seqs))


def test_an_export_round_trips_exactly() -> None:
    with open_log(V1 / "log.sqlite3") as log:
        for row in log.handoffs():
            original = log.load(row.handoff_id)
            out = io.BytesIO()
            write_jsonl(original, out)
            assert read_jsonl(iter(out.getvalue().splitlines())) == original


def test_the_export_header_names_format_version_and_handoff() -> None:
    first = (V1 / "frontend-cancel.jsonl").read_bytes().splitlines()[0]
    header = msgspec.json.decode(first)
    assert header["format"] == "kvhandoff-handoff-log"
    assert header["version"] == 1 and header["schema_version"] == 1
    assert header["handoff_id"] == IDS["frontend-cancel"]
    assert header["handoff"]["state"] == "canceled"
    assert msgspec.json.decode(first, type=ExportHeader).handoff.handoff_id == CANCEL


def test_handoffs_filter_by_state_in_start_order() -> None:
    with SqliteLog(V1 / "log.sqlite3") as log:
        everything = log.handoffs()
        open_ = log.handoffs([HandoffState.OPEN])
    assert [h.started_at_ms for h in everything] == sorted(h.started_at_ms for h in everything)
    assert {str(h.handoff_id) for h in open_} == {
        IDS["stuck-on-reserve"],
        IDS["stuck-on-transfer"],
        IDS["just-started"],
    }
    assert len(everything) == len(IDS)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (IDS["frontend-cancel"], IDS["frontend-cancel"]),
        (IDS["frontend-cancel"].upper(), IDS["frontend-cancel"]),
        ("5aff", IDS["frontend-cancel"]),
        ("c06", IDS["source-first-success"]),
    ],
)
def test_resolve_takes_an_id_or_a_unique_prefix(text: str, expected: str) -> None:
    with SqliteLog(V1 / "log.sqlite3") as log:
        assert str(log.resolve(text)) == expected


@pytest.mark.parametrize(("text", "error"), [("c", "ambiguous"), ("ffff", "no handoff")])
def test_resolve_refuses_an_ambiguous_or_unknown_id(text: str, error: str) -> None:
    with SqliteLog(V1 / "log.sqlite3") as log, pytest.raises(StoreError, match=error):
        log.resolve(text)


def test_the_sqlite_log_is_opened_read_only(writable_golden: Path) -> None:
    readonly = pytest.raises(sqlite3.OperationalError, match="readonly")
    with SqliteLog(writable_golden) as log, readonly:
        log._db.execute("DELETE FROM events")


def test_a_file_that_is_not_an_event_log_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.sqlite3"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    with pytest.raises(StoreError, match="not a kvhandoff event log"):
        open_log(other)
    with pytest.raises(StoreError, match="cannot read"):
        open_log(tmp_path / "missing.sqlite3")


def test_a_log_of_another_layout_is_refused(writable_golden: Path) -> None:
    with sqlite3.connect(writable_golden) as db:
        db.execute("UPDATE meta SET value = '3' WHERE key = 'layout'")
    with pytest.raises(StoreError, match="has layout 3, this build reads 1 and 2"):
        open_log(writable_golden)


def test_records_from_a_newer_schema_are_refused_in_either_form(
    writable_log: Path, tmp_path: Path
) -> None:
    # A record this build cannot upcast must stop the reader, not be misread.
    lines = (V1 / "frontend-cancel.jsonl").read_bytes().splitlines()
    lines[3] = lines[3].replace(b'"v":1}', b'"v":99}')
    export = tmp_path / "future.jsonl"
    export.write_bytes(b"\n".join(lines))
    with pytest.raises(LogCorrupt, match=r"seq 2: log record has schema version 99"):
        open_log(export)

    with sqlite3.connect(writable_log) as db:
        (blob,) = db.execute(
            "SELECT record FROM events WHERE handoff_id = ? AND seq = 2", (str(CANCEL),)
        ).fetchone()
        record = msgspec.msgpack.decode(blob)
        record["v"] = 99
        db.execute(
            "UPDATE events SET record = ? WHERE handoff_id = ? AND seq = 2",
            (msgspec.msgpack.encode(record), str(CANCEL)),
        )
    with open_log(writable_log) as log:
        with pytest.raises(LogCorrupt, match=f"handoff {CANCEL} seq 2: .*version 99"):
            log.load(CANCEL)
        (finding,) = verify_log(log).findings
    assert (finding.handoff_id, finding.kind, finding.seq) == (CANCEL, "corrupt_record", 2)
    assert "schema version 99" in finding.detail


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"", "empty export"),
        (b'{"format":"something-else","version":1}\n', "not a kvhandoff handoff export"),
        (b"not json\n", "not a kvhandoff handoff export"),
    ],
)
def test_a_file_that_is_not_an_export_is_refused(
    tmp_path: Path, content: bytes, error: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(StoreCorrupt, match=error):
        open_log(path)


def test_a_newer_export_format_is_refused(tmp_path: Path) -> None:
    lines = (V1 / "frontend-cancel.jsonl").read_bytes().splitlines()
    lines[0] = lines[0].replace(b'"version":1', b'"version":2')
    path = tmp_path / "newer.jsonl"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(StoreCorrupt, match="export format version 2, this build reads 1"):
        open_log(path)
