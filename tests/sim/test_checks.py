"""The checkers of a simulated run (worker.sim.checks): each catches the breach it is for.

Most breaches are made by hand, as a few stored entries of one partition's log; the rest by
mutating what one real short run recorded (its history and a copy of its workers' files),
which must itself pass every check.
"""

from __future__ import annotations

import dataclasses
import shutil
import sqlite3
from pathlib import Path
from uuid import UUID

import msgspec
import pytest

from kvhandoff.events.codec import decode_action, encode
from kvhandoff.events.leases import EngineLease
from kvhandoff.events.messages import Action, EngineType, StartHandoff, TimedOut
from kvhandoff.events.records import ActionRecord, InputRecord
from kvhandoff.worker.bus.pull import PullRequest
from kvhandoff.worker.log.rows import Batch, HandoffRow, Tombstone
from kvhandoff.worker.log.schema import HandoffState
from kvhandoff.worker.sim import checks, world
from kvhandoff.worker.sim.history import (
    AckedMessage,
    History,
    NakedMessage,
    PubAcked,
    Published,
    PullAsked,
    PullRead,
    StoredMessage,
)
from kvhandoff.worker.tier.entries import (
    MARK_KEY,
    Appended,
    Claimed,
    HandedOver,
    LoggedRows,
    LoggedState,
    Snapshot,
    decode_entry,
    decode_rows,
    encode_entry,
)

NAMES = checks.Names()
LOG = NAMES.log_stream
CAS = "Nats-Expected-Last-Subject-Sequence"
HANDOFF = UUID(int=7, version=4)


# --- Histories by hand -----------------------------------------------------------------------


class _Builder:
    """A history written by hand: each record takes the next index."""

    def __init__(self) -> None:
        self.history = History()
        self._index = 0
        self._seq: dict[str, int] = {}
        self.later_s = 0.0  # added to each record's time (`index / 10`): a wait, by hand

    def _next(self) -> int:
        self._index += 1
        return self._index

    def store(
        self, stream: str, subject: str, payload: bytes, headers: dict[str, str] | None
    ) -> StoredMessage:
        seq = self._seq[stream] = self._seq.get(stream, 0) + 1
        index = self._next()
        at = index / 10 + self.later_s
        stored = StoredMessage(index, at, stream, subject, seq, headers, payload)
        self.history.stored.append(stored)
        return stored

    def entry(self, partition: int, entry: object, *, cas: int | None) -> StoredMessage:
        headers = None if cas is None else {CAS: str(cas)}
        payload = encode_entry(entry)  # type: ignore[arg-type]
        return self.store(LOG, f"kvhandoff.log.{partition}", payload, headers)

    def input(self, partition: int, payload: bytes = b"{}") -> StoredMessage:
        return self.store(NAMES.input_stream, f"kvhandoff.inp.{partition}.{HANDOFF}", payload, None)

    def ack(self, seq: int) -> None:
        index = self._next()
        self.history.acked.append(
            AckedMessage(index, index / 10, NAMES.input_stream, "kvhandoff-worker-p0", seq, True)
        )

    def nak(self, seq: int) -> None:
        index = self._next()
        self.history.naked.append(
            NakedMessage(index, index / 10, NAMES.input_stream, "kvhandoff-worker-p0", seq)
        )

    def publish(
        self,
        subject: str,
        payload: bytes,
        *,
        wall_ms: int,
        reply: str = "",
        header: bytes | None = None,
    ) -> None:
        index = self._next()
        self.history.published.append(
            Published(index, index / 10, subject, reply, header, payload, "worker-0", wall_ms)
        )

    def pub_ack(self, reply: str, stream: str, seq: int) -> None:
        index = self._next()
        self.history.pub_acked.append(
            PubAcked(index, index / 10, reply, stream, seq, duplicate=False)
        )

    def pull(self, token: int, pin_id: str | None) -> None:
        index = self._next()
        payload = msgspec.json.encode(PullRequest(batch=1, group="g", id=pin_id))
        self.history.pulls_asked.append(
            PullAsked(index, index / 10, "worker-0", "S.C", f"_INBOX.i.{token}", payload)
        )

    def refusal_read(self, token: int) -> None:
        index = self._next()
        self.history.pulls_read.append(
            PullRead(index, index / 10, "worker-0", "_INBOX.i", f"_INBOX.i.{token}", None)
        )

    def pin_read(self, pin_id: str) -> None:
        index = self._next()
        self.history.pulls_read.append(
            PullRead(index, index / 10, "worker-0", "_INBOX.i", None, pin_id)
        )


