"""The SQLite layout of the event log, shared by the worker's writer and the offline readers.

Layout 2, which this build writes:

    handoffs      one row per handoff: a projection of its log for listing, recovery (open ones),
                  deadlines, compaction and the outbox, rewritten in the same transaction as its
                  events. Its rowid, `handoff_key`, is the dense integer its events are filed
                  under; the handoff id (text) is stored here, once.
    events        the log: one record per accepted input and per issued action, keyed by
                  (handoff_key, seq); `seq` counts from 0 per handoff with no gaps. A record is
                  stored split (see `events.records`): its message type as a number (`type`),
                  its time (`at_ms`), and the message's other fields (`record`), which
                  `events.codec.join_record` puts back together with the handoff id.
    record_types  what each `type` number stands for: the message's tag, and whether it is an
                  input or an action. For people reading the file; the code has its own copy.
    rejections    inputs that were refused, with the reason (they changed nothing else), and the
                  reason a handoff was quarantined (reason starting "quarantined:")
    meta          the layout version

Why so: layout 1 filed every event under the 36-character handoff id, kept the kind, the tag and
the time beside a record that held them all again, and a digest beside every input; its rows
took about 4 KB per handoff. New handoffs get ever larger keys, so layout 2's events are
appended near the end of the b-tree, where layout 1's random ids split pages all over it.

The unique key on (handoff_key, seq) makes a second writer fail loudly instead of interleaving.

The outbox is one mark per handoff: `published_seq`, every action up to that seq has been
published, and `published_at_ms`, when that mark last moved. The worker publishes a handoff's
actions in seq order and marks them together once the server confirmed them, so "everything up
to N" is exact, and the mark rides on the handoff's row instead of an UPDATE per action.

Duplicates. No input digest is stored: the worker recognises an exact duplicate of a logged
input by `events.codec.input_digest` of the logged inputs, computed when it loads a handoff's
log, before it applies anything to it, whatever NATS redelivers and however long ago the
original came.

In memory, a `handoffs` row and an event are `worker.log.rows`' types, whoever reads them.

Layout 1 is still read by the offline tools (queries `LAYOUT_1_*` below), which also check its
stored digests. The worker converts a layout-1 log to layout 2 when it starts (`worker.log.store`).
"""

from __future__ import annotations

import enum
from typing import get_args

from kvhandoff.events.messages import Action, ActionOutcome, Input
from kvhandoff.events.records import TYPE_CODES

LAYOUT_VERSION = "2"
LAYOUT_1 = "1"


class HandoffState(enum.StrEnum):
    """A handoff's state as its log records it (the `handoffs` row): the authority. A mock
    engine's own progress through a handoff is `worker.engines.EnginePhase`, and what a
    frontend reads of it from the completion stream is `client.CompletionStatus`."""

    OPEN = "open"
    SUCCEEDED = "succeeded"
    CANCELED = "canceled"
    # The worker could not rebuild the handoff from its log (an undecodable record, a replay
    # that diverges): it is set aside, its inputs are rejected, and the rest carry on. The
    # rejections table holds the reason; an operator repairs or exports it by hand.
    QUARANTINED = "quarantined"


def _codes(union: object) -> tuple[int, ...]:
    return tuple(TYPE_CODES[str(kind.__struct_config__.tag)] for kind in get_args(union))


INPUT_TYPES = _codes(Input)
ACTION_TYPES = _codes(Action)
OUTCOME_TYPE = TYPE_CODES[str(ActionOutcome.__struct_config__.tag)]
#: The rows of `record_types`: (type, tag, kind).
RECORD_TYPES = [
    (code, tag, "input" if code in INPUT_TYPES else "action") for tag, code in TYPE_CODES.items()
]

# Handoffs that ended, known from a snapshot of the partition's replicated log rather than by
# their rows (a file caught up on another machine): what a late input for one is answered with.
# Added to layout 2 without a new version: the writer creates it in an older file, and no
# reader needs it.
TOMBSTONES = """CREATE TABLE IF NOT EXISTS tombstones (
    handoff_id      TEXT PRIMARY KEY,
    state           TEXT NOT NULL,
    completed_at_ms INTEGER NOT NULL,
    digests         BLOB NOT NULL
) WITHOUT ROWID"""

