"""Each offline command's output on the golden logs, run through the real `kvhandoff` CLI.

JSON outputs are decoded strictly into the report Structs that generate their JSON Schema, and
re-encoded to the same document, so every field is known, typed, and nothing is left over. Text
outputs are checked for their key lines; the JSON forms carry the content. The checks run on the
layout-1 golden log; every command prints the same for the layout-2 one, which holds the same
handoffs (`test_every_command_reads_both_layouts_alike`).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
from rich.console import Console

from kvhandoff.events.messages import APPLIED, ActionOutcome
from kvhandoff.events.records import InputRecord, LogRecord
from kvhandoff.worker.commands import _text
from kvhandoff.worker.log.reports import (
    REPORTS,
    ListReport,
    ReplayReport,
    StuckReport,
    VerifyReport,
    json_schema,
)
from tests.tools import logedit
from tests.tools.conftest import IDS, V1, V2, Run

R = TypeVar("R")
LOG = V1 / "log.sqlite3"
TAMPERED = V1 / "tampered.sqlite3"
EXPORT = V1 / "frontend-cancel.jsonl"
START = {name: 1_735_689_600_000 + 60_000 * i for i, name in enumerate(IDS)}
START["just-started"] = 1_735_689_600_000 + 900_000


def report(kind: type[R], out: str) -> R:
    """Decode strictly, and prove the document holds nothing the Struct does not."""
    decoded = msgspec.json.decode(out, type=kind, strict=True)
    assert json.loads(msgspec.json.encode(decoded)) == json.loads(out)
    return decoded


def ids(*names: str) -> list[str]:
    return [IDS[n] for n in names]


# --- list -----------------------------------------------------------------------------------


def test_list_reports_every_handoff_with_order_age_and_completion(kvhandoff: Run) -> None:
    result = kvhandoff("list", LOG, "--json", "--now", "2025-01-01T01:00:00Z")
    assert result.code == 0
    listed = report(ListReport, result.out)
    assert [str(h.handoff.handoff_id) for h in listed.handoffs] == list(IDS.values())
    by_id = {str(h.handoff.handoff_id): h for h in listed.handoffs}
    cancel = by_id[IDS["frontend-cancel"]]
    assert (cancel.handoff.state, cancel.handoff.engine_type, cancel.order) == (
        "canceled",
        "trtllm",
        "source_first",
    )
    assert (cancel.handoff.source, cancel.handoff.destination) == (
        "trtllm-prefill-0",
        "trtllm-decode-0",
    )
    assert (cancel.events, cancel.age_ms, cancel.duration_ms) == (11, 58 * 60_000, 706)
    stuck = by_id[IDS["stuck-on-transfer"]]
    assert (stuck.handoff.state, stuck.order, stuck.duration_ms) == (
        "open",
        "destination_first",
        None,
    )


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (
            ["--state", "canceled"],
            ids(
                "frontend-cancel", "failed-outcome", "deadline-timed-out", "reopened-after-success"
            ),
        ),
        (
            ["--state", "open", "--state", "succeeded"],
            ids(
                "source-first-success",
                "destination-first-success",
                "stuck-on-reserve",
                "stuck-on-transfer",
                "just-started",
            ),
        ),
        (
            ["--engine-type", "sglang"],
            ids("destination-first-success", "failed-outcome", "stuck-on-transfer"),
        ),
        (["--engine", "trtllm-prefill-0"], ids("frontend-cancel")),
        (
            ["--engine", "vllm-decode-0", "--state", "canceled"],
            ids("deadline-timed-out", "reopened-after-success"),
        ),
        (
            ["--since", "2025-01-01T00:05:00Z", "--until", "1735690200000"],
            ids("reopened-after-success", "stuck-on-reserve", "stuck-on-transfer"),
        ),
        (
            ["--since", "10m", "--now", "2025-01-01T00:16:00Z"],
            ids("stuck-on-reserve", "stuck-on-transfer", "just-started"),
        ),
        (
            ["--sort", "duration", "--reverse", "--limit", "2"],
            ids("deadline-timed-out", "reopened-after-success"),
        ),
        (["--sort", "events", "--limit", "2"], ids("just-started", "stuck-on-reserve")),
        (["--state", "open", "--engine-type", "trtllm"], []),
    ],
)
def test_list_filters_and_sorts(kvhandoff: Run, filters: list[str], expected: list[str]) -> None:
    result = kvhandoff("list", LOG, "--json", *filters)
    assert result.code == 0
    assert [str(h.handoff.handoff_id) for h in report(ListReport, result.out).handoffs] == expected


def test_list_prints_aligned_columns_when_not_a_terminal(kvhandoff: Run) -> None:
    result = kvhandoff("list", LOG, "--state", "canceled", "--now", "2025-01-01T01:00:00Z")
    lines = result.out.splitlines()
    assert lines[0].split() == [
        "HANDOFF",
        "STATE",
        "ENGINE",
        "ORDER",
        "SOURCE",
        "DESTINATION",
        "STARTED",
        "AGE",
        "COMPLETED",
        "EVENTS",
    ]
    assert lines[1].split() == [
        IDS["frontend-cancel"],
        "canceled",
        "trtllm",
        "source_first",
        "trtllm-prefill-0",
        "trtllm-decode-0",
        "2025-01-01T00:02:00.000Z",
        "58m00s",
        "after",
        "706ms",
        "11",
    ]
    assert len({line.index("STATE") for line in lines[:1]} | {lines[1].index("canceled")}) == 1
    assert lines[-1] == "4 handoffs"


def test_list_draws_a_rich_table_on_a_terminal(
    kvhandoff: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        _text,
        "console",
        lambda: Console(file=sys.stdout, force_terminal=True, color_system=None, width=250),
    )
    result = kvhandoff("list", LOG, "--state", "canceled")
    assert "┃ HANDOFF" in result.out
    assert IDS["frontend-cancel"] in result.out
    replay = kvhandoff("replay", LOG, "5aff")
    assert "┃ STEP ┃ TIME   ┃ INPUT" in replay.out


def test_table_cells_are_text_not_markup(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        _text, "console", lambda: Console(file=sys.stdout, force_terminal=True, color_system=None)
    )
    _text.print_table(["ISSUED"], [["[submit_prefill(0), bold]"], ["[red]x[/red]"]])
    out = capsys.readouterr().out
    assert "[submit_prefill(0), bold]" in out and "[red]x[/red]" in out


# --- stuck ----------------------------------------------------------------------------------


def test_stuck_names_what_each_idle_handoff_waits_for_and_since_when(kvhandoff: Run) -> None:
    result = kvhandoff(
        "stuck", LOG, "--older-than", "30s", "--now", "2025-01-01T00:15:20Z", "--json"
    )
    assert result.code == 0
    stuck = report(StuckReport, result.out)
    assert (stuck.open, stuck.older_than_ms) == (3, 30_000)
    reserve, transfer = stuck.handoffs  # longest idle first; just-started is too recent
    now = stuck.now_ms

    assert str(reserve.handoff.handoff_id) == IDS["stuck-on-reserve"]
    (waits,) = reserve.waiting
    assert (waits.role, waits.engine, waits.fact) == ("destination", "vllm-decode-0", None)
    assert waits.action is not None
    assert (waits.action.__struct_config__.tag, waits.action.action_id) == (
        "reserve_destination",
        1,
    )
    assert waits.since_ms == START["stuck-on-reserve"] + 170  # when the action was logged
    assert waits.waited_ms == now - waits.since_ms
    assert reserve.outstanding == [1]
    assert reserve.last_input is not None
    assert (reserve.last_input.seq, reserve.last_input.input.__struct_config__.tag) == (
        3,
        "source_held",
    )
    assert reserve.overdue and reserve.idle_ms == now - (START["stuck-on-reserve"] + 170)
    assert reserve.state.startswith("active") and "reserve_destination#1" in reserve.state

    assert str(transfer.handoff.handoff_id) == IDS["stuck-on-transfer"]
    (waits,) = transfer.waiting
    assert (waits.role, waits.engine, waits.fact, waits.action) == (
        "source",
        "sglang-prefill-0",
        "transfer_completed",
        None,
    )
    assert transfer.last_input is not None
    assert waits.since_ms == transfer.last_input.at_ms == START["stuck-on-transfer"] + 162
    assert transfer.outstanding == []


def test_stuck_without_an_age_lists_every_waiting_open_handoff(kvhandoff: Run) -> None:
    result = kvhandoff("stuck", LOG, "--now", "2025-01-01T00:15:20Z", "--json")
    handoffs = report(StuckReport, result.out).handoffs
    assert [str(h.handoff.handoff_id) for h in handoffs] == ids(
        "stuck-on-reserve", "stuck-on-transfer", "just-started"
    )
    started = handoffs[2]
    assert not started.overdue and started.idle_ms == 20_000
    (waits,) = started.waiting
    assert (waits.role, waits.engine) == ("source", "vllm-prefill-0")
    assert waits.action is not None and waits.action.__struct_config__.tag == "submit_prefill"


def test_stuck_shows_a_handoff_this_build_cannot_replay(
    kvhandoff: Run, writable_golden: Path
) -> None:
    # Make stuck-on-reserve's last input answer an action that was never issued.
    stuck_id = IDS["stuck-on-reserve"]

    def bogus(record: LogRecord) -> LogRecord:
        assert isinstance(record, InputRecord)
        return InputRecord(record.at_ms, ActionOutcome(record.input.handoff_id, 7, APPLIED))

    logedit.rewrite(writable_golden, stuck_id, 3, bogus)
    result = kvhandoff("stuck", writable_golden, "--now", "2025-01-01T00:15:20Z", "--json")
    assert result.code == 0
    handoffs = {str(h.handoff.handoff_id): h for h in report(StuckReport, result.out).handoffs}
    broken = handoffs[stuck_id]
    assert broken.state.startswith("cannot replay: ") and "unknown handoff action 7" in broken.state
    assert broken.waiting == [] and broken.last_input is not None and broken.last_input.seq == 3
    assert handoffs[IDS["stuck-on-transfer"]].waiting  # the others are still reported


def test_stuck_prints_one_line_per_wait(kvhandoff: Run) -> None:
    result = kvhandoff("stuck", LOG, "--older-than", "30s", "--now", "2025-01-01T00:15:20Z")
    lines = result.out.splitlines()
    assert lines[0].split() == [
        "HANDOFF",
        "IDLE",
        "WAITING",
        "FOR",
        "FROM",
        "SINCE",
        "LAST",
        "INPUT",
        "OUTSTANDING",
    ]
    assert lines[1].split() == [
        IDS["stuck-on-reserve"],
        "9m19s",
        "overdue",
        "outcome",
        "of",
        "reserve_destination(1)",
        "destination",
        "vllm-decode-0",
        "2025-01-01T00:06:00.170Z",
        "3:",
        "source_held",
        "1",
    ]
    assert "fact transfer_completed" in lines[2] and "source sglang-prefill-0" in lines[2]
    assert lines[-1] == (
        "2 of 3 open handoffs idle for at least 30.0s (now 2025-01-01T00:15:20.000Z)"
    )


# --- replay ---------------------------------------------------------------------------------


def test_replay_json_is_the_timeline_from_either_form_of_the_log(kvhandoff: Run) -> None:
    from_db = kvhandoff("replay", LOG, IDS["frontend-cancel"], "--format", "json")
    from_export = kvhandoff("replay", EXPORT, "--format", "json")
    assert from_db.code == from_export.code == 0
    assert from_db.out == from_export.out
    replay = report(ReplayReport, from_db.out)
    assert replay.at is None
    assert [s.step for s in replay.timeline.steps] == [0, 2, 3, 5, 8, 9]
    assert [s.input.__struct_config__.tag for s in replay.timeline.steps] == [
        "start_handoff",
        "action_outcome",
        "source_held",
        "canceled",
        "action_outcome",
        "action_outcome",
    ]
    canceled = replay.timeline.steps[3]
    assert [a.__struct_config__.tag for a in canceled.actions] == [
        "cancel_source",
        "cancel_destination",
    ]
    assert canceled.actions == canceled.logged
    assert ("mode", "active", "cleaning_up") in [
        (c.field, c.before, c.after) for c in canceled.changes
    ]
    assert replay.timeline.state.completion == "canceled"


def test_replay_at_a_step_stops_there_and_prints_the_full_state(kvhandoff: Run) -> None:
    result = kvhandoff("replay", LOG, "5aff", "--at", "3", "--format", "json")
    replay = report(ReplayReport, result.out)
    assert replay.at == 3 and replay.timeline.steps[-1].step == 3
    assert replay.timeline.state.source.held and replay.timeline.outstanding == (1,)

    text = kvhandoff("replay", LOG, "5aff", "--at", "3").out.splitlines()
    assert "state after step 3:" in text
    fields = {
        line.split()[0]: line.split()[1:] for line in text[text.index("state after step 3:") + 1 :]
    }
    assert fields["mode"] == ["active"] and "held=true" in fields["source"]
    # Each of the coordinator's four records on one line, its fields as name=value.
    assert fields["journal"] == [
        "started=true",
        "next_id=2",
        "issued=[submit_prefill(0),",
        "reserve_destination(1)]",
        "outcomes=[0:submitted]",
    ]
    assert fields["transfer"] == [
        "issued=false",
        "scheduled=false",
        "completed=false",
        "delay_ms=none",
    ]
    assert fields["outstanding"] == ["1"]
    assert len(fields) == len(msgspec.structs.fields(replay.timeline.state)) + 2


def test_replay_table_shows_input_changes_actions_and_state_per_step(kvhandoff: Run) -> None:
    result = kvhandoff("replay", EXPORT)
    lines = result.out.splitlines()
    assert lines[0].split() == [
        "handoff",
        IDS["frontend-cancel"],
        "trtllm",
        "(source_first)",
        "trtllm-prefill-0",
        "->",
        "trtllm-decode-0",
        "canceled",
    ]
    step = lines.index("step 5  +700ms  canceled")
    # The changed fields grouped by the record they belong to.
    assert lines[step + 1] == (
        "  changes  mode active → cleaning_up;"
        " journal: next_id 2 → 4, issued +cancel_source(2) +cancel_destination(3);"
        " source: cancel_issued false → true; destination: cancel_issued false → true"
    )
    assert lines[step + 2] == "  actions  cancel_source(2), cancel_destination(3)"
    assert lines[step + 3].startswith("  state    cleaning_up, awaiting")
    assert lines[-1] == "after step 9: complete (canceled)"


FRONTEND_CANCEL_MERMAID = """\
sequenceDiagram
    participant F as frontend
    participant S as source trtllm-prefill-0
    participant C as coordinator (trtllm)
    participant D as destination trtllm-decode-0
    F->>C: 0. start_handoff
    C->>S: submit_prefill(0)
    S-->>C: 2. action_outcome(0) submitted
    S->>C: 3. source_held
    C->>D: reserve_destination(1)
    F->>C: 5. canceled
    C->>S: cancel_source(2)
    C->>D: cancel_destination(3)
    Note over C: cleaning_up
    S-->>C: 8. action_outcome(2) applied
    D-->>C: 9. action_outcome(3) noop
    C->>F: complete(4) completion=canceled
    Note over C: complete (canceled)
