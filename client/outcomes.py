"""An engine's outcomes on disk, so that each action id runs once across engine restarts too.

An `Engine` given an `outcomes_path` records each outcome here before it publishes it, and
loads the outcomes of the last `remember` handoffs when it starts: a worker that republishes an
action to a restarted engine gets the stored outcome, and the handler does not run again. A
handoff the engine's memory forgets is deleted here as well, so the file stays bounded.

It is one SQLite table in WAL mode with `synchronous=NORMAL`: an outcome survives the engine's
crash (what this is for); the last ones may be lost with the machine's power, as are the engine's
own in-memory effects then. The writes are small and synchronous, on the event loop. SQLite's
errors become `OutcomeLogFailed` here, the one seam.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

import msgspec

from kvhandoff.client.errors import OutcomeLogFailed
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import Outcome

_encode = msgspec.json.Encoder().encode
_decoder = msgspec.json.Decoder(Outcome)


class OutcomeLog:
    """The outcomes of one engine, in the order it ran them. Open it with the engine's id: one
    file holds one engine's outcomes, and refuses another's."""

    def __init__(self, path: Path, engine_id: str) -> None:
        self.path = path
        with self._translated("open"):
            self._db = sqlite3.connect(path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS engine (engine_id TEXT NOT NULL)")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS outcomes (handoff_id BLOB NOT NULL, action_id "
                "INTEGER NOT NULL, outcome BLOB NOT NULL, PRIMARY KEY (handoff_id, action_id))"
            )
            row = self._db.execute("SELECT engine_id FROM engine").fetchone()
            if row is None:
                self._db.execute("INSERT INTO engine VALUES (?)", (engine_id,))
        if row is not None and row[0] != engine_id:
            self._db.close()
            raise OutcomeLogFailed(f"{path} holds the outcomes of engine {row[0]}, not {engine_id}")

    def load(self) -> Iterator[tuple[HandoffId, int, Outcome]]:
        """Every outcome kept, oldest first."""
        with self._translated("read"):
            rows = self._db.execute(
                "SELECT handoff_id, action_id, outcome FROM outcomes ORDER BY rowid"
            ).fetchall()
        for handoff_id, action_id, outcome in rows:
            yield UUID(bytes=handoff_id), action_id, _decoder.decode(outcome)

    def record(self, handoff_id: HandoffId, action_id: int, outcome: Outcome) -> None:
        with self._translated(f"record the outcome of {handoff_id}#{action_id}"):
            self._db.execute(
                "INSERT OR REPLACE INTO outcomes VALUES (?, ?, ?)",
                (handoff_id.bytes, action_id, _encode(outcome)),
            )

    def forget(self, handoff_id: HandoffId) -> None:
        with self._translated(f"forget {handoff_id}"):
            self._db.execute("DELETE FROM outcomes WHERE handoff_id = ?", (handoff_id.bytes,))

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _translated(self, doing: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise OutcomeLogFailed(f"outcome log {self.path}: cannot {doing}: {exc}") from exc