def _claimed(epoch: int) -> Claimed:
    return Claimed(epoch=epoch, owner=f"worker-{epoch}/i", at_ms=0)


def _rows(inputs: list[int], batch: Batch | None = None) -> bytes:
    return encode_entry(LoggedRows.of(inputs, batch or Batch(), [], []))


def _appended(epoch: int, inputs: list[int], batch: Batch | None = None) -> Appended:
    return Appended(epoch=epoch, inputs=inputs, records=_rows(inputs, batch))


def _violations(built: _Builder) -> list[str]:
    return checks.check_run(built.history, None)


def test_a_log_whose_appends_form_one_chain_passes() -> None:
    built = _Builder()
    seq = built.input(0).seq
    built.entry(0, _claimed(1), cas=0)
    built.entry(0, _appended(1, [seq]), cas=1)
    built.ack(seq)
    built.entry(0, HandedOver(epoch=1, owner="worker-1/i", at_ms=0), cas=2)
    built.entry(0, _claimed(2), cas=3)
    assert _violations(built) == []


def test_an_append_without_compare_and_set_breaks_the_chain() -> None:
    built = _Builder()
    built.entry(0, _claimed(1), cas=0)
    built.entry(0, _appended(1, []), cas=None)
    assert _violations(built) == [
        "partition 0: Appended at seq 2 of kvhandoff.log.0 was stored without compare-and-set:"
        " it names no previous entry (the subject's last was seq 1)"
    ]


def test_an_append_naming_another_previous_entry_is_a_fork() -> None:
    built = _Builder()
    built.entry(0, _claimed(1), cas=0)
    built.entry(1, _claimed(1), cas=0)  # another subject: its own chain, and seq 2 of the stream
    built.entry(0, _appended(1, []), cas=2)
    assert _violations(built) == [
        "partition 0: Appended at seq 3 of kvhandoff.log.0 names seq 2 as its previous entry,"
        " but the subject's last was seq 1: a fork"
    ]


def test_a_claim_whose_epoch_goes_back_is_caught() -> None:
    built = _Builder()
    built.entry(0, _claimed(2), cas=0)
    built.entry(0, _claimed(2), cas=1)
    assert _violations(built) == [
        "partition 0: Claimed at seq 2 of kvhandoff.log.0 claims epoch 2, not above epoch 2"
        " claimed before: the generation went back"
    ]


def test_a_fenced_owners_append_that_succeeded_is_caught() -> None:
    built = _Builder()
    built.entry(0, _claimed(1), cas=0)
    built.entry(0, _claimed(2), cas=1)
    built.entry(0, _appended(1, []), cas=2)
    built.entry(0, _appended(3, []), cas=3)
    assert _violations(built) == [
        "partition 0: Appended at seq 3 of kvhandoff.log.0 is epoch 1's, stored after epoch 2"
        " claimed the partition: a fenced owner's append succeeded",
        "partition 0: Appended at seq 4 of kvhandoff.log.0 is of epoch 3, which nobody claimed",
    ]


def test_an_input_applied_twice_or_in_another_partition_is_caught() -> None:
    built = _Builder()
    seq = built.input(1).seq  # stream seq 1, in partition 1
    built.entry(0, _claimed(1), cas=0)
    built.entry(0, _appended(1, [seq]), cas=1)
    built.entry(1, _claimed(1), cas=0)
    built.entry(1, _appended(1, [seq, 9]), cas=3)
    assert _violations(built) == [
        "partition 0: Appended at seq 2 of kvhandoff.log.0 applies input 1 of"
        f" kvhandoff.inp.1.{HANDOFF}, another partition's",
        "input 1 is applied twice: by partition 0: Appended at seq 2 of kvhandoff.log.0 and by"
        " partition 1: Appended at seq 4 of kvhandoff.log.1",
        "partition 1: Appended at seq 4 of kvhandoff.log.1 applies input 9, which was never stored",
    ]


