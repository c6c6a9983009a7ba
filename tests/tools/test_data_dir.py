"""The offline commands over a partitioned worker's data directory (`worker.log.reader.DataDir`):
the golden handoffs spread over three partition files read as the one log that holds them all.

Each command's JSON over the directory is compared with its JSON over the one-file twin
(`conftest.data_dir`), written from the same scripts by the same writer; the counts and ids that
matter are also checked outright, so that a twin read wrongly in the same way would not pass.
"""

from __future__ import annotations

import shutil
import sqlite3
from contextlib import closing
from pathlib import Path
from uuid import UUID

import pytest

from kvhandoff.worker.log.reader import DataDir, SqliteLog, open_log
from kvhandoff.worker.log.reports import ListReport, StuckReport, VerifyReport
from kvhandoff.worker.log.schema import HandoffState
from tests.tools.conftest import IDS, PARTITIONS, V2, GoldenDataDir, Run
from tests.tools.golden.generate import write_log
from tests.tools.test_commands import report

NOW = "2025-01-01T01:00:00Z"
_partition = GoldenDataDir.partition


def _in_partition(partition: int) -> set[str]:
    return {h for name, h in IDS.items() if _partition(name) == partition}


def test_the_golden_handoffs_are_spread_over_every_partition_file(data_dir: GoldenDataDir) -> None:
    files = sorted(p.name for p in data_dir.directory.iterdir())
    assert files == [f"partition-{p}.db" for p in range(PARTITIONS)]
    for partition in range(PARTITIONS):
        with SqliteLog(data_dir.directory / f"partition-{partition}.db") as log:
            assert {str(row.handoff_id) for row in log.handoffs()} == _in_partition(partition)


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--state", "open", "--state", "canceled"],
        ["--sort", "events", "--reverse", "--limit", "4"],
        ["--sort", "completed", "--limit", "5"],
        ["--engine-type", "vllm", "--since", "2025-01-01T00:04:00Z"],
    ],
)
def test_list_merges_every_partition_before_sorting_and_the_limit(
    kvhandoff: Run, data_dir: GoldenDataDir, options: list[str]
) -> None:
    over_dir = kvhandoff("list", data_dir.directory, "--now", NOW, "--json", *options)
    over_file = kvhandoff("list", data_dir.whole, "--now", NOW, "--json", *options)
    assert over_dir.code == over_file.code == 0
    assert over_dir.out == over_file.out
    assert over_dir.err == over_file.err == ""


def test_list_of_a_directory_shows_every_handoff_in_start_order(
    kvhandoff: Run, data_dir: GoldenDataDir
) -> None:
    listed = report(ListReport, kvhandoff("list", data_dir.directory, "--json").out)
    assert [str(h.handoff.handoff_id) for h in listed.handoffs] == list(IDS.values())
    # The sort runs over all files: the four with fewest events come from every partition.
    top = report(
        ListReport,
        kvhandoff("list", data_dir.directory, "--json", "--sort", "events", "--limit", "4").out,
    )
    assert [h.events for h in top.handoffs] == [2, 5, 6, 9]
    assert {_partition(_name(h.handoff.handoff_id)) for h in top.handoffs} == {0, 1, 2}


def test_stuck_looks_at_the_open_handoffs_of_every_partition(
    kvhandoff: Run, data_dir: GoldenDataDir
) -> None:
    over_dir = kvhandoff("stuck", data_dir.directory, "--now", NOW, "--json", "--older-than", "50m")
    over_file = kvhandoff("stuck", data_dir.whole, "--now", NOW, "--json", "--older-than", "50m")
    assert over_dir.code == over_file.code == 0 and over_dir.out == over_file.out
    stuck = report(StuckReport, over_dir.out)
    assert stuck.open == 3
    assert [str(h.handoff.handoff_id) for h in stuck.handoffs] == [
        IDS["stuck-on-reserve"],
        IDS["stuck-on-transfer"],
    ]
    assert {_partition(n) for n in ("stuck-on-reserve", "stuck-on-transfer")} == {1, 2}


@pytest.mark.parametrize("name", sorted(IDS))
def test_replay_finds_a_handoff_in_whichever_file_holds_it(
    kvhandoff: Run, data_dir: GoldenDataDir, name: str
) -> None:
    prefix = IDS[name][:8]
    over_dir = kvhandoff("replay", data_dir.directory, prefix, "--format", "json")
    over_file = kvhandoff("replay", data_dir.whole, prefix, "--format", "json")
    assert over_dir.code == over_file.code == 0 and over_dir.out == over_file.out
    assert f'"handoff_id":"{IDS[name]}"' in over_dir.out.replace(" ", "")


