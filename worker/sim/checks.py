"""The checkers of a simulated run: the tier's invariants, judged from the recorded history.

Theory of operation. A run records what the model of NATS saw (worker.sim.history): every
message stored, every ack settled, every publish. `check_run` decodes the partitions' logs from
it once (`ReplicatedLog`: every entry ever stored on a `<prefix>.log.<p>` subject, in stored
order, those a later snapshot rolled up included, a snapshot's parts joined) and runs each
check over it, and over the workers' partition files. Each check returns violations, one line
each, naming the partition, the handoff, the input or the sequence, and what broke:

- reading the log: no handoff's event sequence is logged by two entries (an owner that took
  a file's prefix of an ended handoff for its whole history would log at sequences used);
- `check_chain`: each partition's appends form one chain: every entry names, by compare-and-set
  (`Nats-Expected-Last-Subject-Sequence`), the entry stored before it on its subject (a
  snapshot's parts after the first follow their first); a `Claimed` epoch is above every epoch
  claimed before it on that subject (generations never go back); an `Appended`, `HandedOver` or
  `Snapshot` of an epoch that a later claim already superseded is a fenced owner's append that
  succeeded, and one of an epoch nobody claimed is no owner's;
- `check_inputs_once`: no input stream sequence is in two `Appended` entries (within a
  partition or across), and each is on its partition's input subject;
- `check_input_order`: a handoff's inputs are applied in the order its input stream stored
  them, but for one given back (a nak: deferred as early, or handed back at a hand-over), which
  comes again after inputs stored later; an orphan that an old owner left unacknowledged, which
  JetStream redelivers behind newer inputs, is waited for (docs/tier.md, "Order");
- `check_known_handoffs`: no input is refused as of a handoff never started ("no such
  handoff") by an entry stored after one that logged the handoff's start: the tier knows each
  handoff it started for the run's length (its tombstones live `--tombstone-ttl`, 300 s);
- `check_snapshots`: every snapshot knows (by its row or its tombstone) each handoff whose
  start its partition's log holds before it, within half the tombstone TTL before the snapshot
  (a snapshot replaces the log it sums up: a handoff it forgets is one the next claim takes a
  late input of for one never started, or starts again);
- `check_acks`: every ack the input stream's consumers settled names an input an `Appended`
  (or a snapshot's `applied`) stored before it (so an acknowledged input was applied, once,
  by the check above);
- `check_actions`: every action published to an engine or a frontend (decoded with the events
  codec) is one that an `Appended` entry's rows logged, field for field, before the publish,
  and went to the subject its handoff's row names;
- `check_files`: every partition file passes the offline `verify` (`verify_log`), its mark
  (`MARK_KEY`) is the first input of an entry of its partition's log, and every event it holds
  is, byte for byte, the one the log's rows hold under that handoff and sequence;
- `check_timers`: a handoff's log holds at most one `TimedOut`, and no worker published one
  before the handoff's deadline by its own clock (the clock its timers read);
- `check_timed_out_again`: a worker publishes a handoff's `TimedOut` again only if its previous
  one went unacknowledged, or if it claimed the handoff's partition in between (below);
- `check_leases`: no start naming an engine is accepted (logged as an input) once that engine's
  lease has been expired, by the lease bucket's delete marker, for longer than one lease TTL with
  no new lease since (docs/leases.md: "a start naming an engine whose lease expired is rejected
  at once"; the TTL is the time allowed for the workers' watch to deliver the marker, as the tier
  "learns within one lease TTL that an engine is gone");
- `check_refused_pins`: no pull asks with a pin id after it read a 423 refusing a request
  that carried that id, unless it read a message stamped with the id since (ADR-42: a refused
  pull asks to be pinned anew; worker.bus.pull's 423). Judged at the client (worker.sim.pulls),
  as only there is "asked after it read the refusal" known;
- `check_hand_overs_claimed`: a partition handed over (`HandedOver`) is claimed again
  (docs/tier.md, "Vacant partitions": a partition that gets no input is claimed once nobody
  has been pinned to it for the priority timeout), judged on the log as it stood when the
  workers began to stop, for the hand-overs stored long enough before that;
- `check_final_states`: replaying each handoff's logged inputs through the conformance core
  (`HandoffCoordinator`, by `events.replay`) re-derives its logged actions, and ends in the
  state its last row says; none is left open; and the frontend's count of handoffs by final
  state is the log's.

The log's rows are what the tier says it did; the checks hold the history against them, and
them against the core. Determinism: the checks iterate lists and dicts in insertion order only.
"""

from __future__ import annotations

import contextlib
import itertools
import sqlite3
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from uuid import UUID

import msgspec