def test_an_event_sequence_logged_by_two_entries_is_caught() -> None:
    start = StartHandoff(HANDOFF, EngineType.VLLM, "prefill-0", "decode-0", 10_000)
    built = _Builder()
    built.entry(0, _claimed(1), cas=0)
    for cas in (1, 2):
        batch = Batch()
        batch.append_input(0, InputRecord(cas, start), str(HANDOFF))
        built.entry(0, _appended(1, [], batch), cas=cas)
    assert _violations(built)[0] == (
        f"partition 0: Appended at seq 3 of kvhandoff.log.0: handoff {HANDOFF}: event 0 logged"
        " again, first by partition 0: Appended at seq 2 of kvhandoff.log.0: two events at one"
        " sequence"
    )


def _snapshot_after_a_start(tombstones: list[Tombstone], *, started_ms: int) -> list[str]:
    """A partition whose log starts HANDOFF (logged at `started_ms`), then snapshots at 400 s
    a state with no rows and `tombstones`."""
    start = StartHandoff(HANDOFF, EngineType.VLLM, "prefill-0", "decode-0", 10_000)
    built = _Builder()
    built.entry(0, _claimed(1), cas=0)
    batch = Batch()
    batch.append_input(0, InputRecord(started_ms, start), str(HANDOFF))
    built.entry(0, _appended(1, [], batch), cas=1)
    state = encode_entry(LoggedState(None, [], [], [], tombstones))
    snapshot = Snapshot(epoch=1, owner="worker-1/i", at_ms=400_000, applied=[], records=state)
    built.entry(0, snapshot, cas=2)
    return checks.check_snapshots(checks.ReplicatedLog.read(built.history, NAMES), 300.0)


def test_a_snapshot_that_forgets_a_handoff_its_log_started_is_caught() -> None:
    assert _snapshot_after_a_start([], started_ms=390_000) == [
        f"handoff {HANDOFF}: partition 0: Snapshot at seq 3 of kvhandoff.log.0 holds neither its"
        " row nor its tombstone, though the log before it started the handoff 10000 ms before"
    ]


def test_a_snapshot_that_keeps_the_tombstone_or_forgets_an_old_start_passes() -> None:
    tombstone = Tombstone(HANDOFF, "succeeded", 395_000, [])
    assert _snapshot_after_a_start([tombstone], started_ms=390_000) == []
    # Started more than half the tombstone TTL before the snapshot: it may have ended, and
    # been forgotten, long before.
    assert _snapshot_after_a_start([], started_ms=240_000) == []


def test_a_handoffs_input_applied_after_one_stored_later_is_caught() -> None:
    built = _Builder()
    orphan, newer = built.input(0).seq, built.input(0).seq
    built.entry(0, _claimed(1), cas=0)
    built.entry(0, _appended(1, [newer]), cas=1)
    built.entry(0, _appended(1, [orphan]), cas=2)
    assert _violations(built) == [
        f"handoff {HANDOFF}: input {orphan} is applied by partition 0: Appended at seq 3 of "
        f"kvhandoff.log.0, after input {newer}, stored later, by partition 0: Appended at seq 2"
        " of kvhandoff.log.0: out of stream order, and no nak gave it back"
    ]


def test_an_input_a_nak_gave_back_may_come_after_newer_ones() -> None:
    built = _Builder()
    early, newer = built.input(0).seq, built.input(0).seq
    built.nak(early)
    built.entry(0, _claimed(1), cas=0)
    built.entry(0, _appended(1, [newer]), cas=1)
    built.entry(0, _appended(1, [early]), cas=2)
    assert _violations(built) == []


