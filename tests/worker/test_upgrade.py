"""A tier's replicated log from before snapshots, taken over by this build: the golden log
(tests/worker/golden/, written by the version before snapshots: see tests/worker/golden_log.py)
in a log stream made as that version made it (an age limit, no roll-ups). The worker updates
the stream in place, reads the log whole once, catches its file up, ends the handoff that was
open, answers a retried start of the one that had ended as a duplicate, and writes its first
snapshot, which replaces the old entries."""

from __future__ import annotations

import uuid
from pathlib import Path

import msgspec
import nats
from nats.js.api import StreamConfig

from kvhandoff.events.messages import EngineType, StartHandoff
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from kvhandoff.worker.log.reader import open_log
from kvhandoff.worker.tier.entries import Snapshot
from kvhandoff.worker.tier.ownership import read_entries
from tests.worker.conftest import WorkerProcess
from tests.worker.golden_log import DONE, OPEN
from tests.worker.scripted_engine import ScriptedEngines

GOLDEN = Path(__file__).parent / "golden" / "log-before-snapshots.msgpack"
SUBJECT = "kvhandoff.log.0"


async def test_a_log_from_before_snapshots_is_taken_over_without_loss(
    nats_server: EmbeddedNats, engines: ScriptedEngines, tmp_path: Path
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        old = StreamConfig(
            name="KVHANDOFF_LOG",
            subjects=["kvhandoff.log.*"],
            max_age=7 * 24 * 3600.0,
            duplicate_window=120.0,
        )
        await js.add_stream(old)
        for payload in msgspec.msgpack.decode(GOLDEN.read_bytes(), type=list[bytes]):
            await js.publish(SUBJECT, payload)

        worker = WorkerProcess(nats_server.url, tmp_path / "kvhandoff.db")
        worker.start()
        try:
            await engines.wait_complete({OPEN.handoff_id})
            sent = len(engines.actions_of(DONE.handoff_id))
            await engines.start_handoff(DONE)  # a frontend's late retry of a handoff that ended
            # One partition applies its inputs in order: once this one completed, so had the
            # retry, and published nothing.
            after = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
            await engines.start_handoff(after)
            await engines.wait_complete({after.handoff_id})
            assert worker.terminate() == 0, worker.logs()
        finally:
            worker.stop()
        assert len(engines.actions_of(DONE.handoff_id)) == sent

        config = (await js.stream_info("KVHANDOFF_LOG")).config
        assert config.allow_rollup_hdrs and config.allow_atomic and not config.max_age
        stored = []
        info = await js.stream_info("KVHANDOFF_LOG")
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            message = await js.get_msg("KVHANDOFF_LOG", seq)
            assert message.data is not None
            stored.append((seq, message.data))
        log = read_entries(0, SUBJECT, stored)
        assert isinstance(log[0], Snapshot), log[:3]  # the old entries are gone
    finally:
        await nc.close()

    with open_log(tmp_path / "kvhandoff.db") as file:
        rows = {row.handoff_id: row.state_name for row in file.handoffs()}
        assert rows[DONE.handoff_id] == "succeeded"
        assert rows[OPEN.handoff_id] in {"succeeded", "canceled"}
        assert len(file.load(DONE.handoff_id).events) == 15