def test_a_prefix_that_two_files_match_is_ambiguous(
    kvhandoff: Run, data_dir: GoldenDataDir
) -> None:
    # A prefix of two handoffs in two files, and of no two in one file: only the merge sees it.
    prefix = next(
        a[:length]
        for length in range(1, 8)
        for a in IDS.values()
        for b in IDS.values()
        if a < b
        and a[:length] == b[:length]
        and len({_partition_of(h) for h in IDS.values() if h.startswith(a[:length])})
        == sum(h.startswith(a[:length]) for h in IDS.values())
    )
    for command in ("replay", "export", "verify"):
        result = kvhandoff(command, data_dir.directory, prefix)
        assert (result.code, result.out) == (2, "")
        assert result.err == (
            f"kvhandoff {command}: handoff id prefix {prefix!r} is ambiguous in"
            f" {data_dir.directory}\n"
        )
    missing = kvhandoff("replay", data_dir.directory, "ffff")
    assert missing.code == 2
    assert missing.err == f"kvhandoff replay: no handoff 'ffff' in {data_dir.directory}\n"
    # A whole id is never ambiguous, in whichever file it is.
    assert kvhandoff("replay", data_dir.directory, IDS["just-started"]).code == 0


def test_verify_checks_every_partition_file(kvhandoff: Run, data_dir: GoldenDataDir) -> None:
    clean = kvhandoff("verify", data_dir.directory)
    assert (clean.code, clean.out) == (
        0,
        "verified 9 handoffs, 93 events (no input digests in a data directory of 3 layout-2"
        " logs): all match\n",
    )


def test_verify_names_each_bad_handoff_in_whichever_file_it_is(
    kvhandoff: Run, data_dir: GoldenDataDir
) -> None:
    over_dir = kvhandoff("verify", data_dir.tampered, "--json")
    over_file = kvhandoff("verify", data_dir.whole_tampered, "--json")
    assert over_dir.code == over_file.code == 1 and over_dir.out == over_file.out
    verified = report(VerifyReport, over_dir.out)
    assert (verified.handoffs, verified.events) == (9, 93)
    assert [(str(f.handoff_id), f.kind.value, f.seq) for f in verified.findings] == [
        (IDS["frontend-cancel"], "divergence", 5),
        (IDS["source-first-success"], "divergence", 6),
    ]
    # The two bad handoffs are in two files, one of them not the first scanned (whose positions in
    # the scan are not its own file's).
    assert {_partition("frontend-cancel"), _partition("source-first-success")} == {0, 1}
    named = kvhandoff("verify", data_dir.tampered, "c061", IDS["stuck-on-reserve"], "--json")
    assert named.code == 1
    assert [str(d.handoff_id) for d in report(VerifyReport, named.out).diverged] == [
        IDS["source-first-success"]
    ]


def test_verify_reports_a_record_that_does_not_decode_under_its_own_handoff(
    kvhandoff: Run, data_dir: GoldenDataDir, tmp_path: Path
) -> None:
    directory = tmp_path / "data"
    shutil.copytree(data_dir.directory, directory)
    damaged = IDS["stuck-on-transfer"]
    partition = _partition("stuck-on-transfer")
    with closing(sqlite3.connect(directory / f"partition-{partition}.db")) as db, db:
        changed = db.execute(
            "UPDATE events SET type = 250 WHERE seq = 3 AND handoff_key ="
            " (SELECT handoff_key FROM handoffs WHERE handoff_id = ?)",
            (damaged,),
        ).rowcount
    assert changed == 1 and partition != 0
    result = kvhandoff("verify", directory, "--json")
    assert result.code == 1
    verified = report(VerifyReport, result.out)
    assert [(str(f.handoff_id), f.kind.value, f.seq) for f in verified.findings] == [
        (damaged, "corrupt_record", 3)
    ]


def test_export_takes_the_handoff_from_its_file(
    kvhandoff: Run, data_dir: GoldenDataDir, tmp_path: Path
) -> None:
    to_stdout = kvhandoff("export", data_dir.directory, "5aff")
    assert to_stdout.code == 0
    assert to_stdout.out == (V2 / "frontend-cancel.jsonl").read_text()
    path = tmp_path / "bug.jsonl"
    assert kvhandoff("export", data_dir.directory, IDS["stuck-on-transfer"], "-o", path).code == 0
    assert path.read_text() == kvhandoff("export", data_dir.whole, "20c5").out


def test_export_writes_over_no_partition_file_nor_adds_one(
    kvhandoff: Run, data_dir: GoldenDataDir, tmp_path: Path
) -> None:
    directory = tmp_path / "data"
    shutil.copytree(data_dir.directory, directory)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    (tmp_path / "link.db").symlink_to(directory / "partition-2.db")
    for output, clash in [
        (directory / "partition-1.db", "the log's partition-1.db"),
        (tmp_path / "link.db", "the log's partition-2.db"),
        (directory / "partition-0.db-wal", "the log's partition-0.db-wal"),
        (directory / "partition-7.db", "a partition log's name in the data directory it reads"),
    ]:
        result = kvhandoff("export", directory, "5aff", "-o", output, "--force")
        assert result.code == 2
        assert result.err == (
            f"kvhandoff export: {output} is {clash}: refusing to write over the log\n"
        )
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    # Any other name in the directory is the operator's to choose.
    assert kvhandoff("export", directory, "5aff", "-o", directory / "bug.jsonl").code == 0