def test_an_ack_before_the_append_or_without_one_is_caught() -> None:
    built = _Builder()
    first, second = built.input(0).seq, built.input(0).seq
    built.entry(0, _claimed(1), cas=0)
    built.ack(first)  # index 4, at 0.4s: before the append that applies it
    built.entry(0, _appended(1, [first]), cas=1)
    built.ack(second)  # at 0.6s: appended by nobody
    assert _violations(built) == [
        "input 1 was acknowledged (by kvhandoff-worker-p0 at 0.400s) before the log entry that"
        " applied it was stored",
        "input 2 was acknowledged (by kvhandoff-worker-p0 at 0.600s) but no log entry applied it",
    ]


def _timed_out_rows(seqs: list[int]) -> Batch:
    batch = Batch()
    for seq in seqs:
        batch.append_input(seq, InputRecord(0, TimedOut(handoff_id=HANDOFF)))
    return batch


def _timers(built: _Builder) -> list[str]:
    return checks.check_timers(
        built.history, checks.ReplicatedLog.read(built.history, NAMES), NAMES
    )


def test_a_timer_logged_twice_is_caught() -> None:
    built = _Builder()
    built.entry(0, _claimed(1), cas=0)
    built.entry(0, _appended(1, [], _timed_out_rows([1, 2])), cas=1)
    found = checks.check_timers(
        built.history, checks.ReplicatedLog.read(built.history, NAMES), NAMES
    )
    assert found == [f"handoff {HANDOFF}: TimedOut is logged 2 times, at seqs [1, 2]"]


def test_a_timer_published_before_its_deadline_is_caught() -> None:
    built = _Builder()
    batch = Batch()
    start = StartHandoff(
        handoff_id=HANDOFF,
        engine_type=EngineType.VLLM,
        source="a",
        destination="b",
        deadline_ms=1000,
    )
    batch.append_input(0, InputRecord(5000, start))
    batch.upsert_handoff(
        HandoffRow(HANDOFF, "vllm", "a", "b", 5000, 6000, HandoffState.OPEN, None, 0, 5000)
    )
    built.entry(0, _claimed(1), cas=0)
    built.entry(0, _appended(1, [], batch), cas=1)
    timed_out = encode(TimedOut(handoff_id=HANDOFF))
    built.publish(f"kvhandoff.in.{HANDOFF}", timed_out, wall_ms=5999)  # 1 ms early
    built.publish(f"kvhandoff.in.{HANDOFF}", timed_out, wall_ms=6000)  # due
    found = checks.check_timers(
        built.history, checks.ReplicatedLog.read(built.history, NAMES), NAMES
    )
    assert found == [
        f"handoff {HANDOFF}: worker-0 published TimedOut at 0.300s, 1 ms before its deadline by"
        " its own clock"
    ]


def _timed_out_by(built: _Builder, msg_id: str, reply: str, *, acked: bool) -> None:
    """worker-0 publishes the handoff's TimedOut under `msg_id`, acknowledged or not."""
    subject = f"kvhandoff.in.{HANDOFF}"
    header = f"NATS/1.0\r\nNats-Msg-Id: {msg_id}\r\n\r\n".encode()
    built.publish(
        subject, encode(TimedOut(handoff_id=HANDOFF)), wall_ms=0, reply=reply, header=header
    )
    if acked:
        built.pub_ack(reply, NAMES.input_stream, 1)


def _timed_out_again(built: _Builder) -> list[str]:
    return checks.check_timed_out_again(
        built.history, checks.ReplicatedLog.read(built.history, NAMES), NAMES
    )


def _handoff_in_partition_0(built: _Builder) -> None:
    built.entry(0, _claimed(1), cas=0)
    built.entry(0, _appended(1, [], _timed_out_rows([1])), cas=1)


