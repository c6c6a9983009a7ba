"""Changing a copy of a golden log with sqlite3, the way damage, a hand edit or another build of
the worker would leave it: records rewritten with or without their digest, events lost, a state
this build does not know, a quarantined handoff with its rejection row, copies of a handoff
under new ids. `rewrite` and `delete_events` take a log of either layout; the rest that touch
events take layout 1's, the layout with most to go wrong (digests, ids in every row).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from uuid import UUID

import msgspec

from kvhandoff.events.codec import (
    decode_record,
    encode_record,
    input_digest,
    join_record,
    split_record,
)
from kvhandoff.events.messages import Action, Input
from kvhandoff.events.records import InputRecord, LogRecord
from kvhandoff.worker.log.schema import LAYOUT_1

#: Layout 2's key of a handoff, by its id (the first parameter).
KEY_OF = "(SELECT handoff_key FROM handoffs WHERE handoff_id = ?1)"


def layout(path: Path) -> str:
    with sqlite3.connect(path) as db:
        (value,) = db.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()
    return str(value)


def rewrite(
    path: Path,
    handoff_id: str,
    seq: int,
    change: Callable[[LogRecord], LogRecord],
    *,
    digest: bool = True,
) -> None:
    """Replace one record by `change(record)`; in layout 1, with `digest`, store the new input's
    digest as the worker would have, else keep the old one (an edit the digest gives away)."""
    if layout(path) != LAYOUT_1:
        with sqlite3.connect(path) as db:
            code, at_ms, fields = db.execute(
                f"SELECT type, at_ms, record FROM events WHERE handoff_key = {KEY_OF} AND seq = ?2",
                (handoff_id, seq),
            ).fetchone()
            old = decode_record(join_record(UUID(handoff_id).bytes, code, at_ms, fields))
            record = change(old)
            code, fields = split_record(record)
            db.execute(
                f"UPDATE events SET type = ?3, at_ms = ?4, record = ?5"
                f" WHERE handoff_key = {KEY_OF} AND seq = ?2",
                (handoff_id, seq, code, record.at_ms, fields),
            )
        return
    with sqlite3.connect(path) as db:
        (blob,) = db.execute(
            "SELECT record FROM events WHERE handoff_id = ? AND seq = ?", (handoff_id, seq)
        ).fetchone()
        record = change(decode_record(blob))
        db.execute(
            "UPDATE events SET record = ? WHERE handoff_id = ? AND seq = ?",
            (encode_record(record), handoff_id, seq),
        )
        if digest and isinstance(record, InputRecord):
            db.execute(
                "UPDATE events SET digest = ? WHERE handoff_id = ? AND seq = ?",
                (input_digest(record.input), handoff_id, seq),
            )


def set_record(path: Path, handoff_id: str, seq: int, stored: bytes) -> None:
    """Overwrite what is stored of one record (in layout 2, the message's fields)."""
    where = "handoff_id = ?1" if layout(path) == LAYOUT_1 else f"handoff_key = {KEY_OF}"
    execute(
        path, f"UPDATE events SET record = ?3 WHERE {where} AND seq = ?2", handoff_id, seq, stored
    )


def delete_events(path: Path, handoff_id: str, *seqs: int) -> None:
    """Lose some of a handoff's events, as a damaged file would."""
    where = "handoff_id = ?1" if layout(path) == LAYOUT_1 else f"handoff_key = {KEY_OF}"
    with sqlite3.connect(path) as db:
        for seq in seqs:
            db.execute(f"DELETE FROM events WHERE {where} AND seq = ?2", (handoff_id, seq))


def execute(path: Path, sql: str, *params: object) -> None:
    with sqlite3.connect(path) as db:
        db.execute(sql, params)


def set_state(path: Path, handoff_id: str, state: str) -> None:
    execute(path, "UPDATE handoffs SET state = ? WHERE handoff_id = ?", state, handoff_id)


def quarantine(path: Path, handoff_id: str, at_ms: int, reason: str) -> None:
    """What the worker does to a handoff it cannot rebuild: state and a rejection row."""
    set_state(path, handoff_id, "quarantined")
    execute(
        path,
        "INSERT INTO rejections (at_ms, handoff_id, reason, payload) VALUES (?, ?, ?, ?)",
        at_ms,
        handoff_id,
        reason,
        b"",
    )


def copy_handoff(
    path: Path,
    handoff_id: str,
    copies: int,
    change: Callable[[LogRecord], LogRecord] = lambda record: record,
) -> list[str]:
    """Append `copies` copies of a handoff (row and events, digests stored), each under a new
    id and with each record passed through `change`; returns the new ids."""
    new_ids = [str(UUID(int=i + 1)) for i in range(copies)]
    with sqlite3.connect(path) as db:
        row = db.execute("SELECT * FROM handoffs WHERE handoff_id = ?", (handoff_id,)).fetchone()
        events = db.execute(
            "SELECT seq, kind, type, at_ms, record FROM events WHERE handoff_id = ?",
            (handoff_id,),
        ).fetchall()
        for new_id in new_ids:
            db.execute(
                f"INSERT INTO handoffs VALUES ({','.join('?' * len(row))})", (new_id, *row[1:])
            )
            for seq, kind, type_, at_ms, blob in events:
                record = change(_rekeyed(decode_record(blob), UUID(new_id)))
                digest = input_digest(record.input) if isinstance(record, InputRecord) else None
                db.execute(
                    "INSERT INTO events (handoff_id, seq, kind, type, at_ms, digest, record)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (new_id, seq, kind, type_, at_ms, digest, encode_record(record)),
                )
    return new_ids


def append_inputs(path: Path, handoff_id: str, records: list[InputRecord]) -> None:
    """Log more inputs at the end of a handoff's log, as accepted inputs that issued nothing."""
    with sqlite3.connect(path) as db:
        (last,) = db.execute(
            "SELECT max(seq) FROM events WHERE handoff_id = ?", (handoff_id,)
        ).fetchone()
        db.executemany(
            "INSERT INTO events (handoff_id, seq, kind, type, at_ms, digest, record)"
            " VALUES (?, ?, 'input', ?, ?, ?, ?)",
            [
                (
                    handoff_id,
                    last + 1 + i,
                    r.input.__struct_config__.tag,
                    r.at_ms,
                    input_digest(r.input),
                    encode_record(r),
                )
                for i, r in enumerate(records)
            ],
        )
        db.execute(
            "UPDATE handoffs SET last_seq = ? WHERE handoff_id = ?",
            (last + len(records), handoff_id),
        )


def _rekeyed(record: LogRecord, handoff_id: UUID) -> LogRecord:
    if isinstance(record, InputRecord):
        message: Input = msgspec.structs.replace(record.input, handoff_id=handoff_id)
        return msgspec.structs.replace(record, input=message)
    action: Action = msgspec.structs.replace(record.action, handoff_id=handoff_id)
    return msgspec.structs.replace(record, action=action)
