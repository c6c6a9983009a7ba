"""The load generator: its accounting against a scripted worker, then whole runs against the
real worker (`kvhandoff run` in a child process) and the mock engines."""

from __future__ import annotations

import asyncio
import io
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from uuid import UUID

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from rich.console import Console

from kvhandoff.events.codec import decode_input, encode
from kvhandoff.events.messages import (
    Canceled,
    Complete,
    EngineType,
    HandoffCompletion,
    Rejection,
    StartHandoff,
)
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.commands._demo import print_external
from kvhandoff.worker.engines import Faults, Roster
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.loadgen.generator import (
    FinalStates,
    LoadConfig,
    LoadProgress,
    LoadReport,
    run_load,
)
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.log.schema import HandoffState
from tests.engines.conftest import StartEngines
from tests.engines.harness import FAST, ONE_PAIR
from tests.eventually import still_running, until

ROSTER = Roster(sources=1, destinations=1)
FATES = ("success", "canceled", "rejected", "silent", "success, then reopened")
# What a worker does with a handoff once the frontend's cancel reaches it.
CANCEL_FATES = ("success crossed the cancel", "cleaned up", "cancel refused after a success")


def external_line(report: LoadReport, engine_id: str) -> str:
    """What the demo's summary says of an engine run outside it."""
    console = Console(file=io.StringIO(), width=200)
    print_external(report, engine_id, console)
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue().strip()


def load_config(nats_server: EmbeddedNats, subjects: Subjects, **options: object) -> LoadConfig:
    settings = NatsSettings(url=nats_server.url, subject_prefix=subjects.prefix)
    return replace(LoadConfig(nats=settings, handoffs=1, roster=ROSTER), **options)  # type: ignore[arg-type]


@pytest.fixture
async def nc(nats_server: EmbeddedNats, subjects: Subjects) -> AsyncIterator[Client]:
    """A connection of the test's own, with the input stream that no worker made: the test
    plays the worker on it, or there is none."""
    connection = await nats.connect(nats_server.url)
    await connection.jetstream().add_stream(
        name=f"IN_{subjects.prefix}", subjects=[subjects.inputs]
    )
    yield connection
    await connection.close()


async def test_every_way_a_handoff_ends_is_counted(
    nats_server: EmbeddedNats, subjects: Subjects, nc: Client
) -> None:
    fates: dict[UUID, str] = {}

    async def scripted_worker(msg: Msg) -> None:
        start = decode_input(msg.data)
        if not isinstance(start, StartHandoff):
            return
        h = start.handoff_id
        fate = fates[h] = FATES[len(fates) % len(FATES)]
        done = subjects.done(h)
        if fate.startswith("success"):
            await nc.publish(done, encode(Complete(h, 6, HandoffCompletion.SUCCESS)))
        if fate == "success, then reopened":
            await nc.publish(done, encode(Complete(h, 8, HandoffCompletion.CANCELED)))
        if fate == "canceled":
            # A late engine fact was refused: noted, but it does not end the handoff.
            late = Rejection(h, "handoff is complete", encode(Canceled(h)).decode())
            await nc.publish(subjects.rejected(h), encode(late))
            await nc.publish(done, encode(Complete(h, 3, HandoffCompletion.CANCELED)))
        if fate == "rejected":
            refusal = Rejection(h, "conflicting StartHandoff", msg.data.decode())
            await nc.publish(subjects.rejected(h), encode(refusal))

    await nc.subscribe(subjects.inputs, cb=scripted_worker)
    progress: list[LoadProgress] = []
    config = load_config(
        nats_server, subjects, handoffs=10, concurrency=10, wait_timeout_s=0.5, settle_timeout_s=0.1
    )
    report = await run_load(config, progress=progress.append)

    assert sorted(fates.values()) == sorted(FATES * 2)
    assert (report.completed, report.canceled, report.rejected, report.timed_out) == (4, 2, 2, 2)
    assert (report.extra_completions, report.input_rejections) == (2, 2)
    # A reopened handoff ended at its success, but the log holds its canceled completion.
    assert report.reopened == 2
    assert report.final == FinalStates(succeeded=2, canceled=4)
    assert report.latency_ms.count == 4
    assert (report.engine_processes, report.leaks) == (0, 0)
    assert report.unreported == ROSTER.engine_ids()  # no engine answered: none is counted
    assert "vllm-prefill-0 did not report" in external_line(report, "vllm-prefill-0")
    assert not report.ok
    assert [p.ended for p in progress] == list(range(1, 11))