"""


def test_replay_mermaid_is_a_sequence_diagram_of_the_handoff(kvhandoff: Run) -> None:
    result = kvhandoff("replay", LOG, IDS["frontend-cancel"], "--format", "mermaid")
    assert result.out == FRONTEND_CANCEL_MERMAID


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("deadline-timed-out", "    C->>C: 5. timed_out (deadline)"),
        ("failed-outcome", "    D-->>C: 2. action_outcome(0) failed"),
        ("reopened-after-success", "    F->>C: 15. canceled"),
        ("destination-first-success", "    D->>C: 3. destination_reserved"),
    ],
)
def test_replay_mermaid_draws_each_input_from_its_sender(
    kvhandoff: Run, name: str, line: str
) -> None:
    out = kvhandoff("replay", LOG, IDS[name], "--format", "mermaid").out
    assert line in out.splitlines()
    assert not any(c in out for c in "#;")  # Mermaid would parse these


def test_replay_marks_the_step_where_the_log_diverges(kvhandoff: Run) -> None:
    table = kvhandoff("replay", TAMPERED, IDS["source-first-success"]).out
    assert (
        "  actions  start_transfer(2) delay_ms=21.47483648; DIVERGES, logged: start_transfer(2)"
        " delay_ms=2.147483648"
    ) in table.splitlines()
    diagram = kvhandoff("replay", TAMPERED, IDS["frontend-cancel"], "--format", "mermaid").out
    assert (
        "    Note over C: DIVERGES from the log, which has cancel_source(2), cancel_source(3)"
        in diagram.splitlines()
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["replay", LOG], "name a handoff: .* holds 9"),
        (["replay", LOG, "ffff"], "no handoff 'ffff'"),
        (["replay", EXPORT, IDS["just-started"]], "holds handoff 5aff7c74"),
        (["replay", LOG, "5aff", "--at", "-1"], "no step at or before -1"),
        (["replay"], "the log argument is required"),
        (["list", V1 / "missing.sqlite3"], "cannot read event log"),
        (["stuck", LOG, "--now", "yesterday"], "not a time: 'yesterday'"),
    ],
)
def test_commands_fail_with_one_line_and_status_2(
    kvhandoff: Run, args: list[object], error: str
) -> None:
    result = kvhandoff(*args)
    assert result.code == 2 and result.out == ""
    assert len(result.err.splitlines()) == 1
    assert result.err.startswith(f"kvhandoff {args[0]}: ")
    assert pytest.importorskip("re").search(error, result.err)


# --- verify ---------------------------------------------------------------------------------


def test_verify_passes_a_clean_log(kvhandoff: Run) -> None:
    result = kvhandoff("verify", LOG)
    assert (result.code, result.out) == (0, "verified 9 handoffs, 93 events: all match\n")
    result = kvhandoff("verify", EXPORT)
    assert (result.code, result.out) == (
        0,
        "verified 1 handoff, 11 events (no input digests in an export): all match\n",
    )


def test_verify_names_each_diverging_handoff_step_input_and_actions(kvhandoff: Run) -> None:
    result = kvhandoff("verify", TAMPERED, "--json")
    assert result.code == 1
    verified = report(VerifyReport, result.out)
    assert (verified.handoffs, verified.events) == (9, 93)
    by_id = {str(d.handoff_id): d for d in verified.diverged}
    assert set(by_id) == set(ids("source-first-success", "frontend-cancel"))

    delay = by_id[IDS["source-first-success"]]
    assert delay.step == 6 and delay.at_ms == START["source-first-success"] + 190
    assert delay.input.__struct_config__.tag == "destination_reserved"
    assert [a.delay_ms for a in delay.logged] == [2.147483648]  # type: ignore[union-attr]
    assert [a.delay_ms for a in delay.rederived] == [21.47483648]  # type: ignore[union-attr]

    kind = by_id[IDS["frontend-cancel"]]
    assert kind.step == 5 and kind.input.__struct_config__.tag == "canceled"
    assert [(a.__struct_config__.tag, a.action_id) for a in kind.logged] == [
        ("cancel_source", 2),
        ("cancel_source", 3),
    ]
    assert [(a.__struct_config__.tag, a.action_id) for a in kind.rederived] == [
        ("cancel_source", 2),
        ("cancel_destination", 3),
    ]
    assert (
        kind.detail == "action 2 of the step: logged cancel_source, re-derived cancel_destination"
    )


def test_verify_prints_the_divergence_for_people(kvhandoff: Run) -> None:
    result = kvhandoff("verify", TAMPERED)
    assert result.code == 1
    assert result.out.splitlines() == [
        f"handoff {IDS['frontend-cancel']} diverges at step 5 (2025-01-01T00:02:00.700Z)",
        "  input       canceled",
        "  logged      cancel_source(2), cancel_source(3)",
        "  re-derived  cancel_source(2), cancel_destination(3)",
        "  difference  action 2 of the step: logged cancel_source, re-derived cancel_destination",
        f"handoff {IDS['source-first-success']} diverges at step 6 (2025-01-01T00:00:00.190Z)",
        "  input       destination_reserved transferable_prompt_tokens=4096",
        "  logged      start_transfer(2) delay_ms=2.147483648",
        "  re-derived  start_transfer(2) delay_ms=21.47483648",
        "  difference  action 1 of the step (start_transfer): delay_ms logged 2.147483648,"
        " re-derived 21.47483648",
        "verified 9 handoffs, 93 events: 2 bad (divergence 2)",
    ]


def test_verify_checks_only_the_named_handoffs(kvhandoff: Run) -> None:
    one = kvhandoff("verify", TAMPERED, "5aff", IDS["failed-outcome"], "--json")
    assert one.code == 1
    verified = report(VerifyReport, one.out)
    assert verified.handoffs == 2
    assert [str(d.handoff_id) for d in verified.diverged] == ids("frontend-cancel")
    clean = kvhandoff("verify", TAMPERED, IDS["failed-outcome"], IDS["stuck-on-reserve"])
    assert clean.code == 0


# --- export ---------------------------------------------------------------------------------


def test_export_writes_the_golden_jsonl(kvhandoff: Run, tmp_path: Path) -> None:
    to_stdout = kvhandoff("export", LOG, IDS["frontend-cancel"])
    assert to_stdout.code == 0
    assert to_stdout.out == EXPORT.read_text()
    path = tmp_path / "bug-1234.jsonl"
    to_file = kvhandoff("export", LOG, "5aff", "-o", path)
    assert to_file.code == 0 and to_file.out == ""
    assert path.read_bytes() == EXPORT.read_bytes()
    assert f"wrote 11 events of handoff {IDS['frontend-cancel']} to {path}" in to_file.err


# --- compact --------------------------------------------------------------------------------


def test_compact_removes_completed_handoffs_older_than_the_age(
    kvhandoff: Run, writable_log_v2: Path
) -> None:
    minute = 60_000
    midnight = 1_735_689_600_000  # 2025-01-01T00:00:00Z
    with closing(sqlite3.connect(writable_log_v2)) as db, db:
        db.executemany(
            "INSERT INTO rejections (at_ms, handoff_id, reason, payload) VALUES (?, NULL, ?, ?)",
            [
                (midnight + 2 * minute, "undecodable input", b"{"),
                (midnight + 3 * minute + 30_000, "not expected", b"[]"),
            ],
        )
    result = kvhandoff(
        "compact", writable_log_v2, "--older-than", "1m", "--now", "2025-01-01T00:04:00Z"
    )
    assert result.code == 0
    assert result.out == (
        "removed 3 handoffs completed and 1 rejection logged before 2025-01-01T00:03:00.000Z\n"
    )
    with closing(sqlite3.connect(writable_log_v2)) as db:
        assert db.execute("SELECT reason FROM rejections").fetchall() == [("not expected",)]
    left = report(ListReport, kvhandoff("list", writable_log_v2, "--json").out)
    assert [str(h.handoff.handoff_id) for h in left.handoffs] == list(IDS.values())[3:]
    assert kvhandoff("verify", writable_log_v2).out == (
        "verified 6 handoffs, 52 events (no input digests in a layout-2 log): all match\n"
    )

    everything = kvhandoff("compact", writable_log_v2, "--older-than", "0", "--now", "2030-01-01")
    assert everything.out.startswith("removed 3 handoffs completed and 1 rejection logged")
    left = report(ListReport, kvhandoff("list", writable_log_v2, "--json").out)
    assert {h.handoff.state for h in left.handoffs} == {"open"}


def test_compact_leaves_a_layout_1_log_to_the_worker(kvhandoff: Run, writable_log: Path) -> None:
    """Only the worker, under its lock, migrates a log: an older worker may still be writing."""
    before = writable_log.read_bytes()
    result = kvhandoff("compact", writable_log, "--older-than", "0")
    assert result.code == 2
    assert "has layout '1', which this build reads but does not write: the worker" in result.err
    assert writable_log.read_bytes() == before


def test_compact_does_not_create_a_log(kvhandoff: Run, tmp_path: Path) -> None:
    missing = tmp_path / "typo.sqlite3"
    result = kvhandoff("compact", missing, "--older-than", "7d")
    assert result.code == 2 and "no event log at" in result.err
    assert not missing.exists()


# --- both layouts ---------------------------------------------------------------------------

NOW = "2025-01-01T00:15:20Z"
BOTH_LAYOUTS = {
    "list": [["list", "{log}", "--now", NOW], ["list", "{log}", "--json", "--now", NOW]],
    "stuck": [["stuck", "{log}", "--now", NOW], ["stuck", "{log}", "--json", "--now", NOW]],
    "replay": [
        ["replay", "{log}", handoff_id, "--format", form]
        for handoff_id in IDS.values()
        for form in ("table", "json", "mermaid")
    ]
    + [["replay", "{tampered}", IDS["frontend-cancel"]]],
    "verify": [
        ["verify", log, *json] for log in ("{log}", "{tampered}") for json in ([], ["--json"])
    ],
    "export": [["export", "{log}", handoff_id] for handoff_id in IDS.values()],
}


def _published_as_one_mark(export: str) -> str:
    """An export with every action's publication time made its handoff's last: layout 2 keeps
    one outbox mark per handoff, not a time per action."""
    lines = [json.loads(line) for line in export.splitlines()]
    marks = [e["published_at_ms"] for e in lines[1:] if e["published_at_ms"] is not None]
    for event in lines[1:]:
        if event["published_at_ms"] is not None:
            event["published_at_ms"] = max(marks)
    return "\n".join(json.dumps(line) for line in lines)


@pytest.mark.parametrize("command", sorted(BOTH_LAYOUTS))
def test_every_command_reads_both_layouts_alike(kvhandoff: Run, command: str) -> None:
    """The layout-2 golden log holds the layout-1 one's handoffs: every command prints the
    same for both, but for what layout 2 does not keep (input digests, a time per action)."""
    for args in BOTH_LAYOUTS[command]:
        outputs = []
        for directory in (V1, V2):
            paths = {"log": directory / "log.sqlite3", "tampered": directory / "tampered.sqlite3"}
            result = kvhandoff(*(a.format(**paths) for a in args))
            outputs.append((result.code, result.out, result.err))
        (old_code, old, old_err), (new_code, new, new_err) = outputs
        assert (new_code, new_err) == (old_code, old_err), args
        if command == "verify":
            new = new.replace(" (no input digests in a layout-2 log)", "")
            new = new.replace('"digests_checked": false', '"digests_checked": true')
        if command == "export":
            new, old = _published_as_one_mark(new), _published_as_one_mark(old)
        assert new == old, args


# --- schemas and layering -------------------------------------------------------------------


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        own = {node["$ref"]} if "$ref" in node else set()
        return own.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_each_report_has_a_self_contained_json_schema(kvhandoff: Run, name: str) -> None:
    schema = json_schema(name)
    assert schema["$ref"] == f"#/$defs/{REPORTS[name].__name__}"
    assert {ref.removeprefix("#/$defs/") for ref in _refs(schema)} <= set(schema["$defs"])
    printed = kvhandoff(name, "--print-schema")
    assert printed.code == 0 and json.loads(printed.out) == schema


def test_the_offline_commands_do_not_import_nats() -> None:
    code = (
        "import kvhandoff.worker.commands.replay, kvhandoff.worker.commands.list, "
        "kvhandoff.worker.commands.stuck, kvhandoff.worker.commands.verify, "
        "kvhandoff.worker.commands.export, kvhandoff.worker.commands.compact, sys; "
        "print('nats' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "False\n"


def test_the_log_reader_imports_neither_nats_nor_aiosqlite() -> None:
    code = (
        "import kvhandoff.worker.log.reader, kvhandoff.worker.commands.replay, "
        "kvhandoff.worker.commands.verify, sys; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('nats', 'aiosqlite')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n"
