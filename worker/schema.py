"""The SQLite layout of the event log, shared by the worker's writer and the offline readers.

    handoffs    one row per handoff: a projection of its log for listing, recovery (open ones),
                deadlines and compaction; rewritten in the same transaction as its events
    events      the log: one msgpack `LogRecord` per accepted input and per issued action,
                keyed by (handoff_id, seq); `seq` counts from 0 per handoff with no gaps
    rejections  inputs that were refused, with the reason (they changed nothing else), and the
                reason a handoff was quarantined (reason starting "quarantined:")
    meta        the layout version

The unique key on (handoff_id, seq) makes a second writer fail loudly instead of interleaving.
Every input row keeps its digest, and the worker loads a handoff's digests with its log before
it applies anything to it, so an exact duplicate of a logged input is recognised whatever NATS
redelivers and however long ago the original came. (No unique index on the digest: it would
only repeat that check, at a quarter of the commit's cost.)
"""

from __future__ import annotations

import enum

LAYOUT_VERSION = "1"


class HandoffState(enum.StrEnum):
    OPEN = "open"
    SUCCEEDED = "succeeded"
    CANCELED = "canceled"
    # The worker could not rebuild the handoff from its log (an undecodable record, a replay
    # that diverges): it is set aside, its inputs are rejected, and the rest carry on. The
    # rejections table holds the reason; an operator repairs or exports it by hand.
    QUARANTINED = "quarantined"


class EventKind(enum.StrEnum):
    INPUT = "input"
    ACTION = "action"


DDL = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS handoffs (
    handoff_id      TEXT PRIMARY KEY,
    engine_type     TEXT NOT NULL,
    source          TEXT NOT NULL,
    destination     TEXT NOT NULL,
    started_at_ms   INTEGER NOT NULL,
    deadline_at_ms  INTEGER NOT NULL,
    state           TEXT NOT NULL,
    completed_at_ms INTEGER,
    last_seq        INTEGER NOT NULL,
    updated_at_ms   INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS handoffs_open ON handoffs (deadline_at_ms) WHERE state = 'open';
CREATE INDEX IF NOT EXISTS handoffs_closed ON handoffs (completed_at_ms) WHERE state != 'open';

CREATE TABLE IF NOT EXISTS events (
    handoff_id      TEXT NOT NULL,
    seq             INTEGER NOT NULL,
    kind            TEXT NOT NULL,
    type            TEXT NOT NULL,
    at_ms           INTEGER NOT NULL,
    digest          BLOB,
    published_at_ms INTEGER,
    record          BLOB NOT NULL,
    PRIMARY KEY (handoff_id, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_unpublished
    ON events (handoff_id, seq) WHERE kind = 'action' AND published_at_ms IS NULL;

CREATE TABLE IF NOT EXISTS rejections (
    id         INTEGER PRIMARY KEY,
    at_ms      INTEGER NOT NULL,
    handoff_id TEXT,
    reason     TEXT NOT NULL,
    payload    BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS rejections_handoff ON rejections (handoff_id);
"""

# One handoff's log, in replay order.
SELECT_EVENTS = """
SELECT handoff_id, seq, kind, at_ms, digest, published_at_ms, record
FROM events WHERE handoff_id = ? ORDER BY seq
"""
SELECT_HANDOFF = """
SELECT handoff_id, engine_type, source, destination, started_at_ms, deadline_at_ms, state,
       completed_at_ms, last_seq, updated_at_ms
FROM handoffs WHERE handoff_id = ?
"""

# Offline reads (worker.logreader): every handoff's projection, unique-prefix lookup of an id,
# why a handoff was quarantined, one handoff's stored log, and the lean scan that `verify`
# streams (the clustered key keeps it in replay order; a handoff's seq only grows, so where it
# does not, another handoff begins and the id need not be read: materialising it on every row
# costs ~20%). `SCAN_OWNERS` reads the ids in the same order, for a scan that went wrong.
HANDOFF_COLUMNS = """handoff_id, engine_type, source, destination, started_at_ms, deadline_at_ms,
    state, completed_at_ms, last_seq, updated_at_ms"""
SELECT_HANDOFFS = f"SELECT {HANDOFF_COLUMNS} FROM handoffs"
SELECT_HANDOFF_IDS_BETWEEN = """
SELECT handoff_id FROM handoffs WHERE handoff_id >= ? AND handoff_id < ? ORDER BY handoff_id LIMIT ?
"""
QUARANTINE_PREFIX = "quarantined:"
SELECT_QUARANTINE = f"""
SELECT at_ms, reason FROM rejections
WHERE handoff_id = ? AND substr(reason, 1, {len(QUARANTINE_PREFIX)}) = '{QUARANTINE_PREFIX}'
ORDER BY id LIMIT 1
"""
SELECT_STORED = "SELECT seq, digest, record FROM events WHERE handoff_id = ? ORDER BY seq"
SCAN_RECORDS = "SELECT seq, digest, record FROM events ORDER BY handoff_id, seq"
SCAN_OWNERS = "SELECT handoff_id FROM events ORDER BY handoff_id, seq"
