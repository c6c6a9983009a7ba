"""What the offline tools write, and where: text that a log cannot use to drive the terminal, a
reader that stops reading (`| head`) without a traceback or a failing status, and `export -o`
that neither overwrites a file unasked nor, ever, the log it reads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from uuid import UUID

import msgspec
import pytest
from rich.console import Console

from kvhandoff.events.messages import ActionFailed, ActionOutcome, SourceHeld, StartHandoff
from kvhandoff.events.records import ActionRecord, InputRecord, LogRecord
from kvhandoff.worker.commands import _text, export
from kvhandoff.worker.log.reader import SqliteLog
from kvhandoff.worker.log.reports import ListReport
from tests.tools import logedit
from tests.tools.conftest import IDS, V1, Run
from tests.tools.test_commands import EXPORT, LOG, report

# C0 but the newline that ends each line, DEL, C1.
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")
#: Set the window title, clear the screen, a CSI in its C1 form, NUL, DEL: no whitespace, so
#: that an engine id may hold it (ids may not hold whitespace); then a tab for free text.
HOSTILE_ID = "x\x1b]0;pwned\x07\x1b[2J\x9b31m\x00\x7fy"
ESCAPED_ID = r"x\x1b]0;pwned\x07\x1b[2J\x9b31m\x00\x7fy"
HOSTILE = f"{HOSTILE_ID}\tz"
ESCAPED = rf"{ESCAPED_ID}\x09z"
NOW = "2025-01-01T00:15:20Z"


def assert_printable(text: str) -> None:
    assert not CONTROL.search(text), CONTROL.findall(text)


# --- control characters -----------------------------------------------------------------------


def hostile_engines(record: LogRecord) -> LogRecord:
    assert isinstance(record, InputRecord) and isinstance(record.input, StartHandoff)
    start = msgspec.structs.replace(
        record.input, source=f"src{HOSTILE_ID}", destination=f"dst{HOSTILE_ID}"
    )
    return msgspec.structs.replace(record, input=start)


def hostile_reason(record: LogRecord) -> LogRecord:
    assert isinstance(record, InputRecord) and isinstance(record.input, ActionOutcome)
    outcome = ActionFailed(f"reason{HOSTILE}")
    return msgspec.structs.replace(
        record, input=msgspec.structs.replace(record.input, outcome=outcome)
    )


def renumbered(record: LogRecord) -> LogRecord:
    assert isinstance(record, ActionRecord)
    return msgspec.structs.replace(
        record, action=msgspec.structs.replace(record.action, action_id=9)
    )


@pytest.fixture
def hostile(writable_golden: Path) -> Path:
    """Control characters in every kind of string a log holds: engine ids in a start record
    and in the row, a failed outcome's reason, a state, a quarantine reason."""
    reserve, failed = IDS["stuck-on-reserve"], IDS["failed-outcome"]
    logedit.rewrite(writable_golden, reserve, 0, hostile_engines)
    logedit.execute(
        writable_golden,
        "UPDATE handoffs SET source = ?, destination = ?, engine_type = ? WHERE handoff_id = ?",
        f"src{HOSTILE}",
        f"dst{HOSTILE}",
        f"vllm{HOSTILE}",
        reserve,
    )
    logedit.rewrite(writable_golden, failed, 2, hostile_reason)
    logedit.rewrite(writable_golden, failed, 3, renumbered)  # so that verify prints the input
    logedit.set_state(writable_golden, IDS["just-started"], f"odd{HOSTILE}")
    logedit.quarantine(writable_golden, IDS["stuck-on-transfer"], 1, f"quarantined: {HOSTILE}")
    return writable_golden