@pytest.mark.parametrize("command", ["list", "stuck", "replay", "verify", "export"])
def test_a_directory_without_partition_files_is_one_line_and_status_2(
    kvhandoff: Run, tmp_path: Path, command: str
) -> None:
    # Files that only look like partitions are not read: a -wal, a padded number, an export.
    for name in ("partition-0.db-wal", "partition-01.db", "partition-x.db", "log.sqlite3"):
        (tmp_path / name).write_bytes(b"")
    shutil.copyfile(V2 / "frontend-cancel.jsonl", tmp_path / "partition-0.jsonl")
    args = [command, tmp_path] + (["5aff"] if command in ("replay", "export") else [])
    result = kvhandoff(*args)
    assert (result.code, result.out) == (2, "")
    assert result.err == (
        f"kvhandoff {command}: {tmp_path} is a directory with no partition logs"
        " (partition-<p>.db) in it\n"
    )


def test_a_partition_file_that_is_no_log_is_one_line_and_status_2(
    kvhandoff: Run, data_dir: GoldenDataDir, tmp_path: Path
) -> None:
    directory = tmp_path / "data"
    shutil.copytree(data_dir.directory, directory)
    (directory / "partition-5.db").write_bytes(b"not sqlite at all, but long enough to look")
    result = kvhandoff("list", directory)
    assert result.code == 2 and len(result.err.splitlines()) == 1
    assert result.err.startswith(f"kvhandoff list: {directory / 'partition-5.db'}")


def test_a_missing_partition_leaves_the_others_readable(
    kvhandoff: Run, data_dir: GoldenDataDir, tmp_path: Path
) -> None:
    # A worker writes only the partitions it owns: numbers may be missing.
    directory = tmp_path / "data"
    shutil.copytree(data_dir.directory, directory)
    (directory / "partition-1.db").unlink()
    (directory / "partition-2.db").rename(directory / "partition-12.db")
    listed = report(ListReport, kvhandoff("list", directory, "--json").out)
    assert {str(h.handoff.handoff_id) for h in listed.handoffs} == _in_partition(0) | _in_partition(
        2
    )
    assert kvhandoff("replay", directory, IDS["source-first-success"]).code == 2


def test_the_directory_reader_is_one_log_source(data_dir: GoldenDataDir) -> None:
    with open_log(data_dir.directory) as log, SqliteLog(data_dir.whole) as whole:
        assert isinstance(log, DataDir)
        assert (log.form, log.keeps_digests) == ("a data directory of 3 layout-2 logs", False)
        assert sorted(log.partitions) == list(range(PARTITIONS))
        assert log.handoffs() == whole.handoffs()
        assert log.handoffs([HandoffState.OPEN, None]) == whole.handoffs([HandoffState.OPEN, None])
        for handoff_id in map(UUID, IDS.values()):
            assert log.load(handoff_id) == whole.load(handoff_id)
            assert log.stored(handoff_id) == whole.stored(handoff_id)
        runs = list(log.scan())
        # File after file, each in its own id order; every row's owner found in its own file.
        assert sorted(map(tuple, runs)) == sorted(map(tuple, whole.scan()))
        spans, position = [], 0
        for rows in runs:
            spans.append((position, len(rows)))
            position += len(rows)
        owners = log.owners(spans)
        assert [{str(h) for h in ids} for ids in owners] == [
            {str(_run_owner(whole, rows))} for rows in runs
        ]


def _run_owner(log: SqliteLog, rows: list[tuple[int, bytes | None, bytes]]) -> UUID:
    return next(UUID(h) for h in IDS.values() if log.stored(UUID(h)) == rows)


def _partition_of(handoff_id: str) -> int:
    return _partition(_name(UUID(handoff_id)))


def _name(handoff_id: UUID) -> str:
    return next(name for name, h in IDS.items() if h == str(handoff_id))


def test_verify_finds_the_owners_past_an_empty_partition_file(
    kvhandoff: Run, data_dir: GoldenDataDir, tmp_path: Path
) -> None:
    # A worker that owns a partition with no handoff yet leaves an empty log; scanned first, it
    # shifts nothing: the bad runs of the files after it are still put to their own files.
    directory = tmp_path / "data"
    shutil.copytree(data_dir.tampered, directory)
    (directory / "partition-0.db").rename(directory / "partition-5.db")
    write_log(directory / "partition-0.db", [])
    over_dir = kvhandoff("verify", directory, "--json")
    over_file = kvhandoff("verify", data_dir.whole_tampered, "--json")
    assert over_dir.code == over_file.code == 1 and over_dir.out == over_file.out
    assert len(report(VerifyReport, over_dir.out).findings) == 2