from kvhandoff.events.codec import decode_action, decode_input, decode_record, join_record
from kvhandoff.events.errors import LogCorrupt, ReplayDivergence
from kvhandoff.events.leases import EngineLease
from kvhandoff.events.messages import Action, HandoffCompletion, StartHandoff, TimedOut
from kvhandoff.events.records import ActionRecord, InputRecord, LogRecord
from kvhandoff.events.replay import find_divergence, rebuild
from kvhandoff.events.subjects import (
    DEFAULT_STREAM,
    Subjects,
    log_stream_of,
    partition_prefix,
)
from kvhandoff.worker.bus.pull import PullRequest
from kvhandoff.worker.commands.verify import verify_log
from kvhandoff.worker.config import TOMBSTONE_TTL_S, TierConfig
from kvhandoff.worker.errors import NewerLogVersion, StoreError
from kvhandoff.worker.loadgen.generator import LoadReport
from kvhandoff.worker.log.reader import SqliteLog
from kvhandoff.worker.log.rows import HandoffRow
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.sim.history import History, Published, PullAsked, PullRead, StoredMessage
from kvhandoff.worker.sim.nats.jetstream.streams import MSG_ID
from kvhandoff.worker.sim.nats.server import decode_header
from kvhandoff.worker.tier.entries import (
    MARK_KEY,
    Appended,
    Claimed,
    Entry,
    HandedOver,
    LoggedRows,
    Snapshot,
    SnapshotPart,
    decode_entry,
    decode_rows,
    decode_snapshot,
    decode_state,
)
from kvhandoff.worker.tier.planner import UNKNOWN_HANDOFF

_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
# What marks a key's deletion in a KV bucket's stream: an expiry's delete marker, or a delete.
_MARKER_REASON, _KV_OPERATION = "Nats-Marker-Reason", "KV-Operation"
_LEASE = msgspec.json.Decoder(EngineLease)


@dataclass(frozen=True)
class Names:
    """Where the tier keeps what the checks read: its subject prefix and its streams."""

    prefix: str = Subjects().prefix
    input_stream: str = DEFAULT_STREAM
    log_stream: str = log_stream_of(DEFAULT_STREAM)
    lease_bucket: str = Subjects().lease_bucket

    @classmethod
    def of(cls, tier: TierConfig, prefix: str) -> Names:
        return cls(prefix, tier.stream, tier.log_stream, Subjects(prefix).lease_bucket)


@dataclass(frozen=True)
class LogEntry:
    """One entry of a partition's log, as stored (a snapshot's: its last part)."""

    partition: int
    stored: StoredMessage
    entry: Entry
    rows: LoggedRows | None = None  # an `Appended`'s, decoded
    first: StoredMessage | None = None  # a snapshot of many parts: its first part

    def where(self) -> str:
        kind, stored = type(self.entry).__name__, self.stored
        return f"partition {self.partition}: {kind} at seq {stored.seq} of {stored.subject}"


@dataclass(frozen=True)
class LoggedEvent:
    """One event of a handoff's log, as an `Appended` entry's rows hold it."""

    seq: int
    record: LogRecord
    encoded: bytes  # the record's self-contained form (`events.codec.encode_record`)
    entry: LogEntry


