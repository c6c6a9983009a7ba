"""Fixtures for the offline log tools: the golden logs (checked in under `golden/v1/` and
`golden/v2/`, one directory per layout, read in place or copied when a test may write), the
golden handoffs written as a partitioned worker's data directory, and the `kvhandoff` CLI run
in-process."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import pytest

from kvhandoff.worker.cli import main
from kvhandoff.worker.tier.balance import partition_of
from tests.tools.golden.generate import SCENARIOS, TAMPERED, tamper, write_log

GOLDEN = Path(__file__).parent / "golden"
V1 = GOLDEN / "v1"
V2 = GOLDEN / "v2"

#: The golden handoffs by scenario (golden/generate.py), the same in every layout's files.
#: Spelled out, not recomputed: the files are frozen, whatever the generator becomes.
IDS = {
    "source-first-success": "c0619bee-b518-5110-b32c-809289541a87",
    "destination-first-success": "c94a9acc-7ce0-5c05-9198-93191b12d549",
    "frontend-cancel": "5aff7c74-b35e-5721-885f-db8a895bfa13",
    "failed-outcome": "e749763d-a52f-5726-bd3e-34c0620aff49",
    "deadline-timed-out": "de2e3d84-85fa-5e1c-b8ce-a98e9d5355ce",
    "reopened-after-success": "2fed417f-50ca-52df-9303-08354f81ec8b",
    "stuck-on-reserve": "033dc8c2-d1a1-52af-82f6-d4a1034aa614",
    "stuck-on-transfer": "20c58cb2-46ba-53bb-a2d1-32af376a2a33",
    "just-started": "2860a3b1-2002-58e3-bd76-aa9953b77549",
}


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str


Run = Callable[..., Result]


@pytest.fixture
def kvhandoff(capsys: pytest.CaptureFixture[str]) -> Run:
    """Run `kvhandoff ARGS...` in this process; stdout is captured, so it is not a terminal."""

    def run(*argv: object) -> Result:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture
def writable_log(tmp_path: Path) -> Path:
    """A copy of the golden layout-1 log that a test may change."""
    path = tmp_path / "log.sqlite3"
    shutil.copyfile(V1 / "log.sqlite3", path)
    return path


@pytest.fixture
def writable_log_v2(tmp_path: Path) -> Path:
    """A copy of the golden layout-2 log that a test may change."""
    path = tmp_path / "log.sqlite3"
    shutil.copyfile(V2 / "log.sqlite3", path)
    return path


@pytest.fixture(params=[V1, V2], ids=["v1", "v2"])
def writable_golden(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A copy of the golden log of each layout in turn, for what must hold for both."""
    path = tmp_path / "log.sqlite3"
    shutil.copyfile(request.param / "log.sqlite3", path)
    return path


#: The partition count of the golden data directory: every file holds two to four handoffs,
#: and the two tampered handoffs lie in two files, neither of them scanned first.
PARTITIONS = 3


@dataclass(frozen=True)
class GoldenDataDir:
    """The golden handoffs as a partitioned worker writes them, and as one worker does."""

    directory: Path  # partition-<p>.db, each handoff in the partition its id hashes to
    tampered: Path  # the same with `generate.TAMPERED` applied, each in its handoff's file
    whole: Path  # every handoff in one log, written the same way
    whole_tampered: Path

    @staticmethod
    def partition(name: str) -> int:
        """The partition of the golden handoff `name` (a scenario's)."""
        return partition_of(UUID(IDS[name]), PARTITIONS)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> GoldenDataDir:
    """The golden handoffs spread over `PARTITIONS` partition files by the input stream's own
    partition function, with their one-file twin; read-only (copy it to change it)."""
    root = tmp_path_factory.mktemp("data-dir")
    written = GoldenDataDir(
        root / "data", root / "tampered", root / "whole.db", root / "tampered.db"
    )
    written.directory.mkdir()
    for partition in range(PARTITIONS):
        mine = [s for s in SCENARIOS if GoldenDataDir.partition(s.name) == partition]
        assert mine, f"partition {partition} of the golden data directory is empty"
        write_log(
            written.directory / f"partition-{partition}.db",
            [(s.start_ms, s.script(s.handoff_id)) for s in mine],
        )
    shutil.copytree(written.directory, written.tampered)
    for partition in {GoldenDataDir.partition(t.scenario) for t in TAMPERED}:
        tampers = [t for t in TAMPERED if GoldenDataDir.partition(t.scenario) == partition]
        tamper(written.tampered / f"partition-{partition}.db", tampers)
    write_log(written.whole, [(s.start_ms, s.script(s.handoff_id)) for s in SCENARIOS])
    shutil.copyfile(written.whole, written.whole_tampered)
    tamper(written.whole_tampered, TAMPERED)
    return written