def test_a_timed_out_published_again_after_its_ack_is_caught() -> None:
    built = _Builder()
    _handoff_in_partition_0(built)
    _timed_out_by(built, "a", "_INBOX.1", acked=True)
    _timed_out_by(built, "b", "_INBOX.2", acked=False)
    assert _timed_out_again(built) == [
        f"handoff {HANDOFF}: worker-0 published TimedOut again at 0.500s (Nats-Msg-Id b),"
        " though its previous TimedOut, at 0.300s, was acknowledged (the attempt at 0.300s),"
        " and it did not claim partition 0 in between"
    ]


def test_a_timed_out_published_again_after_no_ack_or_a_claim_passes() -> None:
    built = _Builder()
    _handoff_in_partition_0(built)
    # Two attempts of one publish, neither acknowledged: one publish, then a new one.
    _timed_out_by(built, "a", "_INBOX.1", acked=False)
    _timed_out_by(built, "a", "_INBOX.2", acked=False)
    _timed_out_by(built, "b", "_INBOX.3", acked=True)
    # Acknowledged, but worker-0 claimed the partition again before it fired again.
    built.entry(0, Claimed(epoch=2, owner="worker-0/j", at_ms=0), cas=2)
    _timed_out_by(built, "c", "_INBOX.4", acked=True)
    assert _timed_out_again(built) == []
    # Another worker's claim is no claim of worker-0's.
    built.entry(0, _claimed(3), cas=3)
    _timed_out_by(built, "d", "_INBOX.5", acked=False)
    assert [v.split(" (Nats")[0] for v in _timed_out_again(built)] == [
        f"handoff {HANDOFF}: worker-0 published TimedOut again at 1.100s"
    ]


LEASES = f"KV_{NAMES.lease_bucket}"


def _lease(built: _Builder, engine: str, *, ttl_s: float = 5.0) -> None:
    lease = EngineLease(engine_id=engine, incarnation="i", ttl_ms=int(ttl_s * 1000))
    headers = {"Nats-TTL": f"{ttl_s:g}s"}
    built.store(LEASES, f"$KV.{NAMES.lease_bucket}.{engine}", msgspec.json.encode(lease), headers)


def _expired(built: _Builder, engine: str) -> None:
    headers = {"Nats-Marker-Reason": "MaxAge", "Nats-Rollup": "sub", "Nats-TTL": "86400s"}
    built.store(LEASES, f"$KV.{NAMES.lease_bucket}.{engine}", b"", headers)


def _started(built: _Builder, cas: int, *, source: str = "a", destination: str = "b") -> None:
    batch = Batch()
    start = StartHandoff(HANDOFF, EngineType.VLLM, source, destination, deadline_ms=10_000)
    batch.append_input(0, InputRecord(0, start))
    batch.upsert_handoff(
        HandoffRow(HANDOFF, "vllm", source, destination, 0, 10_000, HandoffState.OPEN, None, 0, 0)
    )
    built.entry(0, _appended(1, [], batch), cas=cas)


def _leases(built: _Builder) -> list[str]:
    return checks.check_leases(
        built.history, checks.ReplicatedLog.read(built.history, NAMES), NAMES
    )


def test_a_start_naming_an_engine_expired_for_a_lease_ttl_is_caught() -> None:
    built = _Builder()
    _lease(built, "a")
    _lease(built, "b")
    built.entry(0, _claimed(1), cas=0)
    _expired(built, "b")  # at 0.4s
    built.later_s = 5.0  # the start comes 5.1s later: past the TTL of 5s
    _started(built, cas=1)
    assert _leases(built) == [
        f"handoff {HANDOFF}: partition 0: Appended at seq 2 of kvhandoff.log.0 accepted its"
        " start naming b at 5.500s, 5.100s after that engine's lease expired (its delete marker,"
        f" seq 3 of $KV.{NAMES.lease_bucket}.b, at 0.400s), more than a lease TTL (5s): a start"
        " naming an engine whose lease expired is rejected"
    ]


