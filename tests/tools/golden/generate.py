"""Writes the golden event logs that the offline tools' tests read, deterministically.

    python tests/tools/golden/generate.py tests/tools/golden/v2

The logs are written the way the worker writes them, in the layout this build writes
(`worker.log.schema.LAYOUT_VERSION`): the pure coordinator decides, and `worker.log.store.EventLog`
commits each input with the actions it issued in one `Batch`, with the handoff's projection.
Ids and times are fixed, so every run writes the same rows. Output:

    log.sqlite3          one handoff per scenario below (journal mode DELETE, so a read-only
                         open leaves no -wal/-shm files in the checkout)
    tampered.sqlite3     the same log with two logged actions altered (see TAMPERED);
                         `kvhandoff verify` must name each at its step
    frontend-cancel.jsonl  the `frontend-cancel` handoff as `kvhandoff export` writes it

A golden directory is frozen once its layout is released: it must keep decoding and verifying
with every later build. A new layout or schema version gets a new directory beside it. `v1/`
was written by this generator as it was before layout 2, with the same handoffs.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sqlite3
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID, uuid5

import msgspec

from kvhandoff.events.codec import decode_record, join_record, split_record
from kvhandoff.events.coordinator import HandoffCoordinator
from kvhandoff.events.messages import (
    ACCEPTED,
    APPLIED,
    NOOP,
    SCHEDULED,
    SUBMITTED,
    Action,
    ActionFailed,
    ActionOutcome,
    CancelDestination,
    Canceled,
    CancelSource,
    DestinationReserved,
    EngineType,
    HandoffCompletion,
    HandoffTransferTiming,
    Input,
    KvTransferTimingMode,
    SourceHeld,
    StartHandoff,
    StartTransfer,
    TimedOut,
    TransferCompleted,
)
from kvhandoff.events.records import ActionRecord, InputRecord
from kvhandoff.worker.log.reader import open_log, write_jsonl
from kvhandoff.worker.log.rows import Batch, HandoffRow
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.log.store import EventLog

#: 2025-01-01T00:00:00Z; handoff k starts k minutes later.
BASE_MS = 1_735_689_600_000
_NAMESPACE = UUID("6b7668a1-0ff0-4c0d-9a6e-000000000000")
DEADLINE_MS = 30_000

FULL_PROMPT = HandoffTransferTiming(
    mode=KvTransferTimingMode.FULL_PROMPT,
    full_prompt_tokens=4096,
    kv_bytes_per_token=131_072,
    bandwidth_gb_s=25.0,
)
MISSING_ONLY = HandoffTransferTiming(
    mode=KvTransferTimingMode.DESTINATION_MISSING,
    full_prompt_tokens=8192,
    kv_bytes_per_token=65_536,
    bandwidth_gb_s=50.0,
)

Script = list[tuple[int, Input]]  # (ms after the start, input)


def handoff_id(name: str) -> UUID:
    return uuid5(_NAMESPACE, name)


def _start(h: UUID, engine: EngineType) -> StartHandoff:
    # One pool of engines per engine type, so that `--engine` filters tell handoffs apart.
    source, destination = f"{engine}-prefill-0", f"{engine}-decode-0"
    return StartHandoff(h, engine, source, destination, deadline_ms=DEADLINE_MS)


def source_first_success(h: UUID) -> Script:
    return [
        (0, _start(h, EngineType.VLLM)),
        (4, ActionOutcome(h, 0, SUBMITTED)),
        (180, SourceHeld(h, FULL_PROMPT)),
        (183, ActionOutcome(h, 1, ACCEPTED)),
        (190, DestinationReserved(h, 4096)),
        (192, ActionOutcome(h, 2, SCHEDULED)),
        (215, TransferCompleted(h)),
        (218, ActionOutcome(h, 3, APPLIED)),
        (221, ActionOutcome(h, 4, APPLIED)),
    ]


def destination_first_success(h: UUID) -> Script:
    return [
        (0, _start(h, EngineType.SGLANG)),
        (3, ActionOutcome(h, 0, ACCEPTED)),
        (9, DestinationReserved(h, 3072)),
        (12, ActionOutcome(h, 1, SUBMITTED)),
        (160, SourceHeld(h, MISSING_ONLY)),
        (162, ActionOutcome(h, 2, SCHEDULED)),
        (168, TransferCompleted(h)),
        (171, ActionOutcome(h, 3, APPLIED)),
        (174, ActionOutcome(h, 4, NOOP)),
    ]


def frontend_cancel(h: UUID) -> Script:
    return [
        (0, _start(h, EngineType.TRTLLM)),
        (5, ActionOutcome(h, 0, SUBMITTED)),
        (140, SourceHeld(h, FULL_PROMPT)),
        (700, Canceled(h)),
        (704, ActionOutcome(h, 2, APPLIED)),
        (706, ActionOutcome(h, 3, NOOP)),
    ]


def failed_outcome(h: UUID) -> Script:
    return [
        (0, _start(h, EngineType.SGLANG)),
        (6, ActionOutcome(h, 0, ActionFailed("no free KV blocks"))),
        (9, ActionOutcome(h, 1, NOOP)),
    ]


def deadline_timed_out(h: UUID) -> Script:
    return [
        (0, _start(h, EngineType.VLLM)),
        (4, ActionOutcome(h, 0, SUBMITTED)),
        (150, SourceHeld(h, FULL_PROMPT)),
        (DEADLINE_MS, TimedOut(h)),
        (DEADLINE_MS + 3, ActionOutcome(h, 2, APPLIED)),
        (DEADLINE_MS + 5, ActionOutcome(h, 3, APPLIED)),
    ]


def reopened_after_success(h: UUID) -> Script:
    return [
        *source_first_success(h),
        (2_500, Canceled(h)),
        (2_504, ActionOutcome(h, 6, APPLIED)),
    ]


def stuck_on_reserve(h: UUID) -> Script:
    # The destination never answers ReserveDestination: waits on an action outcome.
    return [
        (0, _start(h, EngineType.VLLM)),
        (4, ActionOutcome(h, 0, SUBMITTED)),
        (170, SourceHeld(h, FULL_PROMPT)),
    ]


def stuck_on_transfer(h: UUID) -> Script:
    # The destination-first success up to the transfer's Scheduled, whose TransferCompleted
    # never comes: waits on a fact.
    return destination_first_success(h)[:6]


def just_started(h: UUID) -> Script:
    # Open and waiting, but only for a moment: `stuck --older-than` must leave it out.
    return [(0, _start(h, EngineType.VLLM))]


@dataclass(frozen=True)
class Scenario:
    name: str
    script: Callable[[UUID], Script]
    start_ms: int
    state: HandoffState

    @property
    def handoff_id(self) -> UUID:
        return handoff_id(self.name)


SCENARIOS = [
    Scenario("source-first-success", source_first_success, BASE_MS, HandoffState.SUCCEEDED),
    Scenario(
        "destination-first-success",
        destination_first_success,
        BASE_MS + 60_000,
        HandoffState.SUCCEEDED,
    ),
    Scenario("frontend-cancel", frontend_cancel, BASE_MS + 120_000, HandoffState.CANCELED),
    Scenario("failed-outcome", failed_outcome, BASE_MS + 180_000, HandoffState.CANCELED),
    Scenario("deadline-timed-out", deadline_timed_out, BASE_MS + 240_000, HandoffState.CANCELED),
    Scenario(
        "reopened-after-success",
        reopened_after_success,
        BASE_MS + 300_000,
        HandoffState.CANCELED,
    ),
    Scenario("stuck-on-reserve", stuck_on_reserve, BASE_MS + 360_000, HandoffState.OPEN),
    Scenario("stuck-on-transfer", stuck_on_transfer, BASE_MS + 420_000, HandoffState.OPEN),
    Scenario("just-started", just_started, BASE_MS + 900_000, HandoffState.OPEN),
]


@dataclass(frozen=True)
class Tamper:
    """One logged action altered after the fact: `verify` must report `step`."""

    scenario: str
    seq: int
    step: int
    describe: str


TAMPERED = [
    # StartTransfer(2) is issued by DestinationReserved (seq 6) and logged at seq 7.
    Tamper("source-first-success", 7, 6, "StartTransfer delay_ms divided by ten"),
    # Canceled (seq 5) issues CancelSource(2) at seq 6 and CancelDestination(3) at seq 7.
    Tamper("frontend-cancel", 7, 5, "CancelDestination(3) logged as CancelSource(3)"),
]


def _project(row: HandoffRow, coordinator: HandoffCoordinator, last_seq: int, now: int) -> None:
    """The worker's projection after an accepted input (as `worker.tier.service` keeps it): open
    while the coordinator is, completed at the input that completed it, reopened for a cleanup
    after success."""
    row.last_seq, row.updated_at_ms = last_seq, now
    if not coordinator.is_complete:
        row.state, row.completed_at_ms = HandoffState.OPEN, None
    elif row.state is HandoffState.OPEN:
        success = coordinator.completion is HandoffCompletion.SUCCESS
        row.state = HandoffState.SUCCEEDED if success else HandoffState.CANCELED
        row.completed_at_ms = now


def write_log(path: Path, handoffs: Sequence[tuple[int, Script]]) -> None:
    """Drive each scripted handoff through a coordinator and commit it as the worker does."""
    asyncio.run(_append(path, handoffs))
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=DELETE")
    with sqlite3.connect(path, isolation_level=None) as db:
        db.execute("VACUUM")


async def _append(path: Path, handoffs: Sequence[tuple[int, Script]]) -> None:
    log = await EventLog.open(path)
    try:
        for start_ms, script in handoffs:
            first = script[0][1]
            assert isinstance(first, StartHandoff)
            coordinator = HandoffCoordinator.for_start(first)
            row = HandoffRow(
                first.handoff_id,
                first.engine_type.value,
                first.source,
                first.destination,
                start_ms,
                start_ms + first.deadline_ms,
                HandoffState.OPEN,
                None,
                0,
                start_ms,
            )
            seq = 0
            for offset, message in script:
                at_ms = start_ms + offset
                batch = Batch()
                actions = coordinator.handle(message)
                batch.append_input(seq, InputRecord(at_ms, message))
                seq += 1
                for action in actions:
                    batch.append_action(seq, ActionRecord(at_ms, action))
                    batch.mark_published(first.handoff_id, seq, at_ms + 1)
                    seq += 1
                _project(row, coordinator, seq - 1, at_ms)
                batch.upsert_handoff(row.copy())
                await log.commit(batch)
    finally:
        await log.close()


def tamper(path: Path, tampers: Sequence[Tamper]) -> None:
    """Alter the logged actions that `tampers` name, keeping each row's `type` consistent."""
    with sqlite3.connect(path) as db:
        for t in tampers:
            h = handoff_id(t.scenario)
            key = (str(h), t.seq)
            code, at_ms, fields = db.execute(
                "SELECT type, at_ms, record FROM events WHERE seq = ?2 AND handoff_key ="
                " (SELECT handoff_key FROM handoffs WHERE handoff_id = ?1)",
                key,
            ).fetchone()
            record = decode_record(join_record(h.bytes, code, at_ms, fields))
            assert isinstance(record, ActionRecord)
            action = record.action
            altered: Action
            match action:
                case StartTransfer():
                    altered = msgspec.structs.replace(action, delay_ms=action.delay_ms / 10)
                case CancelDestination():
                    altered = CancelSource(action.handoff_id, action.action_id)
                case _:
                    raise AssertionError(f"{t}: seq {t.seq} holds {action!r}")
            db.execute(
                "UPDATE events SET type = ?3, record = ?4 WHERE seq = ?2 AND handoff_key ="
                " (SELECT handoff_key FROM handoffs WHERE handoff_id = ?1)",
                (*key, *split_record(msgspec.structs.replace(record, action=altered))),
            )
    with sqlite3.connect(path, isolation_level=None) as db:
        db.execute("VACUUM")


def generate(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    log_path = directory / "log.sqlite3"
    tampered_path = directory / "tampered.sqlite3"
    for stale in (log_path, tampered_path):
        stale.unlink(missing_ok=True)
    write_log(log_path, [(s.start_ms, s.script(s.handoff_id)) for s in SCENARIOS])
    shutil.copyfile(log_path, tampered_path)
    tamper(tampered_path, TAMPERED)
    with open_log(log_path) as log, (directory / "frontend-cancel.jsonl").open("wb") as out:
        write_jsonl(log.load(handoff_id("frontend-cancel")), out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    generate(args.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
