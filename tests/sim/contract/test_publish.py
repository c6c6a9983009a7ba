"""Contracts of JetStream publishing: durable publishes and their dedup, the compare-and-set
append that fences a partition's owner, roll-ups, and reading a subject back.

    contract                                        tier code that relies on it
    a publish with a `Nats-Msg-Id` is stored once:  bus.publish._store's retries (publish_
      a duplicate is answered with the first's        durable, put_expiring), tier.leases'
      sequence                                        answers (one msg id from any worker)
    a message id is forgotten after the stream's    the input and log streams' windows
      duplicate window                                (tier.streams)
    `append_expecting` is stored at the subject's   tier.ownership (claim, append, hand over):
      last sequence, `Fenced` at any other; other     the fence; the partitions' logs share
      subjects' appends do not count                  one stream
    a retried append is checked against its         bus.publish "Fencing" (a lost ack): on a
      expected sequence before its msg id (single     single server the writer fences itself
      server): stale, `Fenced`; else the duplicate
    an append with rollup leaves only itself on     tier.ownership.snapshot (one message)
      its subject; refused where rollups are not
    an atomic roll-up batch replaces its subject,   tier.ownership.snapshot (a state larger
      all or nothing, under the compare-and-set      than a message)
    `last_sequence`, `last_message`, `read_subject` tier.ownership's catch-up (read_entries),
      read a subject's last and every message         client.connection's last completion
    `publish_stored` acks are the stored sequences; tier.partition's actions (`confirm`)
      a subject no stream takes fails its ack and
      the flush
"""

from __future__ import annotations

import pytest

from kvhandoff.worker.bus.streams import (
    StreamSpec,
    create_stream,
    last_message,
    last_sequence,
    read_subject,
)
from kvhandoff.worker.errors import BusError, Fenced
from kvhandoff.worker.tier.streams import open_partition_log
from tests.sim.contract.backend import Backend, contract
from tests.sim.contract.observe import stream_state

_MSG_ID = "Nats-Msg-Id"
_EXPECTED = "Nats-Expected-Last-Subject-Sequence"


async def _log(backend: Backend, name: str = "log") -> tuple[str, str]:
    """A fresh log stream as the tier makes it, and its subject prefix."""
    bus = await backend.connect(name)
    prefix, stream = backend.fresh("p"), backend.fresh("LOG")
    await open_partition_log(bus, stream, prefix)
    return prefix, stream


@contract
async def test_a_publish_with_a_message_id_is_stored_once(backend: Backend) -> None:
    bus = await backend.connect("publisher")
    stream, subjects = backend.fresh("S"), backend.fresh("s")
    assert await create_stream(bus, StreamSpec(name=stream, subjects=(f"{subjects}.>",)))
    first = await bus._store(f"{subjects}.a", b"one", {_MSG_ID: "m1"}, 5.0, "first")
    again = await bus._store(f"{subjects}.a", b"other", {_MSG_ID: "m1"}, 5.0, "again")
    other = await bus._store(f"{subjects}.b", b"two", {_MSG_ID: "m2"}, 5.0, "another id")
    assert (first, again, other) == (1, 1, 2)
    # Two workers answering for one gone engine: one message, whichever was first.
    await bus.publish_durable(f"{subjects}.c", b"three", msg_id="answer")
    await bus.publish_durable(f"{subjects}.c", b"three, again", msg_id="answer")
    state = await stream_state(bus, stream)
    assert (state["messages"], state["last_seq"]) == (3, 3)
    assert await last_message(bus, stream, f"{subjects}.a") == b"one"
    assert await last_message(bus, stream, f"{subjects}.c") == b"three"