def test_list_escapes_control_characters_from_the_log(kvhandoff: Run, hostile: Path) -> None:
    result = kvhandoff("list", hostile)
    assert result.code == 0
    assert_printable(result.out)
    assert_printable(result.err)
    row = next(line for line in result.out.splitlines() if line.startswith(IDS["stuck-on-reserve"]))
    assert f"vllm{ESCAPED}" in row and f"src{ESCAPED}" in row and f"dst{ESCAPED}" in row
    assert f"odd{ESCAPED}(unknown)" in result.out
    # JSON is data: the strings come back exactly as logged.
    listed = report(ListReport, kvhandoff("list", hostile, "--json").out).handoffs
    assert {h.handoff.source for h in listed} >= {f"src{HOSTILE}"}


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["stuck", "--now", NOW], [f"quarantined: {ESCAPED}", f"destination dst{ESCAPED_ID}"]),
        (["replay", IDS["stuck-on-reserve"]], [f"src{ESCAPED_ID} -> dst{ESCAPED_ID}"]),
        (
            ["replay", "033d", "--format", "mermaid"],
            [f"participant S as source src{ESCAPED_ID.replace(';', ',')}"],
        ),
        (["replay", IDS["failed-outcome"]], [f"failed reason=reason{ESCAPED}"]),
        (["replay", IDS["failed-outcome"], "--at", "2"], [f"reason=reason{ESCAPED}"]),
        (["replay", IDS["just-started"]], [f"odd{ESCAPED}(unknown)"]),
        (["verify"], [f"failed reason=reason{ESCAPED}"]),
    ],
    ids=["stuck", "replay", "mermaid", "outcome", "at", "state", "verify"],
)
def test_text_outputs_escape_control_characters_from_the_log(
    kvhandoff: Run, hostile: Path, args: list[str], shown: list[str]
) -> None:
    result = kvhandoff(args[0], hostile, *args[1:])
    assert result.code in (0, 1)
    assert_printable(result.out)
    assert_printable(result.err)
    for text in shown:
        assert text in result.out


def test_the_replay_table_on_a_terminal_escapes_them_too(
    kvhandoff: Run, hostile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        _text,
        "console",
        lambda: Console(file=sys.stdout, force_terminal=True, color_system=None, width=400),
    )
    for args in (["replay", IDS["failed-outcome"]], ["list"], ["stuck", "--now", NOW]):
        out = kvhandoff(args[0], hostile, *args[1:]).out
        assert_printable(out)


def test_error_messages_escape_control_characters(kvhandoff: Run, tmp_path: Path) -> None:
    # An argument cannot hold NUL (argv strings end at one); everything else it can.
    result = kvhandoff("list", tmp_path / f"missing{HOSTILE.replace(chr(0), '')}.sqlite3")
    assert result.code == 2
    assert_printable(result.err)
    assert ESCAPED.replace(r"\x00", "") in result.err


def test_json_keeps_the_strings_exactly(kvhandoff: Run, hostile: Path) -> None:
    # Read untyped: today's wire bounds refuse such an id, but history is shown as written.
    replay = json.loads(kvhandoff("replay", hostile, "033d", "--format", "json").out)
    assert replay["timeline"]["start"]["source"] == f"src{HOSTILE_ID}"


# --- a reader that stops reading ----------------------------------------------------------------

COPIES = 3000  # enough that every output below is far larger than a pipe's buffer