def test_a_start_within_a_lease_ttl_of_the_expiry_or_after_a_new_lease_passes() -> None:
    # The watch may deliver the marker late, by up to a TTL: a start meanwhile is no breach.
    built = _Builder()
    _lease(built, "a")
    _lease(built, "b")
    built.entry(0, _claimed(1), cas=0)
    _expired(built, "b")
    built.later_s = 4.9
    _started(built, cas=1)
    assert _leases(built) == []
    # Nor is one after the engine took its lease again, however long after.
    built = _Builder()
    _lease(built, "b")
    built.entry(0, _claimed(1), cas=0)
    _expired(built, "b")
    built.later_s = 60.0
    _lease(built, "b")
    _started(built, cas=1, source="b", destination="b")
    assert _leases(built) == []


def test_a_pull_asking_with_a_pin_id_it_read_refused_is_caught() -> None:
    built = _Builder()
    built.pull(0, "x")
    built.refusal_read(0)
    built.pull(1, "x")
    built.pull(2, "x")  # reported once per inbox
    assert checks.check_refused_pins(built.history) == [
        "worker-0 asked S.C for messages (on _INBOX.i) with pin id x at 0.300s, after it read "
        "a 423 refusing it"
    ]


def test_a_refused_pin_id_asked_before_the_refusal_was_read_or_served_again_passes() -> None:
    built = _Builder()
    built.pull(0, "x")
    built.pull(1, "x")  # asked before the 423 of the first was read: it is on its way
    built.refusal_read(0)
    built.refusal_read(1)
    built.pull(2, None)  # asks to be pinned anew
    built.pin_read("y")
    built.pull(3, "y")
    built.refusal_read(3)
    built.pin_read("x")  # a message served under the old pin (ADR-42: no exclusivity)
    built.pull(4, "x")
    assert checks.check_refused_pins(built.history) == []


# --- A real run, and its mutations -----------------------------------------------------------


@dataclasses.dataclass
class _Run:
    outcome: world.Outcome
    history: History
    files: Path  # a copy of the run's work directory, taken when the checks ran


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> _Run:
    """One short run, its history and its files, taken where `simulate` checks them."""
    kept: dict[str, object] = {}
    files = tmp_path_factory.mktemp("run") / "work"

    def spy(history: History, workdir: Path, **options: object) -> list[str]:
        kept["history"] = history
        shutil.copytree(workdir, files)
        return checks.check_run(history, workdir, **options)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(world, "check_run", spy)
        outcome = world.simulate(world.Scenario(1, duration_s=10, rate_per_s=2))
    history = kept["history"]
    assert isinstance(history, History)
    return _Run(outcome, history, files)


def test_a_real_run_breaks_no_invariant(run: _Run) -> None:
    assert run.outcome.violations == []
    log = checks.ReplicatedLog.read(run.history, NAMES)
    # What it checked: every kind of entry, every handoff, every partition's file.
    kinds = {type(logged.entry).__name__ for logged in log.entries}
    assert kinds == {"Claimed", "Appended", "HandedOver", "Snapshot"}
    # Every handoff but those whose start was rejected (an engine whose lease expired): those
    # leave a rejection, no events.
    load = run.outcome.load
    assert load is not None and len(log.events) == load.handoffs - load.rejected
    held = {int(path.stem.removeprefix("partition-")) for path in run.files.rglob("*.db")}
    assert held == set(range(world.Scenario(1).partitions))  # a file of each, on some worker
    assert checks.check_run(run.history, run.files, load=run.outcome.load) == []
    # The client's side: every Pull's requests, and the pins its messages carried.
    assert {asked.reply.rpartition(".")[0] for asked in run.history.pulls_asked} >= {
        read.inbox for read in run.history.pulls_read
    }
    assert sum(read.pin_id is not None for read in run.history.pulls_read) >= 16


def _actions(history: History) -> list[Published]:
    return [p for p in history.published if ".engine." in p.subject and p.payload]


def _kind(tag: str) -> str:
    """An action's type name from its tag: `start_transfer` is StartTransfer."""
    return "".join(word.capitalize() for word in tag.split("_"))