@contract
async def test_a_message_id_is_forgotten_after_the_duplicate_window(backend: Backend) -> None:
    bus = await backend.connect("publisher")
    stream, subject = backend.fresh("S"), backend.fresh("s")
    window_s = 1.0
    spec = StreamSpec(name=stream, subjects=(subject,), duplicate_window_s=window_s)
    assert await create_stream(bus, spec)
    assert await bus._store(subject, b"x", {_MSG_ID: "m"}, 5.0, "first") == 1
    await backend.advance(window_s / 2)
    assert await bus._store(subject, b"x", {_MSG_ID: "m"}, 5.0, "within") == 1
    await backend.advance(window_s)  # 1.5 windows after the first
    assert await bus._store(subject, b"x", {_MSG_ID: "m"}, 5.0, "after") == 2


@contract
async def test_an_append_is_stored_at_its_subjects_last_sequence_and_fenced_at_any_other(
    backend: Backend,
) -> None:
    prefix, stream = await _log(backend)
    owner, rival = await backend.connect("owner"), await backend.connect("rival")
    log, other = f"{prefix}.log.0", f"{prefix}.log.1"

    claimed = await owner.append_expecting(log, b"claimed by owner", 0)
    with pytest.raises(Fenced, match=f"append to {log} expecting last sequence 0"):
        await rival.append_expecting(log, b"claimed by rival", 0)
    entry = await owner.append_expecting(log, b"entry", claimed)
    # Another partition's appends move the stream's last sequence, not this subject's.
    elsewhere = await rival.append_expecting(other, b"claimed p1", 0)
    assert elsewhere == entry + 1
    taken = await rival.append_expecting(log, b"claimed by rival", entry)
    assert taken == elsewhere + 1
    with pytest.raises(Fenced):  # the fenced owner's next append
        await owner.append_expecting(log, b"entry", entry)
    assert [seq for seq, _ in await read_subject(owner, stream, log)] == [claimed, entry, taken]
    with pytest.raises(Fenced):  # 0: "the subject has no message", which it has
        await owner.append_expecting(other, b"claimed p1 again", 0)


@contract
async def test_on_a_single_server_a_retried_append_is_checked_against_its_expectation_first(
    backend: Backend,
) -> None:
    """A retried append whose first attempt landed: a single server (this suite's) checks the
    expected last subject sequence before the message id, so the retry is refused as stale
    (`Fenced`: the writer fences itself); a retry whose expectation still holds, or that has
    none, is answered as the duplicate it is. (A clustered stream checks the message id first,
    jetstream_cluster.go's `checkMsgHeadersPreClusteredProposal`, and answers the first
    retry as a duplicate too, as worker.bus.publish's "Fencing" says; not checked here.)"""
    prefix, stream = await _log(backend)
    bus = await backend.connect("owner")
    log = f"{prefix}.log.0"
    first = await bus._store(log, b"claimed", {_MSG_ID: "attempt", _EXPECTED: "0"}, 5.0, "1st")
    with pytest.raises(Fenced, match=f"wrong last sequence: {first}"):
        await bus._store(log, b"claimed", {_MSG_ID: "attempt", _EXPECTED: "0"}, 5.0, "retry")
    assert (
        await bus._store(log, b"x", {_MSG_ID: "attempt", _EXPECTED: str(first)}, 5.0, "") == first
    )
    assert await bus._store(log, b"x", {_MSG_ID: "attempt"}, 5.0, "without expectation") == first
    assert await read_subject(bus, stream, log) == [(first, b"claimed")]


@contract
async def test_an_append_with_rollup_leaves_only_itself_on_its_subject(backend: Backend) -> None:
    prefix, stream = await _log(backend)
    bus = await backend.connect("owner")
    log, other = f"{prefix}.log.0", f"{prefix}.log.1"
    last = 0
    for n in range(3):
        last = await bus.append_expecting(log, b"entry %d" % n, last)
    beside = await bus.append_expecting(other, b"other partition", 0)
    with pytest.raises(Fenced):  # a roll-up is a compare-and-set like any append
        await bus.append_expecting(log, b"snapshot", last - 1, rollup=True)
    snapshot = await bus.append_expecting(log, b"snapshot", last, rollup=True)
    assert await read_subject(bus, stream, log) == [(snapshot, b"snapshot")]
    assert await read_subject(bus, stream, other) == [(beside, b"other partition")]
    assert await bus.append_expecting(log, b"after", snapshot) == snapshot + 1
    assert (await stream_state(bus, stream))["messages"] == 3

    # A stream that does not allow rollups refuses one: an error, not a fence.
    plain, subject = backend.fresh("S"), backend.fresh("s")
    assert await create_stream(bus, StreamSpec(name=plain, subjects=(subject,)))
    seq = await bus.append_expecting(subject, b"entry", 0)
    with pytest.raises(BusError) as refused:
        await bus.append_expecting(subject, b"snapshot", seq, rollup=True)
    assert not isinstance(refused.value, Fenced)
    assert await read_subject(bus, plain, subject) == [(seq, b"entry")]