async def test_a_handoff_the_frontend_canceled_ends_at_its_canceled_completion(
    nats_server: EmbeddedNats, subjects: Subjects, nc: Client
) -> None:
    fates: dict[UUID, str] = {}

    async def scripted_worker(msg: Msg) -> None:
        # Nothing completes before the cancel is in, so every cancel is sent.
        cancel = decode_input(msg.data)
        if not isinstance(cancel, Canceled):
            return
        h = cancel.handoff_id
        fate = fates[h] = CANCEL_FATES[len(fates) % len(CANCEL_FATES)]
        done = subjects.done(h)
        if fate == "cleaned up":
            await nc.publish(done, encode(Complete(h, 3, HandoffCompletion.CANCELED)))
            return
        # The handoff succeeded while the cancel was on its way.
        await nc.publish(done, encode(Complete(h, 5, HandoffCompletion.SUCCESS)))
        if fate == "success crossed the cancel":
            # The reference semantics: the cancel reopens the cleanup.
            await nc.publish(done, encode(Complete(h, 7, HandoffCompletion.CANCELED)))
        else:
            refusal = Rejection(h, "handoff is quarantined", msg.data.decode())
            await nc.publish(subjects.rejected(h), encode(refusal))

    await nc.subscribe(subjects.inputs, cb=scripted_worker)
    config = load_config(
        nats_server,
        subjects,
        handoffs=6,
        concurrency=6,
        cancel_share=1.0,
        cancel_within_ms=0.0,
        wait_timeout_s=5.0,
        settle_timeout_s=0.1,
    )
    report = await run_load(config)

    assert sorted(fates.values()) == sorted(CANCEL_FATES * 2)
    assert report.cancels_sent == 6
    # The crossed success is not the end: the canceled completion after it is.
    assert (report.completed, report.canceled, report.timed_out) == (2, 4, 0)
    assert (report.reopened, report.extra_completions, report.input_rejections) == (2, 0, 2)
    assert report.final == FinalStates(succeeded=2, canceled=4)
    assert report.latency_ms.count == 2
    assert report.ok


async def test_a_run_against_the_worker_and_the_engines_ends_every_handoff_without_leaks(
    nats_server: EmbeddedNats,
    subjects: Subjects,
    worker: Path,
    start_engines: StartEngines,
    tmp_path: Path,
) -> None:
    await start_engines(roster=ROSTER, model=replace(FAST, longest_prompt=2000))
    config = load_config(
        nats_server, subjects, handoffs=60, concurrency=8, cancel_share=0.25, cancel_within_ms=0.0
    )
    report = await run_load(config)

    assert report.ok, report
    assert report.completed + report.canceled == 60
    assert report.cancels_sent == 15
    assert report.canceled >= 1
    # The worker logs each Complete before publishing it, and these engines inject no late
    # facts: the log holds exactly the final states that the report gives.
    with open_log(tmp_path / "kvhandoff.db") as log:
        states = Counter(handoff.state for handoff in log.handoffs())
    final = FinalStates(
        succeeded=states.pop(HandoffState.SUCCEEDED, 0),
        canceled=states.pop(HandoffState.CANCELED, 0),
    )
    assert (final, states) == (report.final, Counter())
    assert report.final == FinalStates(succeeded=report.completed, canceled=report.canceled)
    assert report.latency_ms.count == report.completed
    assert report.latency_ms.p50 is not None and report.latency_ms.p99 is not None
    assert report.latency_ms.p50 <= report.latency_ms.p99
    assert (report.engine_processes, report.engines_settled) == (1, True)
    assert report.unreported == []
    assert (
        external_line(report, "sglang-decode-0")
        == "external engine sglang-decode-0: reported, 0 leaks"
    )
    assert report.throughput_per_s > 0


