"""Engine leases against a real worker: an engine cut off from NATS past its lease fences itself
(drops what it held, publishes no late success), the tier answers for it so the handoff ends
`canceled` long before its deadline, the answers are in the log as the tier's, and the engine,
back on the bus, serves new handoffs under a new incarnation. A start naming an engine whose
lease expired is rejected."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvhandoff.client import Engine, Frontend, Handlers, HandoffRejected
from kvhandoff.events.ids import HandoffId
from kvhandoff.events.leases import ENGINE_UNAVAILABLE, LEASE_EXPIRED
from kvhandoff.events.messages import (
    ActionOutcome,
    EngineType,
    Failed,
    HandoffCompletion,
    StartHandoff,
)
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.kv import watch_bucket
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.log.reader import open_log
from tests.client.conftest import Connect
from tests.client.pair import DESTINATION, SOURCE, Pair
from tests.client.proxy import CuttableProxy
from tests.eventually import until
from tests.worker.conftest import WorkerProcess, completed_inputs, logged_inputs

WAIT_S = 60.0
LEASE_TTL_S = 1.0
DEADLINE_MS = 120_000  # far beyond what the lease takes: a deadline cannot be what ends it


def start_message(source: str = SOURCE) -> StartHandoff:
    return StartHandoff(uuid.uuid4(), EngineType.VLLM, source, DESTINATION, DEADLINE_MS)


async def test_an_engine_cut_off_past_its_lease_fences_itself_and_the_tier_answers_for_it(
    worker: WorkerProcess, connect: Connect, proxy: CuttableProxy, tmp_path: Path
) -> None:
    engines = Pair(
        await connect(proxy.url),
        destination_connection=await connect(),
        lease_ttl_s=LEASE_TTL_S,
        hold_source_held=True,
    )
    await engines.start()
    first_incarnation = engines.source.lease.incarnation if engines.source.lease else None
    frontend = await Frontend.open(await connect())
    handoff_id = await frontend.start(start_message())
    await asyncio.wait_for(engines.submitted.wait(), WAIT_S)
    # `stuck` shows what it waits on, and that the engine's lease is live.
    await until_stuck_shows(tmp_path / "kvhandoff.db", f"source {SOURCE} (lease live)")

    await proxy.cut()  # the source can neither renew its lease nor answer
    complete = await frontend.wait(handoff_id, timeout_s=WAIT_S)

    assert complete.completion is HandoffCompletion.CANCELED
    assert engines.fenced == [handoff_id]  # it dropped what it held
    inputs = await completed_inputs(tmp_path / "kvhandoff.db", handoff_id, within=WAIT_S)
    assert Failed(handoff_id, LEASE_EXPIRED) in inputs
    tier_answers = [i for i in inputs if isinstance(i, ActionOutcome) and i.by_tier]
    assert [type(i.outcome).__name__ for i in tier_answers] == ["Noop"]  # its CancelSource
    replay = subprocess.run(  # noqa: ASYNC221  # the worker is another process: nothing waits
        [
            sys.executable,
            "-m",
            "kvhandoff.worker.cli",
            "replay",
            str(tmp_path / "kvhandoff.db"),
            str(handoff_id),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"failed reason={LEASE_EXPIRED}" in replay.stdout, replay.stdout
    assert "noop by the tier (engine lease gone)" in replay.stdout, replay.stdout

    # Back on the bus: a new incarnation, which serves new handoffs (once the tier saw it:
    # until then a start naming it is rejected).
    await proxy.open()
    engines.hold_source_held = False
    completion = await until_admitted(frontend)
    assert completion is HandoffCompletion.SUCCESS
    assert engines.source.lease is not None
    assert engines.source.lease.incarnation not in (None, first_incarnation)
    assert engines.fenced == [handoff_id]  # nothing of the new incarnation's was fenced
    await engines.stop()


async def until_stuck_shows(db: Path, text: str) -> None:
    shown = [""]

    async def shows() -> bool:
        stuck = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvhandoff.worker.cli",
            "stuck",
            str(db),
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await stuck.communicate()
        shown[0] = out.decode()
        return text in shown[0]

    # Every 0.1 s: the handoff reaches the file, and the view too.
    await until(shows, f"stuck shows {text!r}", within=WAIT_S, every=0.1, context=lambda: shown[0])


async def until_admitted(frontend: Frontend, source: str = SOURCE) -> HandoffCompletion:
    """Start handoffs naming `source` until one is admitted; how that one ended."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + WAIT_S
    while True:
        handoff_id = await frontend.start(start_message(source))
        try:
            return (await frontend.wait(handoff_id, timeout_s=WAIT_S)).completion
        except HandoffRejected as exc:
            assert ENGINE_UNAVAILABLE in str(exc)
        assert loop.time() < give_up_at, "never admitted"
        await asyncio.sleep(LEASE_TTL_S / 4)  # the tier's watch sees the next renewal


