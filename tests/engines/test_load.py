"""The load generator: its accounting against a scripted worker, then whole runs against the
real worker (`kvhandoff run` in a child process) and the mock engines."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from uuid import UUID

import nats
from nats.aio.msg import Msg

from events.codec import decode_input, encode
from events.messages import (
    Canceled,
    Complete,
    EngineType,
    HandoffCompletion,
    Rejection,
    StartHandoff,
)
from events.subjects import Subjects
from tests.engines.conftest import StartEngines
from tests.engines.harness import FAST
from worker.config import NatsSettings
from worker.engines import Faults, Roster
from worker.loadgen import LoadConfig, LoadProgress, run_load
from worker.natsserver import EmbeddedNats

ROSTER = Roster(sources=1, destinations=1)
FATES = ("success", "canceled", "rejected", "silent", "success, then reopened")


def load_config(nats_server: EmbeddedNats, subjects: Subjects, **options: object) -> LoadConfig:
    settings = NatsSettings(url=nats_server.url, subject_prefix=subjects.prefix)
    return replace(LoadConfig(nats=settings, handoffs=1, roster=ROSTER), **options)  # type: ignore[arg-type]


async def test_every_way_a_handoff_ends_is_counted(
    nats_server: EmbeddedNats, subjects: Subjects
) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(name=f"IN_{subjects.prefix}", subjects=[subjects.inputs])
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
    await nc.close()

    assert sorted(fates.values()) == sorted(FATES * 2)
    assert (report.completed, report.canceled, report.rejected, report.timed_out) == (4, 2, 2, 2)
    assert (report.extra_completions, report.input_rejections) == (2, 2)
    assert report.latency_ms.count == 4
    assert (report.engine_processes, report.leaks) == (0, 0)
    assert not report.ok
    assert [p.ended for p in progress] == list(range(1, 11))


async def test_a_run_against_the_worker_and_the_engines_ends_every_handoff_without_leaks(
    nats_server: EmbeddedNats, subjects: Subjects, worker: Path, start_engines: StartEngines
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
    assert report.latency_ms.count == report.completed
    assert report.latency_ms.p50 is not None and report.latency_ms.p99 is not None
    assert report.latency_ms.p50 <= report.latency_ms.p99
    assert (report.engine_processes, report.engines_settled) == (1, True)
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