async def test_faulty_engines_still_end_every_handoff_without_leaks(
    nats_server: EmbeddedNats, subjects: Subjects, worker: Path, start_engines: StartEngines
) -> None:
    faults = Faults(seed=13, fail_rate=0.1, drop_rate=0.1, duplicate_rate=0.2, delay_ms=20.0)
    engines = await start_engines(roster=ROSTER, faults=faults)
    report = await run_load(load_config(nats_server, subjects, handoffs=60, concurrency=12))

    assert report.ok, report
    counters = [engine.counters for engine in engines.engines.values()]
    assert sum(c.dropped for c in counters) > 0
    assert sum(c.duplicated for c in counters) > 0
    assert sum(c.injected_failures for c in counters) > 0
    assert report.canceled > 0  # the injected failures were cleaned up


async def test_handoffs_on_a_silent_engine_time_out_and_are_cleaned_up_once_it_recovers(
    nats_server: EmbeddedNats, subjects: Subjects, worker: Path, start_engines: StartEngines
) -> None:
    # Index 0 of each role is silent: vllm-prefill-0 and vllm-decode-0.
    roster = Roster(engine_types=(EngineType.VLLM,), sources=2, destinations=2)
    engines = await start_engines(roster=roster, faults=Faults(silent=1, silent_ms=1500.0, seed=1))
    config = load_config(
        nats_server, subjects, handoffs=16, concurrency=16, roster=roster, deadline_ms=500
    )
    report = await run_load(config)

    assert report.ok, report
    for engine_id in ("vllm-prefill-0", "vllm-decode-0"):
        assert engines.engines[engine_id].counters.ignored > 0
    # Handoffs routed to a silent engine ran into their deadline; the others went through.
    assert report.canceled > 0
    assert report.completed > 0


async def test_a_load_told_to_wait_for_the_engines_starts_its_handoffs_once_they_listen(
    nats_server: EmbeddedNats, subjects: Subjects, nc: Client, start_engines: StartEngines
) -> None:
    # An engine that is not listening yet when the load starts would get its first actions only
    # after the worker's retry interval (worker.loadgen.generator, `engines_wait_s`).
    js = nc.jetstream()
    stream = f"IN_{subjects.prefix}"
    probes: list[str] = []

    async def probed(msg: Msg) -> None:
        if not msg.data and msg.reply:
            probes.append(msg.subject)

    await nc.subscribe(f"{subjects.prefix}.engine.*.actions", cb=probed)
    await nc.flush()
    # No worker: the handoff is only stored, and times out at once in the report.
    config = load_config(
        nats_server,
        subjects,
        handoffs=1,
        engines_wait_s=60.0,
        wait_timeout_s=0.1,
        settle_timeout_s=0.1,
        roster=ONE_PAIR,
    )
    load = asyncio.create_task(run_load(config))
    await until(
        lambda: bool(probes),
        "the load asked whether the engines listen",
        guard=still_running(load),
    )
    stored_before = (await js.stream_info(stream)).state.messages
    await start_engines(roster=ONE_PAIR)
    report = await asyncio.wait_for(load, 60)
    stored_after = (await js.stream_info(stream)).state.messages

    assert stored_before == 0, "a handoff started before the engines listened"
    assert stored_after == 1 and report.timed_out == 1, report
    assert set(probes) <= {subjects.engine(e) for e in ONE_PAIR.engine_ids()}