async def test_a_start_naming_an_engine_whose_lease_expired_is_rejected(
    worker: WorkerProcess, connect: Connect
) -> None:
    connection = await connect()
    gone = Engine(connection, "lease-gone-0", Handlers(), lease_ttl_s=LEASE_TTL_S)
    await gone.start()
    await gone.stop()  # the lease is no longer renewed and expires
    frontend = await Frontend.open(connection)
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + WAIT_S
    while True:
        handoff_id = await frontend.start(start_message(source="lease-gone-0"))
        try:
            complete = await frontend.wait(handoff_id, timeout_s=WAIT_S)
        except HandoffRejected as exc:
            assert f"{ENGINE_UNAVAILABLE}: lease-gone-0's lease expired" in str(exc)
            return
        # Admitted while the tier still saw the lease: it ended once the tier saw it go.
        assert complete.completion is HandoffCompletion.CANCELED
        assert loop.time() < give_up_at


async def test_a_worker_that_starts_after_an_engine_died_answers_for_it_at_its_claim(
    worker: WorkerProcess, connect: Connect, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    engines = Pair(
        await connect(),
        destination_connection=await connect(),
        lease_ttl_s=LEASE_TTL_S,
        hold_source_held=True,
    )
    await engines.start()
    frontend = await Frontend.open(await connect())
    handoff_id = await frontend.start(start_message())
    await asyncio.wait_for(engines.submitted.wait(), WAIT_S)
    # Once its outcome is logged, no outcome is owed by the source: the new owner learns that
    # the source is gone from the bucket alone (its claim's sweep, or its republishing of the
    # actions the file does not mark published, whichever comes first).
    db = tmp_path / "kvhandoff.db"
    await until(
        lambda: _outcome_logged(db, handoff_id), "the prefill's outcome logged", within=WAIT_S
    )

    worker.kill()  # SIGKILL: no worker sees the lease expire
    await engines.source.stop()  # its lease expires while no worker runs
    await until_expired(nats_server, SOURCE)
    worker.start()  # the new owner learns from the bucket that the source is gone

    complete = await frontend.wait(handoff_id, timeout_s=WAIT_S)
    assert complete.completion is HandoffCompletion.CANCELED
    inputs = await completed_inputs(tmp_path / "kvhandoff.db", handoff_id, within=WAIT_S)
    assert Failed(handoff_id, LEASE_EXPIRED) in inputs
    assert any(isinstance(i, ActionOutcome) and i.by_tier for i in inputs)
    await engines.destination.stop()


async def until_expired(nats_server: EmbeddedNats, engine_id: str) -> None:
    """Return once the lease bucket holds the delete marker of `engine_id`'s lease."""
    bus = await Bus.connect(NatsSettings(url=nats_server.url), "test-lease-watch")
    gone = asyncio.Event()

    def seen(key: str, value: bytes | None) -> None:
        if key == engine_id and value is None:
            gone.set()

    watch = await watch_bucket(bus, Subjects().lease_bucket, seen)
    await asyncio.wait_for(gone.wait(), WAIT_S)
    await watch.unsubscribe()
    await bus.close()


def _outcome_logged(db: Path, handoff_id: HandoffId) -> bool:
    with open_log(db) as log:
        if handoff_id not in {row.handoff_id for row in log.handoffs()}:
            return False  # not in the file yet: it commits behind the replicated log
    return any(isinstance(i, ActionOutcome) for i in logged_inputs(db, handoff_id))


async def test_with_require_leases_a_start_naming_an_unleased_engine_is_rejected(
    nats_server: EmbeddedNats, connect: Connect, tmp_path: Path
) -> None:
    worker = WorkerProcess(nats_server.url, tmp_path / "kvhandoff.db", "--require-leases")
    worker.start()
    try:
        connection = await connect()
        unleased = Engine(connection, SOURCE, Handlers(), lease_ttl_s=None)
        await unleased.start()
        frontend = await Frontend.open(connection)
        handoff_id = await frontend.start(start_message())
        with pytest.raises(HandoffRejected, match=f"{SOURCE} holds no lease"):
            await frontend.wait(handoff_id, timeout_s=WAIT_S)
        await unleased.stop()
    finally:
        worker.stop()


async def test_a_start_rejected_while_the_frontend_was_away_is_still_heard_of(
    nats_server: EmbeddedNats, connect: Connect, proxy: CuttableProxy, tmp_path: Path
) -> None:
    # The rejection stream keeps a start's rejection: a frontend that was reconnecting when it
    # went by, or that waits only afterwards, hears of it as it would of a Complete.
    worker = WorkerProcess(nats_server.url, tmp_path / "kvhandoff.db", "--require-leases")
    worker.start()
    worker.terminate()  # the streams stay; the start waits in its stream for the next worker
    try:
        observer = await Frontend.open(await connect())
        frontend = await Frontend.open(await connect(proxy.url))
        handoff_id = await frontend.start(start_message())  # its source holds no lease
        waiting = asyncio.create_task(frontend.wait(handoff_id, timeout_s=WAIT_S))
        heard = asyncio.create_task(observer.wait(handoff_id, timeout_s=WAIT_S))
        await proxy.cut()
        await asyncio.to_thread(worker.start)
        with pytest.raises(HandoffRejected, match=f"{SOURCE} holds no lease"):
            await heard  # the rejection went by
        assert not waiting.done()
        await proxy.open()
        with pytest.raises(HandoffRejected, match=f"{SOURCE} holds no lease"):
            await waiting
        later = await Frontend.open(await connect())
        with pytest.raises(HandoffRejected, match=f"{SOURCE} holds no lease"):
            await later.wait(handoff_id, timeout_s=WAIT_S)
    finally:
        worker.stop()
