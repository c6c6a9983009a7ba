"""A partition's steps (worker.tier.partition's `decide` and `act`) in process, against a real
nats-server and real SQLite, with the local file's writer held: `act` does not wait for the
local commit, and `decide` waits for it only before it reads a handoff that the queued batch
took out of memory."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import msgspec
import nats
import pytest
from nats.aio.msg import Msg

from kvhandoff.events.codec import encode
from kvhandoff.events.messages import EngineType, Rejection, StartHandoff
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.pull import Inbound
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.config import WorkerConfig
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.log.rows import HandoffLog, Loaded
from kvhandoff.worker.log.schema import QUARANTINE_PREFIX
from kvhandoff.worker.log.store import EventLog
from kvhandoff.worker.tier.entries import LoggedRows, encode_entry
from kvhandoff.worker.tier.membership import TierSettings
from kvhandoff.worker.tier.metrics import Metrics
from kvhandoff.worker.tier.ownership import CaughtUp
from kvhandoff.worker.tier.partition import Partition
from kvhandoff.worker.tier.service import Worker
from kvhandoff.worker.tier.streams import open_completions
from tests.worker.test_planner import success_inputs

PREFIX = "kvhandoff"


@dataclass(frozen=True)
class Delivered:
    """What `decide` and `act` read of a delivery (worker.bus.pull.Inbound's fields): an input as
    the tier's stream stores it, under its partition-qualified subject."""

    data: bytes
    subject: str
    stream_seq: int
    deliveries: int = 1


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(store_dir=tmp_path) as server:
        yield server


@dataclass
class Steps:
    worker: Worker
    partition: Partition
    metrics: Metrics
    bus: Bus


@pytest.fixture
async def steps(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[Steps]:
    """A worker of a one-partition tier that has claimed its partition, run step by step."""
    config = WorkerConfig(
        NatsSettings(url=nats_server.url),
        tmp_path / "unused.db",
        data_dir=tmp_path,
    )
    bus = await Bus.connect(config.nats, "test-partition-steps")
    await open_completions(
        bus, config.tier.done_stream, Subjects(PREFIX).completions, config.tier.completion_ttl_s
    )
    metrics = Metrics()
    worker = Worker(config, TierSettings(partitions=1), bus, metrics, label="test")
    partition = worker.partition(0)
    await partition.claimed(CaughtUp(epoch=1, previous_owner=None))
    try:
        yield Steps(worker, partition, metrics, bus)
    finally:
        partition.released()
        stop = asyncio.Event()
        stop.set()
        await worker.run(stop)  # stopped at once: closes its files, as at every stop
        await bus.close()


@contextlib.contextmanager
def held(log: EventLog) -> Iterator[threading.Event]:
    """Hold the log's writer thread until the event is set, or the block ends: what is queued
    behind stays queued."""
    release = threading.Event()
    log._writer.submit(release.wait)  # the one thread that writes the file
    try:
        yield release
    finally:
        release.set()


async def test_act_does_not_wait_for_the_local_commit_and_a_read_of_what_it_completed_does(
    steps: Steps, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, partition = steps.worker, steps.partition
    start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
    inputs = success_inputs(start, cancel_at=None)
    subject = f"{PREFIX}.inp.0.{start.handoff_id}"
    batch = [Delivered(encode(m), subject, seq) for seq, m in enumerate(inputs, 1)]
    (log,) = worker.logs()
    read_early: list[bool] = []  # per read of the file: whether the writer was still held
    load = log.load

    async def watched_load(handoff_ids: Collection[uuid.UUID]) -> dict[uuid.UUID, Loaded]:
        read_early.append(not release.is_set())
        return await load(handoff_ids)

    monkeypatch.setattr(log, "load", watched_load)
    with held(log) as release:
        decided = await partition.decide(cast(list[Inbound], batch))
        assert not decided.deferred
        await partition.act(cast(list[Inbound], batch))  # returns with its local commit queued

        # The last input again: a redelivery of an input the queued batch applied. Its handoff
        # left memory when it completed, so it must be read from the file, which only holds it
        # once the queued commit is in.
        again = [Delivered(batch[-1].data, subject, len(batch) + 1)]
        # (The first batch read the file for its new handoff at once: no queued commit holds
        # it, so its read may overtake them.)
        assert read_early == [True]
        read_early.clear()
        deciding = asyncio.create_task(partition.decide(cast(list[Inbound], again)))
        # One step of the task: a decide that does not wait reads the file in it (its read is
        # the first thing it awaits); one that waits stops at the queued commit.
        await asyncio.sleep(0)
        assert not read_early, "decide read the file before the queued commit was in"
        release.set()
        redecided = await deciding
        assert read_early == [False]  # it read the file once, after the commit
        await partition.act(cast(list[Inbound], again))

    # Recognised as a duplicate of what the file holds, not deferred as an input that came
    # before its handoff's start.
    assert not redecided.deferred
    assert steps.metrics.registry.get_sample_value("kvhandoff_duplicate_inputs_total") == 1
    logged = (await log.load([start.handoff_id]))[start.handoff_id]
    assert isinstance(logged, HandoffLog) and len(logged.events) == len(inputs) + 6  # 6 actions


def _rows(mark: int, rejections: list[tuple[uuid.UUID, str]], confirmed: int | None) -> bytes:
    """An entry's records whose only rows are rejections, each (handoff id, reason)."""
    logged: list[tuple[int, str | None, str, bytes]] = [
        (0, str(h), reason, f'{{"quotes": "{h}"}}'.encode()) for h, reason in rejections
    ]
    return encode_entry(LoggedRows([mark], [], [], logged, [], [], confirmed=confirmed))


async def test_a_claim_publishes_again_the_rejections_its_log_does_not_say_were_confirmed(
    steps: Steps, nats_server: EmbeddedNats
) -> None:
    """The owner before may have died between its append and its publishes: a frontend waiting
    on a rejected start must still hear of it (seed 283 of `kvhandoff sim`). The entries after
    the newest one an entry names as confirmed are published again, but a quarantine's note,
    which was never published."""
    heard: asyncio.Queue[Rejection] = asyncio.Queue()
    client = await nats.connect(nats_server.url)
    try:

        async def hear(msg: Msg) -> None:
            heard.put_nowait(msgspec.json.decode(msg.data, type=Rejection))

        await client.subscribe(f"{PREFIX}.rejected.>", cb=hear)
        await client.flush()
        a, b, c, d = (uuid.UUID(int=n, version=4) for n in range(1, 5))
        records = [
            _rows(1, [(a, "confirmed by the third entry")], None),
            _rows(2, [(b, "after it"), (c, f"{QUARANTINE_PREFIX} never published")], None),
            _rows(3, [(d, "its own")], confirmed=1),
        ]
        steps.partition.released()
        await steps.partition.claimed(CaughtUp(epoch=2, previous_owner="w", records=records))
        # Behind them on the same connection: what came before it is all there is.
        await steps.bus.publish(f"{PREFIX}.rejected.end", encode(Rejection(None, "end", "")))
        heard_of = []
        while (rejection := await asyncio.wait_for(heard.get(), 10)).reason != "end":
            heard_of.append((rejection.handoff_id, rejection.reason, rejection.payload))
    finally:
        await client.close()
    assert heard_of == [
        (b, "after it", f'{{"quotes": "{b}"}}'),
        (d, "its own", f'{{"quotes": "{d}"}}'),
    ]


async def test_an_entry_names_the_newest_entry_whose_publishes_the_server_confirmed(
    steps: Steps,
) -> None:
    partition = steps.partition

    def batch(seq: int) -> list[Inbound]:
        start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
        subject = f"{PREFIX}.inp.0.{start.handoff_id}"
        return cast(list[Inbound], [Delivered(encode(start), subject, seq)])

    first = batch(1)
    await partition.decide(first)
    assert partition.decided[-1][2].confirmed is None  # nothing published yet
    await partition.act(first)
    await partition._published[-1].barrier  # the server read the first entry's publishes
    await partition.decide(batch(2))
    assert partition.decided[-1][2].confirmed == 1  # named by its mark, its first input