@contract
async def test_an_atomic_roll_up_batch_replaces_its_subject_all_or_nothing(
    backend: Backend,
) -> None:
    prefix, stream = await _log(backend)
    bus = await backend.connect("owner")
    log, other = f"{prefix}.log.0", f"{prefix}.log.1"
    last = 0
    for n in range(2):
        last = await bus.append_expecting(log, b"entry %d" % n, last)
    beside = await bus.append_expecting(other, b"other partition", 0)

    parts = [b"part 1", b"part 2", b"part 3"]
    with pytest.raises(Fenced):
        await bus.roll_up_batch(log, parts, last - 1)
    assert [data for _, data in await read_subject(bus, stream, log)] == [b"entry 0", b"entry 1"]

    top = await bus.roll_up_batch(log, parts, last)
    assert await read_subject(bus, stream, log) == [
        (top - 2, b"part 1"),
        (top - 1, b"part 2"),
        (top, b"part 3"),
    ]
    assert await read_subject(bus, stream, other) == [(beside, b"other partition")]
    assert await last_sequence(bus, stream, log) == top
    assert await bus.append_expecting(log, b"after", top) == top + 1


@contract
async def test_a_subjects_last_message_its_sequence_and_all_of_it_are_read(
    backend: Backend,
) -> None:
    prefix, stream = await _log(backend)
    bus = await backend.connect("reader")
    log, other = f"{prefix}.log.0", f"{prefix}.log.1"
    assert await last_sequence(bus, stream, log) == 0
    assert await last_message(bus, stream, log) is None
    assert await last_message(bus, backend.fresh("NO_SUCH_STREAM"), log) is None
    assert await read_subject(bus, stream, log) == []

    written: list[tuple[int, bytes]] = []
    for n in range(400):  # more than one read batch (256) on the subject
        subject = other if n % 3 == 0 else log
        seq = await bus.publish_stored(subject, b"%d" % n)
        if subject == log:
            written.append((await seq, b"%d" % n))
    assert await read_subject(bus, stream, log) == written
    assert await last_sequence(bus, stream, log) == written[-1][0]
    assert await last_message(bus, stream, log) == written[-1][1]
    assert await last_message(bus, stream, other) == b"399"


@contract
async def test_stored_publishes_are_acked_with_their_sequences_and_refusals_fail_the_flush(
    backend: Backend,
) -> None:
    bus = await backend.connect("worker")
    stream, subjects = backend.fresh("DONE"), backend.fresh("done")
    assert await create_stream(bus, StreamSpec(name=stream, subjects=(f"{subjects}.*",)))
    connection = bus.connection
    acks = [await bus.publish_stored(f"{subjects}.{n}", b"complete") for n in range(5)]
    await bus.confirm(connection, acks)
    assert [ack.result() for ack in acks] == [1, 2, 3, 4, 5]

    # A subject no stream takes: the server answers 503 (no responders), which fails the
    # ack, and so the flush that awaits it.
    lost = await bus.publish_stored(f"{backend.fresh('nowhere')}.x", b"complete")
    with pytest.raises(BusError, match="no stream stored a message: 503"):
        await lost
    with pytest.raises(BusError, match="flush failed"):
        await bus.flush()