def test_an_action_published_before_its_append_or_never_logged_is_caught(run: _Run) -> None:
    first = _actions(run.history)[0]
    early = dataclasses.replace(first, index=-1)
    forged = msgspec.json.decode(first.payload) | {"action_id": 99}
    unlogged = dataclasses.replace(first, payload=msgspec.json.encode(forged))
    history = dataclasses.replace(run.history, published=[early, unlogged])
    log = checks.ReplicatedLog.read(history, NAMES)
    found = checks.check_actions(history, log, NAMES)
    action = msgspec.json.decode(first.payload)
    what = f"handoff {action['handoff_id']}: action {{}} ({_kind(action['type'])}) published by"
    by = f" {first.publisher} at {first.at:.3f}s"
    assert len(found) == 2
    assert found[0].startswith(what.format(action["action_id"]) + by + " before partition ")
    assert found[0].endswith(" logged it")
    assert found[1] == what.format(99) + by + " is in no appended entry"


def test_an_action_sent_to_another_engine_is_caught(run: _Run) -> None:
    first = _actions(run.history)[0]
    moved = dataclasses.replace(first, subject="kvhandoff.engine.elsewhere.actions")
    history = dataclasses.replace(run.history, published=[moved])
    found = checks.check_actions(history, checks.ReplicatedLog.read(history, NAMES), NAMES)
    assert len(found) == 1
    assert found[0].endswith(f"went to kvhandoff.engine.elsewhere.actions, not to {first.subject}")


def test_an_outbox_mark_of_an_action_the_server_never_read_is_caught(run: _Run) -> None:
    # The real run's marks are each of an action the server read before: as if a reset had
    # swallowed the publish of one that an entry marks, that action's publishes are dropped.
    log = checks.ReplicatedLog.read(run.history, NAMES)
    assert checks.check_outbox_marks(run.history, log, NAMES) == []
    marking, (handoff_id, mark, _) = next(
        (entry, marked)
        for entry in log.entries
        if entry.rows is not None
        for marked in entry.rows.published
    )
    swallowed = [
        event.record.action
        for seq, event in sorted(log.events[handoff_id].items())
        if seq <= mark and isinstance(event.record, ActionRecord)
    ][-1]
    history = dataclasses.replace(
        run.history,
        published=[p for p in run.history.published if not _publishes(p, swallowed)],
    )
    found = checks.check_outbox_marks(history, checks.ReplicatedLog.read(history, NAMES), NAMES)
    assert found == [
        f"handoff {handoff_id}: {marking.where()} marks action {swallowed.action_id}"
        f" ({type(swallowed).__name__}) published, though the server had not read it"
    ]


def _publishes(published: Published, action: Action) -> bool:
    to = ("kvhandoff.engine.", "kvhandoff.done.")
    return (
        published.subject.startswith(to)
        and bool(published.payload)  # not a probe of who listens
        and decode_action(published.payload) == action
    )


def _copy(run: _Run, tmp_path: Path) -> Path:
    files = tmp_path / "work"
    shutil.copytree(run.files, files)
    return files


def _marked(path: Path) -> bool:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT 1 FROM meta WHERE key = ?", (MARK_KEY,)).fetchone() is not None


def test_a_file_whose_mark_the_log_lacks_is_caught(run: _Run, tmp_path: Path) -> None:
    files = _copy(run, tmp_path)
    path = next(p for p in sorted(files.rglob("partition-*.db")) if _marked(p))
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = '999999' WHERE key = ?", (MARK_KEY,))
    found = checks.check_files(files, checks.ReplicatedLog.read(run.history, NAMES))
    partition = path.stem.removeprefix("partition-")
    assert found == [
        f"{path.relative_to(files)}: its mark, input 999999, begins no entry of partition"
        f" {partition}'s log"
    ]


def _holds_events(path: Path) -> bool:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT 1 FROM events LIMIT 1").fetchone() is not None