@dataclass
class ReplicatedLog:
    """Every partition's log, decoded from the history (module docstring)."""

    entries: list[LogEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what did not decode, or was logged twice
    # By handoff: its events by sequence (the first entry to log each), its rows in log order.
    events: dict[UUID, dict[int, LoggedEvent]] = field(default_factory=dict)
    rows: dict[UUID, list[HandoffRow]] = field(default_factory=dict)

    @classmethod
    def read(cls, history: History, names: Names) -> ReplicatedLog:
        log = cls()
        head = f"{names.prefix}.log."
        parts: dict[str, list[tuple[StoredMessage, bytes]]] = {}
        for stored in history.stored:
            if stored.stream != names.log_stream or not stored.subject.startswith(head):
                continue
            partition = _int(stored.subject.removeprefix(head))
            where = f"partition {partition}: seq {stored.seq} of {stored.subject}"
            first = None
            try:
                entry = decode_entry(stored.payload, where)
                if isinstance(entry, SnapshotPart):
                    held = parts.setdefault(stored.subject, [])
                    held.append((stored, entry.data))
                    if entry.index + 1 < entry.count:
                        continue
                    del parts[stored.subject]
                    first = held[0][0]
                    entry = decode_snapshot(b"".join(data for _, data in held), where)
                rows = None
                if isinstance(entry, Appended):
                    rows = decode_rows(entry.records, where)
            except (msgspec.DecodeError, NewerLogVersion) as exc:
                log.problems.append(f"{where} is not a log entry this build reads: {exc}")
                continue
            logged = LogEntry(partition, stored, entry, rows, first)
            log.entries.append(logged)
            if rows is not None:
                log._take_rows(logged, rows)
        return log

    def _take_rows(self, entry: LogEntry, rows: LoggedRows) -> None:
        for row in rows.handoffs:
            self.rows.setdefault(row.handoff_id, []).append(row)
        for key, seq, code, at_ms, fields in rows.events:
            handoff_id = UUID(key)
            encoded = join_record(handoff_id.bytes, code, at_ms, fields)
            try:
                record = decode_record(encoded)
            except LogCorrupt as exc:
                self.problems.append(f"{entry.where()}: event {seq} of handoff {key}: {exc}")
                continue
            events = self.events.setdefault(handoff_id, {})
            first = events.setdefault(seq, LoggedEvent(seq, record, encoded, entry))
            if first.entry is not entry:
                # An entry holds the events it adds (what it carries is `history`, apart).
                self.problems.append(
                    f"{entry.where()}: handoff {key}: event {seq} logged again, first by"
                    f" {first.entry.where()}: two events at one sequence"
                )

    def appended(self) -> Iterable[tuple[LogEntry, Appended]]:
        for logged in self.entries:
            if isinstance(logged.entry, Appended):
                yield logged, logged.entry

    def applied_at(self) -> dict[int, int]:
        """Each input stream sequence an entry says was applied: the history index of the
        first such entry (an `Appended`'s inputs, a snapshot's `applied`)."""
        applied: dict[int, int] = {}
        for logged in self.entries:
            match logged.entry:
                case Appended(inputs=inputs) | Snapshot(applied=inputs):
                    for seq in inputs:
                        applied.setdefault(seq, logged.stored.index)
        return applied


def check_run(
    history: History,
    workdir: Path | None,
    names: Names = Names(),
    load: LoadReport | None = None,
    tombstone_ttl_s: float = TOMBSTONE_TTL_S,
) -> list[str]:
    """Every check, on a run's history and (if given) the workers' data directories."""
    log = ReplicatedLog.read(history, names)
    violations = list(log.problems)
    violations += check_chain(log)
    violations += check_inputs_once(history, log, names)
    violations += check_input_order(history, log, names)
    violations += check_known_handoffs(log)
    violations += check_snapshots(log, tombstone_ttl_s)
    violations += check_acks(history, log, names)
    violations += check_actions(history, log, names)
    violations += check_outbox_marks(history, log, names)
    if workdir is not None:
        violations += check_files(workdir, log)
    violations += check_timers(history, log, names)
    violations += check_timed_out_again(history, log, names)
    violations += check_leases(history, log, names)
    violations += check_refused_pins(history)
    violations += check_final_states(log, load)
    return violations


def check_chain(log: ReplicatedLog) -> list[str]:
    """One chain per partition, generations that never go back, no fenced owner's append."""
    violations: list[str] = []
    last_seq: dict[str, int] = {}  # by subject: the seq of the last message stored on it
    claimed: dict[str, list[int]] = {}  # by subject: the epochs claimed, in order
    for logged in log.entries:
        stored, entry = logged.stored, logged.entry
        subject, where = stored.subject, logged.where()
        # A snapshot of many parts is linked by its first part; its last ends the chain.
        headers = (logged.first or stored).headers or {}
        previous = last_seq.get(subject, 0)
        expected = headers.get(_EXPECTED_LAST_SUBJECT_SEQ)
        if expected is None:
            violations.append(
                f"{where} was stored without compare-and-set: it names no previous entry"
                f" (the subject's last was seq {previous})"
            )
        elif expected != str(previous):
            violations.append(
                f"{where} names seq {expected} as its previous entry, but the subject's last"
                f" was seq {previous}: a fork"
            )
        last_seq[subject] = stored.seq
        epochs = claimed.setdefault(subject, [])
        newest = max(epochs, default=0)
        if isinstance(entry, Claimed):
            if entry.epoch <= newest:
                violations.append(
                    f"{where} claims epoch {entry.epoch}, not above epoch {newest} claimed"
                    " before: the generation went back"
                )
            epochs.append(entry.epoch)
        elif isinstance(entry, Appended | HandedOver | Snapshot):
            if entry.epoch < newest:
                violations.append(
                    f"{where} is epoch {entry.epoch}'s, stored after epoch {newest} claimed the"
                    " partition: a fenced owner's append succeeded"
                )
            elif entry.epoch not in epochs:
                violations.append(f"{where} is of epoch {entry.epoch}, which nobody claimed")
    return violations


def check_inputs_once(history: History, log: ReplicatedLog, names: Names) -> list[str]:
    """No input in two `Appended` entries; each in its own partition's log."""
    violations: list[str] = []
    subjects = {
        stored.seq: stored.subject
        for stored in history.stored
        if stored.stream == names.input_stream
    }
    first: dict[int, LogEntry] = {}
    for logged, entry in log.appended():
        for seq in entry.inputs:
            earlier = first.setdefault(seq, logged)
            if earlier is not logged:
                violations.append(
                    f"input {seq} is applied twice: by {earlier.where()} and by {logged.where()}"
                )
            subject = subjects.get(seq)
            if subject is None:
                violations.append(f"{logged.where()} applies input {seq}, which was never stored")
            elif not subject.startswith(partition_prefix(names.prefix, logged.partition)):
                violations.append(
                    f"{logged.where()} applies input {seq} of {subject}, another partition's"
                )
    return violations


def check_input_order(history: History, log: ReplicatedLog, names: Names) -> list[str]:
    """Each handoff's inputs applied in stream order, but for those a nak gave back."""
    violations: list[str] = []
    handoff_of = {  # the stream stores an input as `<prefix>.inp.<partition>.<handoff id>`
        stored.seq: stored.subject.rpartition(".")[2]
        for stored in history.stored
        if stored.stream == names.input_stream
    }
    naked = {nak.seq for nak in history.naked if nak.stream == names.input_stream}
    newest: dict[str, tuple[int, LogEntry]] = {}  # by handoff: its newest input applied
    for logged, entry in log.appended():
        for seq in entry.inputs:
            handoff_id = handoff_of.get(seq)
            if handoff_id is None:
                continue  # never stored, or not an input subject: check_inputs_once says so
            before = newest.get(handoff_id)
            if before is None or seq > before[0]:
                newest[handoff_id] = (seq, logged)
            elif seq < before[0] and seq not in naked:  # the same twice: check_inputs_once's
                violations.append(
                    f"handoff {handoff_id}: input {seq} is applied by {logged.where()}, after "
                    f"input {before[0]}, stored later, by {before[1].where()}: out of stream "
                    "order, and no nak gave it back"
                )
    return violations


def check_known_handoffs(log: ReplicatedLog) -> list[str]:
    """No input refused for a handoff unknown once the log holds that handoff's start."""
    violations: list[str] = []
    for logged, _ in log.appended():
        for _, handoff, reason, _ in logged.rows.rejections if logged.rows is not None else ():
            if handoff is None or not reason.startswith(UNKNOWN_HANDOFF):
                continue
            started = log.events.get(UUID(handoff), {}).get(0)
            if started is not None and started.entry.stored.index < logged.stored.index:
                violations.append(
                    f"handoff {handoff}: {logged.where()} refused an input as of a handoff never"
                    f" started ({reason}), though {started.entry.where()} logged its start"
                )
    return violations


def check_snapshots(log: ReplicatedLog, tombstone_ttl_s: float) -> list[str]:
    """Each snapshot holds a row or a tombstone of every handoff its partition's log started
    before it, in the half of the tombstone TTL before the snapshot's time (half: the owner's
    clock may be skewed from the one that logged the start, by seconds, not minutes)."""
    violations: list[str] = []
    started: dict[int, dict[UUID, int]] = {}  # by partition: each start's logged at_ms
    for logged in log.entries:
        entry, known_here = logged.entry, started.setdefault(logged.partition, {})
        if isinstance(entry, Appended) and logged.rows is not None:
            for key, seq, _, at_ms, _ in logged.rows.events:
                if seq == 0:
                    known_here.setdefault(UUID(key), at_ms)
        if not isinstance(entry, Snapshot):
            continue
        try:
            state = decode_state(entry.records, logged.where())
        except (msgspec.DecodeError, NewerLogVersion) as exc:
            violations.append(f"{logged.where()}: its state does not decode: {exc}")
            continue
        known = {row.handoff_id for row in state.handoffs}
        known.update(tombstone.handoff_id for tombstone in state.tombstones)
        since_ms = entry.at_ms - tombstone_ttl_s * 1000 / 2
        violations += [
            f"handoff {handoff_id}: {logged.where()} holds neither its row nor its tombstone,"
            f" though the log before it started the handoff {entry.at_ms - at_ms} ms before"
            for handoff_id, at_ms in known_here.items()
            if at_ms >= since_ms and handoff_id not in known
        ]
    return violations


def check_acks(history: History, log: ReplicatedLog, names: Names) -> list[str]:
    """Every acknowledged input was appended before its ack."""
    violations: list[str] = []
    applied = log.applied_at()
    for ack in history.acked:
        if ack.stream != names.input_stream:
            continue
        at = applied.get(ack.seq)
        if at is None:
            violations.append(
                f"input {ack.seq} was acknowledged (by {ack.consumer} at {ack.at:.3f}s) but no"
                " log entry applied it"
            )
        elif at > ack.index:
            violations.append(
                f"input {ack.seq} was acknowledged (by {ack.consumer} at {ack.at:.3f}s) before"
                " the log entry that applied it was stored"
            )
    return violations


def check_actions(history: History, log: ReplicatedLog, names: Names) -> list[str]:
    """Every action published is one an appended entry logged before, sent where it goes."""
    violations: list[str] = []
    subjects = Subjects(names.prefix)
    logged: dict[tuple[UUID, int], LoggedEvent] = {}
    for events in log.events.values():
        for event in events.values():
            if isinstance(event.record, ActionRecord):
                issued = event.record.action
                logged.setdefault((issued.handoff_id, issued.action_id), event)
    for published in _action_publishes(history, names):
        subject = published.subject
        by = f"published by {published.publisher or 'an unknown process'} at {published.at:.3f}s"
        try:
            action: Action = decode_action(published.payload)
        except msgspec.DecodeError as exc:
            violations.append(f"{subject}: a message {by} is no action: {exc}")
            continue
        what = f"handoff {action.handoff_id}: action {action.action_id} ({type(action).__name__})"
        found = logged.get((action.handoff_id, action.action_id))
        if found is None:
            violations.append(f"{what} {by} is in no appended entry")
            continue
        assert isinstance(found.record, ActionRecord)
        if found.record.action != action:
            violations.append(f"{what} {by} differs from the logged {found.record.action!r}")
        elif found.entry.stored.index > published.index:
            violations.append(f"{what} {by} before {found.entry.where()} logged it")
        rows = log.rows.get(action.handoff_id)
        if rows:
            row = rows[0]
            wanted = subjects.action(action, row.source, row.destination)
            if wanted != subject:
                violations.append(f"{what} {by} went to {subject}, not to {wanted}")
    return violations


def _action_publishes(history: History, names: Names) -> Iterator[Published]:
    """The publishes, as the server read them, on an action's subject (an engine's, or a
    handoff's completion), but a probe of who listens (no payload)."""
    engine_head, done_head = f"{names.prefix}.engine.", f"{names.prefix}.done."
    for published in history.published:
        subject = published.subject
        to_engine = subject.startswith(engine_head) and subject.endswith(".actions")
        if (to_engine or subject.startswith(done_head)) and published.payload:
            yield published


def check_outbox_marks(history: History, log: ReplicatedLog, names: Names) -> list[str]:
    """Every outbox mark an entry carries is true when the entry is stored: the mark says that
    every action of its handoff up to its seq was published, and the server had read each of
    them (a publish a reset swallowed is not published, whatever the client was told)."""
    read: dict[tuple[UUID, int], int] = {}  # (handoff, action id): when the server first read it
    for published in _action_publishes(history, names):
        try:
            action = decode_action(published.payload)
        except msgspec.DecodeError:
            continue  # `check_actions` reports it
        read.setdefault((action.handoff_id, action.action_id), published.index)
    violations: list[str] = []
    told: set[tuple[UUID, int]] = set()
    for entry in log.entries:
        if entry.rows is None:
            continue
        for handoff_id, mark, _ in entry.rows.published:
            for seq, event in sorted(log.events.get(handoff_id, {}).items()):
                if seq > mark:
                    break
                if not isinstance(event.record, ActionRecord):
                    continue
                action = event.record.action
                at = read.get((handoff_id, action.action_id))
                if (at is not None and at < entry.stored.index) or (handoff_id, seq) in told:
                    continue
                told.add((handoff_id, seq))
                violations.append(
                    f"handoff {handoff_id}: {entry.where()} marks action {action.action_id}"
                    f" ({type(action).__name__}) published, though the server had not read it"
                )
    return violations


def check_files(workdir: Path, log: ReplicatedLog) -> list[str]:
    """Every partition file under `workdir` passes `verify` and is a prefix of the log."""
    violations: list[str] = []
    marks: dict[int, set[str]] = {}  # by partition: the marks its log's entries leave
    for logged in log.entries:
        found = marks.setdefault(logged.partition, set())
        if logged.rows is not None and logged.rows.inputs:
            found.add(str(logged.rows.inputs[0]))
        elif isinstance(logged.entry, Snapshot):
            try:
                state = decode_state(logged.entry.records, logged.where())
            except (msgspec.DecodeError, NewerLogVersion):
                continue  # its entry was reported already, if it is the one the file took
            if state.mark is not None:
                found.add(str(state.mark))
    for path in sorted(workdir.rglob("partition-*.db")):
        partition = _int(path.stem.removeprefix("partition-"))
        name = str(path.relative_to(workdir))
        try:
            with SqliteLog(path) as file:
                report = verify_log(file)
                mark = _meta(path, MARK_KEY)
                stored = {row.handoff_id: file.stored(row.handoff_id) for row in file.handoffs()}
        except (StoreError, LogCorrupt) as exc:
            violations.append(f"{name}: unreadable: {exc}")
            continue
        for finding in report.findings:
            at = "" if finding.seq is None else f" at seq {finding.seq}"
            violations.append(
                f"{name}: verify: handoff {finding.handoff_id}: {finding.kind.value}{at}:"
                f" {finding.detail}"
            )
        if mark is not None and mark not in marks.get(partition, set()):
            violations.append(
                f"{name}: its mark, input {mark}, begins no entry of partition {partition}'s log"
            )
        for handoff_id, records in stored.items():
            events = log.events.get(handoff_id, {})
            for seq, _, blob in records:
                event = events.get(seq)
                if event is None:
                    violations.append(
                        f"{name}: handoff {handoff_id}: event {seq} is in no entry of the log"
                    )
                elif event.encoded != blob:
                    violations.append(
                        f"{name}: handoff {handoff_id}: event {seq} differs from the one"
                        f" {event.entry.where()} holds"
                    )
    return violations


def check_timers(history: History, log: ReplicatedLog, names: Names) -> list[str]:
    """A handoff's deadline fires once at most, and never before it is due."""
    violations: list[str] = []
    for handoff_id, events in log.events.items():
        fired = [
            event.seq
            for event in events.values()
            if isinstance(event.record, InputRecord) and isinstance(event.record.input, TimedOut)
        ]
        if len(fired) > 1:
            violations.append(
                f"handoff {handoff_id}: TimedOut is logged {len(fired)} times, at seqs {fired}"
            )
    subjects = Subjects(names.prefix)
    for published in history.published:
        timed_out = subjects.input_handoff(published.subject)
        if timed_out is None or published.wall_ms is None or b"timed_out" not in published.payload:
            continue
        try:
            message = decode_input(published.payload)
        except msgspec.DecodeError:
            continue  # not the tier's: the worker rejects it, logged as a rejection
        rows = log.rows.get(timed_out)
        if not isinstance(message, TimedOut) or not rows:
            continue
        due_ms = rows[0].deadline_at_ms
        if published.wall_ms < due_ms:
            violations.append(
                f"handoff {timed_out}: {published.publisher} published TimedOut at"
                f" {published.at:.3f}s, {due_ms - published.wall_ms} ms before its deadline by"
                " its own clock"
            )
    return violations


def check_timed_out_again(history: History, log: ReplicatedLog, names: Names) -> list[str]:
    """A worker publishes a handoff's `TimedOut` again only when its previous one was not
    acknowledged, or after it claimed the handoff's partition again.

    What worker.tier.timers promises: "A deadline that passes while its handoff is still active
    publishes `TimedOut` durably", and "A deadline whose `TimedOut` cannot be published (NATS
    away) fires again a second later"; and a claim `rearm`s: "each adopted handoff's deadline is
    its row's". So a deadline fires again only after its publish failed, or after a claim.

    One publish is one `Nats-Msg-Id` (worker.bus.publish `publish_durable`: its retries carry
    the same id, so the stream stores it once); it was acknowledged if JetStream sent a
    `PubAck` to one of its attempts (`History.pub_acked`, by reply subject), a stored
    message's or a duplicate's: the publish then returned, and its deadline is not put back.
    A claim is a `Claimed` entry of the partition the handoff's events are logged in, whose
    owner's label is the publisher's name, which took effect (a `PubAck` for it was sent)
    between the two publishes. An ack sent is
    taken as received unless a connection of the publisher's was lost after it was sent and
    before the next publish (`History.resets`): it may have been in flight on it."""
    subjects = Subjects(names.prefix)
    answered = {acked.reply: acked.index for acked in history.pub_acked}
    resets: dict[str, list[int]] = {}
    for reset in history.resets:
        resets.setdefault(reset.host, []).append(reset.index)
    # A claim takes effect when its owner learns that its `Claimed` was stored: at one of the
    # PubAcks sent for it (a retry after a lost ack is answered as a duplicate, later).
    acks_of: dict[tuple[str, int], list[int]] = {}
    for pub_ack in history.pub_acked:
        acks_of.setdefault((pub_ack.stream, pub_ack.seq), []).append(pub_ack.index)
    claims: dict[tuple[str, int], list[int]] = {}  # (label, partition): when each took effect
    for logged in log.entries:
        if isinstance(logged.entry, Claimed):
            label = logged.entry.owner.rpartition("/")[0]
            stored = logged.stored
            took_effect = acks_of.get((stored.stream, stored.seq), [stored.index])
            claims.setdefault((label, logged.partition), []).extend(took_effect)
    # By publisher and handoff, its TimedOut publishes: by msg id, each one's attempts in order.
    publishes: dict[tuple[str, UUID], dict[str, list[Published]]] = {}
    for published in history.published:
        handoff_id = subjects.input_handoff(published.subject)
        if handoff_id is None or published.publisher is None:
            continue
        if b"timed_out" not in published.payload or published.header is None:
            continue
        try:
            message = decode_input(published.payload)
        except msgspec.DecodeError:
            continue  # not the tier's: the worker rejects it, logged as a rejection
        if not isinstance(message, TimedOut):
            continue
        msg_id = decode_header(published.header).get(MSG_ID, "")
        by_id = publishes.setdefault((published.publisher, handoff_id), {})
        by_id.setdefault(msg_id, []).append(published)
    violations: list[str] = []
    for (publisher, handoff_id), by_id in publishes.items():
        events = log.events.get(handoff_id, {})
        partition = next(iter(events.values())).entry.partition if events else None
        claimed = claims.get((publisher, partition), []) if partition is not None else []
        for (_, previous), (msg_id, again) in itertools.pairwise(by_id.items()):
            acked = next((p for p in previous if p.reply and p.reply in answered), None)
            if acked is None:
                continue
            since, until = previous[0].index, again[0].index
            if any(since < index < until for index in claimed):
                continue
            sent = answered[acked.reply]
            if any(sent < index < until for index in resets.get(publisher, [])):
                continue  # the ack may have been lost with the connection
            violations.append(
                f"handoff {handoff_id}: {publisher} published TimedOut again at"
                f" {again[0].at:.3f}s (Nats-Msg-Id {msg_id}), though its previous TimedOut, at"
                f" {previous[0].at:.3f}s, was acknowledged (the attempt at {acked.at:.3f}s), and"
                f" it did not claim partition {partition} in between"
            )
    return violations


@dataclass(frozen=True)
class _Expiry:
    """An engine's lease gone: the bucket's delete marker, and the TTL of the lease before it."""

    stored: StoredMessage
    ttl_s: float


def check_leases(history: History, log: ReplicatedLog, names: Names) -> list[str]:
    """No start naming an engine is accepted a lease TTL after that engine's lease expired."""
    stream, head = f"KV_{names.lease_bucket}", f"$KV.{names.lease_bucket}."
    # By engine: its lease's TTL as last stored, and its changes in history order (None: a
    # lease stored, so live; an `_Expiry`: gone).
    ttl_s: dict[str, float] = {}
    changes: dict[str, list[tuple[int, _Expiry | None]]] = {}
    for stored in history.stored:
        if stored.stream != stream or not stored.subject.startswith(head):
            continue
        engine = stored.subject.removeprefix(head)
        headers = stored.headers or {}
        if stored.payload and _MARKER_REASON not in headers and _KV_OPERATION not in headers:
            with contextlib.suppress(msgspec.DecodeError):
                ttl_s[engine] = _LEASE.decode(stored.payload).ttl_ms / 1000
            changes.setdefault(engine, []).append((stored.index, None))
        elif engine in ttl_s:
            changes.setdefault(engine, []).append((stored.index, _Expiry(stored, ttl_s[engine])))
    violations: list[str] = []
    for handoff_id, events in log.events.items():
        for event in events.values():
            record = event.record
            if not (isinstance(record, InputRecord) and isinstance(record.input, StartHandoff)):
                continue
            accepted = event.entry.stored
            for engine in dict.fromkeys((record.input.source, record.input.destination)):
                before = [c for at, c in changes.get(engine, []) if at < accepted.index]
                expiry = before[-1] if before else None
                if expiry is None or accepted.at - expiry.stored.at <= expiry.ttl_s:
                    continue
                violations.append(
                    f"handoff {handoff_id}: {event.entry.where()} accepted its start naming"
                    f" {engine} at {accepted.at:.3f}s, {accepted.at - expiry.stored.at:.3f}s"
                    f" after that engine's lease expired (its delete marker, seq"
                    f" {expiry.stored.seq} of {expiry.stored.subject}, at"
                    f" {expiry.stored.at:.3f}s), more than a lease TTL ({expiry.ttl_s:g}s): a"
                    " start naming an engine whose lease expired is rejected"
                )
    return violations


def check_hand_overs_claimed(log: ReplicatedLog, until_s: float, within_s: float) -> list[str]:
    """Every partition whose log, up to `until_s`, ends with a `HandedOver` stored more than
    `within_s` before it: nobody claimed it since, so nobody times out or retries its open
    handoffs (the owner's "Vacant partitions")."""
    last: dict[int, LogEntry] = {}
    for logged in log.entries:
        if logged.stored.at <= until_s:
            last[logged.partition] = logged
    return [
        f"{logged.where()}, at {logged.stored.at:.2f}s: nobody claimed the partition in the "
        f"{until_s - logged.stored.at:.2f}s after it"
        for logged in last.values()
        if isinstance(logged.entry, HandedOver) and logged.stored.at < until_s - within_s
    ]


def check_refused_pins(history: History) -> list[str]:
    """No pull asks again with a pin id after reading a 423 for it (see the module docstring)."""
    violations: list[str] = []
    asked: dict[str, str | None] = {}  # reply subject -> the pin id its request carried
    refused: dict[str, set[str]] = {}  # inbox -> the pin ids refused and not given back since
    told: set[str] = set()  # inboxes already reported: one line each
    records: list[PullAsked | PullRead] = [*history.pulls_asked, *history.pulls_read]
    for record in sorted(records, key=lambda record: record.index):
        match record:
            case PullAsked(reply=reply, payload=payload):
                pin_id = msgspec.json.decode(payload, type=PullRequest).id
                asked[reply] = pin_id
                inbox = reply.rpartition(".")[0]
                if pin_id in refused.get(inbox, ()) and inbox not in told:
                    told.add(inbox)
                    violations.append(
                        f"{record.process} asked {record.consumer} for messages (on {inbox}) with "
                        f"pin id {pin_id} at {record.at:.3f}s, after it read a 423 refusing it"
                    )
            case PullRead(refused=str(reply)):
                if (pin_id := asked.get(reply)) is not None:
                    refused.setdefault(record.inbox, set()).add(pin_id)
            case PullRead(pin_id=str(pin_id)):
                refused.get(record.inbox, set()).discard(pin_id)
    return violations


def check_final_states(log: ReplicatedLog, load: LoadReport | None = None) -> list[str]:
    """Each handoff's logged inputs, replayed through the core, re-derive its logged actions
    and end in the state its last row says; none is left open."""
    violations: list[str] = []
    ended: Counter[str] = Counter()
    for handoff_id, events in log.events.items():
        records = [(seq, events[seq].record) for seq in sorted(events)]
        rows = log.rows.get(handoff_id)
        if not rows:
            violations.append(f"handoff {handoff_id}: events logged without its row")
            continue
        state = rows[-1].state
        try:
            divergence = find_divergence(records)
            if divergence is not None:
                violations.append(
                    f"handoff {handoff_id}: replayed through the core, it diverges at step"
                    f" {divergence.step}: {divergence.detail}"
                )
                continue
            _, coordinator = rebuild(records)
        except (LogCorrupt, ReplayDivergence) as exc:
            violations.append(f"handoff {handoff_id}: its logged events do not replay: {exc}")
            continue
        completion = coordinator.completion if coordinator.is_complete else None
        expected = {
            HandoffCompletion.SUCCESS: HandoffState.SUCCEEDED,
            HandoffCompletion.CANCELED: HandoffState.CANCELED,
            None: HandoffState.OPEN,
        }[completion]
        if state is not expected:
            violations.append(
                f"handoff {handoff_id}: its last row says {rows[-1].state_name}, the core says"
                f" {expected.value} after its {len(records)} logged events"
            )
        if state is HandoffState.OPEN or state is HandoffState.QUARANTINED:
            violations.append(f"handoff {handoff_id}: is {rows[-1].state_name} at the end")
        ended[rows[-1].state_name] += 1
    if load is not None and not load.unreported and not load.timed_out:
        seen = (load.final.succeeded, load.final.canceled)
        logged = (ended[HandoffState.SUCCEEDED.value], ended[HandoffState.CANCELED.value])
        if seen != logged:
            violations.append(
                f"the frontend saw {seen[0]} handoffs succeed and {seen[1]} canceled; the log"
                f" ends {logged[0]} succeeded and {logged[1]} canceled"
            )
    return violations


def _meta(path: Path, key: str) -> str | None:
    """A partition file's meta value, read-only (`StoreError` if the file cannot say)."""
    try:
        with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot read its meta {key!r}: {exc}") from exc
    return None if row is None else str(row[0])


def _int(text: str) -> int:
    return int(text) if text.isdigit() else -1