@pytest.fixture(scope="module")
def big_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden log with 3000 copies of just-started, each with its action renumbered (so that
    `verify` finds each diverges), and one handoff with 3000 more steps."""
    path = tmp_path_factory.mktemp("big") / "log.sqlite3"
    path.write_bytes((V1 / "log.sqlite3").read_bytes())
    logedit.copy_handoff(
        path,
        IDS["just-started"],
        COPIES,
        lambda r: renumbered(r) if isinstance(r, ActionRecord) else r,
    )
    # stuck-on-reserve's SourceHeld (seq 3) again and again, each time with another bandwidth:
    # a repeated fact, accepted, that issues nothing.
    reserve = IDS["stuck-on-reserve"]
    with SqliteLog(path) as log:
        held = log.load(UUID(reserve)).events[3].record
    assert isinstance(held, InputRecord) and isinstance(held.input, SourceHeld)
    timing = held.input.timing
    again = [
        msgspec.structs.replace(
            held,
            input=msgspec.structs.replace(
                held.input, timing=msgspec.structs.replace(timing, bandwidth_gb_s=1000.0 + i)
            ),
        )
        for i in range(COPIES)
    ]
    logedit.append_inputs(path, reserve, again)
    return path


@pytest.mark.parametrize(
    ("args", "status"),
    [
        (["list", "{log}"], 0),
        (["stuck", "{log}"], 0),
        (["replay", "{log}", IDS["stuck-on-reserve"]], 0),
        (["export", "{log}", IDS["stuck-on-reserve"]], 0),
        (["verify", "{log}"], 1),  # the status still says what verify found
        (["verify", "{log}", "--json"], 1),
        (["list", "{log}", "--json"], 0),
    ],
    ids=["list", "stuck", "replay", "export", "verify", "verify json", "list json"],
)
def test_a_reader_that_stops_reading_is_not_a_failure(
    big_log: Path, args: list[str], status: int
) -> None:
    argv = [sys.executable, "-m", "kvhandoff.worker.cli", *(a.format(log=big_log) for a in args)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline()  # `| head -1`
        proc.stdout.close()
        err = proc.stderr.read()
        code = proc.wait(timeout=120)
    assert (code, err.decode()) == (status, "")


def test_schema_stops_quietly_too() -> None:
    argv = [sys.executable, "-m", "kvhandoff.worker.cli", "schema", "--indent", "100"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read()
        code = proc.wait(timeout=120)
    assert (code, err.decode()) == (0, "")


# --- export -o ------------------------------------------------------------------------------------


def test_export_will_not_overwrite_a_file_unless_forced(kvhandoff: Run, tmp_path: Path) -> None:
    target = tmp_path / "bug.jsonl"
    target.write_text("notes I wanted to keep\n")
    refused = kvhandoff("export", LOG, "5aff", "-o", target)
    assert refused.code == 2 and refused.out == ""
    assert refused.err == f"kvhandoff export: {target} exists (--force replaces it)\n"
    assert target.read_text() == "notes I wanted to keep\n"

    forced = kvhandoff("export", LOG, "5aff", "-o", target, "--force")
    assert forced.code == 0 and target.read_bytes() == EXPORT.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bug.jsonl"]  # no temporary left


def test_export_replaces_a_symlink_rather_than_writing_through_it(
    kvhandoff: Run, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not mine to change\n")
    link, dangling = tmp_path / "link.jsonl", tmp_path / "dangling.jsonl"
    link.symlink_to(elsewhere)
    dangling.symlink_to(tmp_path / "nowhere")
    for path in (link, dangling):
        assert kvhandoff("export", LOG, "5aff", "-o", path).code == 2
        assert kvhandoff("export", LOG, "5aff", "-o", path, "--force").code == 0
        assert not path.is_symlink() and path.read_bytes() == EXPORT.read_bytes()
    assert elsewhere.read_text() == "not mine to change\n"
    assert not (tmp_path / "nowhere").exists()


def _log_with_siblings(tmp_path: Path) -> Path:
    log = tmp_path / "db" / "log.sqlite3"
    log.parent.mkdir()
    log.write_bytes(LOG.read_bytes())
    for suffix in ("-wal", "-shm", "-journal"):
        Path(f"{log}{suffix}").write_bytes(b"")
    return log


@pytest.mark.parametrize(
    "spell",
    [
        lambda log, tmp: log,
        lambda log, tmp: log.parent / ".." / "db" / log.name,
        lambda log, tmp: Path(f"{log}-wal"),
        lambda log, tmp: Path(f"{log}-shm"),
        lambda log, tmp: Path(f"{log}-journal"),
        lambda log, tmp: _linked(tmp / "link.jsonl", log, symbolic=True),
        lambda log, tmp: _linked(tmp / "wal-link.jsonl", Path(f"{log}-wal"), symbolic=True),
        lambda log, tmp: _linked(tmp / "hard.jsonl", log, symbolic=False),
    ],
    ids=[
        "itself",
        "another spelling",
        "wal",
        "shm",
        "journal",
        "symlink",
        "symlink to wal",
        "hard link",
    ],
)
def test_export_never_writes_over_the_log_it_reads(
    kvhandoff: Run, tmp_path: Path, spell: Callable[[Path, Path], Path]
) -> None:
    log = _log_with_siblings(tmp_path)
    before = {p: p.read_bytes() for p in log.parent.iterdir()}
    target = spell(log, tmp_path)
    result = kvhandoff("export", log, "5aff", "-o", target, "--force")
    assert result.code == 2
    assert "refusing to write over the log" in result.err
    assert {p: p.read_bytes() for p in log.parent.iterdir()} == before


def _linked(link: Path, target: Path, *, symbolic: bool) -> Path:
    if symbolic:
        link.symlink_to(target)
    else:
        os.link(target, link)
    return link


def test_export_of_an_export_onto_itself_is_refused(kvhandoff: Run, tmp_path: Path) -> None:
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(EXPORT.read_bytes())
    result = kvhandoff("export", copy, "5aff", "-o", copy, "--force")
    assert result.code == 2 and copy.read_bytes() == EXPORT.read_bytes()


def test_a_failed_export_leaves_the_old_file_whole_and_nothing_else(
    kvhandoff: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "bug.jsonl"
    target.write_text("the previous export\n")

    def fail_halfway(log: object, out: object) -> None:
        out.write(b'{"format":"kvhandoff-handoff-log"')  # type: ignore[attr-defined]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_jsonl", fail_halfway)
    result = kvhandoff("export", LOG, "5aff", "-o", target, "--force")
    assert result.code == 2
    assert result.err == f"kvhandoff export: cannot write {target}: No space left on device\n"
    assert target.read_text() == "the previous export\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bug.jsonl"]