def test_a_file_that_is_no_prefix_of_the_log_is_caught(run: _Run, tmp_path: Path) -> None:
    files = _copy(run, tmp_path)
    path = next(p for p in sorted(files.rglob("partition-*.db")) if _holds_events(p))
    with sqlite3.connect(path) as db:
        handoff_key, seq, at_ms = db.execute(
            "SELECT handoff_key, seq, at_ms FROM events ORDER BY handoff_key, seq LIMIT 1"
        ).fetchone()
        db.execute(
            "UPDATE events SET at_ms = ? WHERE handoff_key = ? AND seq = ?",
            (at_ms + 1, handoff_key, seq),
        )
        (handoff,) = db.execute(
            "SELECT handoff_id FROM handoffs WHERE handoff_key = ?", (handoff_key,)
        ).fetchone()
    found = checks.check_files(files, checks.ReplicatedLog.read(run.history, NAMES))
    assert len(found) == 1
    assert found[0].startswith(
        f"{path.relative_to(files)}: handoff {handoff}: event {seq} differs from the one partition "
    )


def test_a_last_row_the_core_disagrees_with_is_caught(run: _Run) -> None:
    """The log's last row of a handoff that succeeded, rewritten to say it was canceled."""
    history = dataclasses.replace(run.history, stored=list(run.history.stored))
    for position in range(len(history.stored) - 1, -1, -1):
        stored = history.stored[position]
        if stored.stream != LOG:
            continue
        entry = decode_entry(stored.payload, "test")
        if not isinstance(entry, Appended):
            continue
        rows = decode_rows(entry.records, "test")
        done = [row for row in rows.handoffs if row.state is HandoffState.SUCCEEDED]
        if done:
            break
    else:
        pytest.fail("no handoff succeeded in the run")
    handoff = done[0].handoff_id
    canceled = [
        msgspec.structs.replace(row, state=HandoffState.CANCELED)
        if row.handoff_id == handoff
        else row
        for row in rows.handoffs
    ]
    records = encode_entry(msgspec.structs.replace(rows, handoffs=canceled))
    payload = encode_entry(msgspec.structs.replace(entry, records=records))
    history.stored[position] = dataclasses.replace(stored, payload=payload)
    found = checks.check_final_states(checks.ReplicatedLog.read(history, NAMES), run.outcome.load)
    events = len(checks.ReplicatedLog.read(history, NAMES).events[handoff])
    assert run.outcome.load is not None
    seen = run.outcome.load.final
    assert found == [
        f"handoff {handoff}: its last row says canceled, the core says succeeded after its"
        f" {events} logged events",
        f"the frontend saw {seen.succeeded} handoffs succeed and {seen.canceled} canceled; the"
        f" log ends {seen.succeeded - 1} succeeded and {seen.canceled + 1} canceled",
    ]


def _unclaimed(built: _Builder, until_s: float) -> list[str]:
    log = checks.ReplicatedLog.read(built.history, NAMES)
    return checks.check_hand_overs_claimed(log, until_s=until_s, within_s=15.0)


def test_a_partition_handed_over_and_never_claimed_again_is_caught() -> None:
    built = _Builder()
    built.entry(0, _claimed(1), cas=0)  # at 0.1 s
    built.entry(0, HandedOver(epoch=1, owner="worker-1/i", at_ms=0), cas=1)  # at 0.2 s
    built.entry(1, _claimed(1), cas=0)
    [broke] = _unclaimed(built, until_s=30.0)
    assert broke.startswith("partition 0: HandedOver at seq 2 of kvhandoff.log.0, at 0.20s")
    # Within its time to be claimed again, a hand-over is not a breach yet.
    assert _unclaimed(built, until_s=15.1) == []


def test_a_hand_over_claimed_again_or_after_the_workers_began_to_stop_passes() -> None:
    built = _Builder()
    built.entry(0, _claimed(1), cas=0)
    built.entry(0, HandedOver(epoch=1, owner="worker-1/i", at_ms=0), cas=1)
    built.entry(0, _claimed(2), cas=2)
    built.later_s = 40.0  # the workers' own hand-overs as they stop, after `until_s`
    built.entry(0, HandedOver(epoch=2, owner="worker-2/i", at_ms=0), cas=3)
    assert _unclaimed(built, until_s=30.0) == []
