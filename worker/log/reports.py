"""The JSON documents that the offline log commands print (`--json`, `--format json`).

Each is a msgspec Struct, so the output is encoded from the same types that describe it, and
`json_schema(name)` (or `kvhandoff <command> --print-schema`) gives its JSON Schema. Inputs,
actions and coordinator states inside a report use the wire vocabulary's own JSON forms, so the
wire schema (`kvhandoff schema`) describes them too.

Evolution follows the wire types' rules: new fields get defaults, a field's type never changes.
"""

from __future__ import annotations

import enum
from typing import Any
from uuid import UUID

import msgspec
from msgspec import Struct

from kvhandoff.events.messages import Action, HandoffOrder, Input, Role
from kvhandoff.events.replay import Divergence, Timeline
from kvhandoff.worker.log.rows import HandoffRow


class ListedHandoff(Struct, frozen=True):
    """One handoff of `kvhandoff list`. `duration_ms` is null while it is open."""

    handoff: HandoffRow
    order: HandoffOrder | None
    events: int
    age_ms: int
    duration_ms: int | None


class ListReport(Struct, frozen=True):
    now_ms: int
    handoffs: list[ListedHandoff]


class LoggedInput(Struct, frozen=True):
    """An input as it stands in the log."""

    seq: int
    at_ms: int
    input: Input


class WaitingFor(Struct, frozen=True):
    """One thing a stuck handoff waits for: a `fact`, or the outcome of an issued `action`.

    `engine` is the handoff's source or destination (by `role`), or "frontend"; `since_ms` is
    when the awaited action was logged, or, for a fact, when the last input was.
    """

    role: Role
    engine: str
    fact: str | None
    action: Action | None
    since_ms: int
    waited_ms: int
    # The engine's lease as the worker last saw it (`worker.tier.lease_view`): live or expired, or
    # None if the worker knew of no lease of it or left no view.
    lease: str | None = None


class StuckHandoff(Struct, frozen=True):
    """A handoff that waits; `idle_ms` is the time since its last logged event.

    `state` is the rebuilt coordinator's short description; or, with no waits, the reason a
    quarantined handoff was set aside ("quarantined: ..."), "cannot replay: ..." when this
    build's coordinator rejects the handoff's logged inputs, or "cannot read its log: ..." when
    a record does not decode (`last_input` is then null).
    """

    handoff: HandoffRow
    state: str
    age_ms: int
    idle_ms: int
    overdue: bool
    waiting: list[WaitingFor]
    last_input: LoggedInput | None
    outstanding: list[int]


class StuckReport(Struct, frozen=True):
    """`open` counts the open handoffs looked at, `quarantined` the quarantined ones (always
    listed: they never progress on their own), `unknown_state` those in a state this build does
    not know (looked at like open ones)."""

    now_ms: int
    older_than_ms: int
    open: int
    handoffs: list[StuckHandoff]
    quarantined: int = 0
    unknown_state: int = 0
    leases_at_ms: int | None = None  # when the worker wrote the lease view read, if any


class ReplayReport(Struct, frozen=True):
    """A handoff's timeline; `at` is the step it stopped at (`--at`), else null."""

    handoff: HandoffRow
    at: int | None
    timeline: Timeline


class FindingKind(enum.StrEnum):
    """What is wrong with a handoff's log."""

    #: This build's coordinator derives other actions from the logged inputs (or rejects one).
    DIVERGENCE = "divergence"
    #: An input's stored digest is not its own: the input or the digest changed after logging.
    DIGEST_MISMATCH = "digest_mismatch"
    #: A record that does not decode, or has a schema version this build cannot upcast.
    CORRUPT_RECORD = "corrupt_record"
    #: The log skips or repeats a seq, does not begin at 0 with the handoff's start, or is empty.
    SEQUENCE = "sequence"
    #: The handoff's row holds a state this build does not know.
    UNKNOWN_STATE = "unknown_state"
    #: A snapshot's tombstone says the handoff ended otherwise than its rows in the same file.
    TOMBSTONE = "tombstone"


class Finding(Struct, frozen=True):
    """One thing wrong with one handoff. `seq` is the event it concerns (a divergence's or a
    digest mismatch's step), or null when it concerns the handoff as a whole."""

    handoff_id: UUID
    kind: FindingKind
    seq: int | None
    detail: str


class VerifyReport(Struct, frozen=True):
    """What `kvhandoff verify` checked and found.

    `findings` lists everything wrong, by handoff id and seq, every bad handoff of the log;
    `diverged` holds each diverging handoff's first divergence in full (each is a finding too).
    `digests_checked` is false for a log that keeps no input digests (a JSONL export).
    """

    handoffs: int
    events: int
    diverged: list[Divergence]
    findings: list[Finding] = []
    digests_checked: bool = True

    @property
    def bad(self) -> int:
        """How many handoffs have a finding."""
        return len({f.handoff_id for f in self.findings})


REPORTS: dict[str, type[Struct]] = {
    "list": ListReport,
    "stuck": StuckReport,
    "replay": ReplayReport,
    "verify": VerifyReport,
}


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema (2020-12) of one command's report."""
    (root,), components = msgspec.json.schema_components(
        (REPORTS[name],), ref_template="#/$defs/{name}"
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"kvhandoff {name} report",
        **root,
        "$defs": components,
    }