# One statement each: the writer also runs them inside its conversion of a layout-1 log, where
# sqlite3's executescript would commit the transaction first.
TABLES = (
    """CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS handoffs (
    handoff_key     INTEGER PRIMARY KEY,
    handoff_id      TEXT NOT NULL UNIQUE,
    engine_type     TEXT NOT NULL,
    source          TEXT NOT NULL,
    destination     TEXT NOT NULL,
    started_at_ms   INTEGER NOT NULL,
    deadline_at_ms  INTEGER NOT NULL,
    state           TEXT NOT NULL,
    completed_at_ms INTEGER,
    last_seq        INTEGER NOT NULL,
    updated_at_ms   INTEGER NOT NULL,
    published_seq   INTEGER NOT NULL DEFAULT -1,
    published_at_ms INTEGER
)""",
    """CREATE TABLE IF NOT EXISTS events (
    handoff_key INTEGER NOT NULL,
    seq         INTEGER NOT NULL,
    type        INTEGER NOT NULL,
    at_ms       INTEGER NOT NULL,
    record      BLOB NOT NULL,
    PRIMARY KEY (handoff_key, seq)
) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS record_types (
    type INTEGER PRIMARY KEY,
    tag  TEXT NOT NULL,
    kind TEXT NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS rejections (
    id         INTEGER PRIMARY KEY,
    at_ms      INTEGER NOT NULL,
    handoff_id TEXT,
    reason     TEXT NOT NULL,
    payload    BLOB NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS rejections_handoff ON rejections (handoff_id)",
    TOMBSTONES,
)
# The outbox index holds the handoffs whose last events may be unpublished actions: recovery
# finds its backlog there instead of reading every handoff.
INDEXES = (
    "CREATE INDEX IF NOT EXISTS handoffs_open ON handoffs (deadline_at_ms) WHERE state = 'open'",
    "CREATE INDEX IF NOT EXISTS handoffs_closed ON handoffs (completed_at_ms)"
    " WHERE state != 'open'",
    "CREATE INDEX IF NOT EXISTS handoffs_outbox ON handoffs (handoff_key)"
    " WHERE published_seq < last_seq",
)
# One statement, so that adding what a log lacks is one transaction (none, if it lacks nothing).
INSERT_RECORD_TYPES = "INSERT OR IGNORE INTO record_types (type, tag, kind) VALUES " + ", ".join(
    ["(?, ?, ?)"] * len(RECORD_TYPES)
)
RECORD_TYPE_VALUES = [value for row in RECORD_TYPES for value in row]

HANDOFF_COLUMNS = """handoff_id, engine_type, source, destination, started_at_ms, deadline_at_ms,
    state, completed_at_ms, last_seq, updated_at_ms"""
SELECT_HANDOFFS = f"SELECT {HANDOFF_COLUMNS} FROM handoffs"
SELECT_HANDOFF = f"{SELECT_HANDOFFS} WHERE handoff_id = ?"

# Offline reads (worker.log.reader), of either layout: every handoff's projection, unique-prefix
# lookup of an id, why a handoff was quarantined.
SELECT_HANDOFF_IDS_BETWEEN = """
SELECT handoff_id FROM handoffs WHERE handoff_id >= ? AND handoff_id < ? ORDER BY handoff_id LIMIT ?
"""
QUARANTINE_PREFIX = "quarantined:"
SELECT_QUARANTINE = f"""
SELECT at_ms, reason FROM rejections
WHERE handoff_id = ? AND substr(reason, 1, {len(QUARANTINE_PREFIX)}) = '{QUARANTINE_PREFIX}'
ORDER BY id LIMIT 1
"""

# One handoff's log, in replay order, with the handoff's outbox mark.
SELECT_EVENTS = """
SELECT e.seq, e.type, e.at_ms, e.record, h.published_seq, h.published_at_ms
FROM handoffs h JOIN events e USING (handoff_key) WHERE h.handoff_id = ? ORDER BY e.seq
"""
# `verify`'s read of the whole log: every event in (handoff_key, seq) order, with its handoff's
# key, and apart from it, in the same order, the handoffs' ids, to put the records together:
# reading the id on every row instead costs about a fifth of `verify`'s time. An event filed
# under a key that no handoff row has belongs to no handoff; the reader skips it.
SCAN_EVENTS = """
SELECT handoff_key, seq, type, at_ms, record FROM events ORDER BY handoff_key, seq
"""
SCAN_EVENT_KEYS = "SELECT handoff_key FROM events ORDER BY handoff_key, seq"
SCAN_KEYS = "SELECT handoff_key, handoff_id FROM handoffs ORDER BY handoff_key"

# Layout 1's logs, read by the offline tools. The clustered key keeps the scan in replay order;
# a handoff's seq only grows, so where it does not, another handoff begins and the id need not
# be read. `LAYOUT_1_SCAN_OWNERS` reads the ids in the same order, for a scan that went wrong.
LAYOUT_1_SELECT_EVENTS = """
SELECT seq, at_ms, published_at_ms, record FROM events WHERE handoff_id = ? ORDER BY seq
"""
LAYOUT_1_SELECT_STORED = "SELECT seq, digest, record FROM events WHERE handoff_id = ? ORDER BY seq"
LAYOUT_1_SCAN = "SELECT seq, digest, record FROM events ORDER BY handoff_id, seq"
LAYOUT_1_SCAN_OWNERS = "SELECT handoff_id FROM events ORDER BY handoff_id, seq"
