"""Two tiers on one NATS account (issue 33): a second tier started with only its own
`--subject-prefix` and `--stream` gets completion and log streams named after its input stream
(`events.subjects.tier_stream`), and both tiers complete handoffs; a worker whose streams exist as
another tier's (other subjects), or whose subjects another stream captures, exits 2 naming the
stream, what it captures and the flag to set, instead of serving appends that no stream takes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.js import JetStreamContext

from kvhandoff.events.messages import EngineType, StartHandoff
from kvhandoff.worker.harness.natsserver import EmbeddedNats
from tests.worker.conftest import WorkerProcess
from tests.worker.scripted_engine import ScriptedEngines

TIER_B = ("--subject-prefix", "tierB", "--stream", "TIERB_IN")


@pytest.fixture
async def js(nats_server: EmbeddedNats) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_server.url)
    yield nc.jetstream()
    await nc.close()


async def complete_one(url: str, prefix: str) -> None:
    engines = ScriptedEngines(url, prefix=prefix)
    await engines.start()
    try:
        start = StartHandoff(uuid.uuid4(), EngineType.VLLM, "prefill-0", "decode-0", 60_000)
        await engines.start_handoff(start)
        await engines.wait_complete({start.handoff_id}, within=60)
    finally:
        await engines.close()


async def test_two_tiers_differing_only_in_prefix_and_input_stream_both_complete_handoffs(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    with (
        WorkerProcess(nats_server.url, tmp_path / "a.db") as a,
        WorkerProcess(nats_server.url, tmp_path / "b.db", *TIER_B) as b,
    ):
        a.start()
        b.start()
        await complete_one(nats_server.url, "kvhandoff")
        await complete_one(nats_server.url, "tierB")
        assert a.running() and b.running(), (a.logs(), b.logs())
    captured = {
        name: (await js.stream_info(name)).config.subjects
        for tier in ("KVHANDOFF", "TIERB")
        for name in (f"{tier}_LOG", f"{tier}_DONE", f"{tier}_REJECTED")
    }
    assert captured == {
        "KVHANDOFF_LOG": ["kvhandoff.log.*"],
        "KVHANDOFF_DONE": ["kvhandoff.done.*"],
        "KVHANDOFF_REJECTED": ["kvhandoff.rejected.*"],
        "TIERB_LOG": ["tierB.log.*"],
        "TIERB_DONE": ["tierB.done.*"],
        "TIERB_REJECTED": ["tierB.rejected.*"],
    }


@pytest.mark.parametrize(
    ("extra", "refusal"),
    [
        (
            ("--subject-prefix", "tierB"),
            "stream KVHANDOFF_IN captures kvhandoff.in.* (workqueue retention), not tierB.in.* "
            "(workqueue retention) as this tier's input stream: it is another tier's, or made "
            "by hand; name this tier's input stream with --stream",
        ),
        (
            (*TIER_B, "--done-stream", "KVHANDOFF_DONE"),
            "stream KVHANDOFF_DONE captures kvhandoff.done.* (limits retention), not "
            "tierB.done.* (limits retention) as this tier's completion stream: it is another "
            "tier's, or made by hand; name this tier's completion stream with --done-stream, or "
            "give the tier its own --stream, which names it",
        ),
        (
            ("--stream", "OTHER_IN"),
            "cannot create stream OTHER_IN for kvhandoff.in.* as this tier's input stream: "
            "KVHANDOFF_IN captures them (another tier's, of this --subject-prefix?); give "
            "this tier its own --subject-prefix, or name that stream with --stream",
        ),
    ],
    ids=["input-stream-of-another-prefix", "completion-stream-of-another-prefix", "overlap"],
)
def test_a_worker_whose_streams_are_another_tiers_exits_2_naming_the_stream_and_flag(
    nats_server: EmbeddedNats, tmp_path: Path, extra: tuple[str, ...], refusal: str
) -> None:
    with WorkerProcess(nats_server.url, tmp_path / "a.db") as first:
        first.start()  # the default tier's streams exist from here on
        second = WorkerProcess(nats_server.url, tmp_path / "b.db", *extra)
        second.launch()
        assert second.process is not None
        try:
            assert second.process.wait(timeout=60) == 2, second.logs()
        finally:
            second.stop()
        assert refusal in second.logs()
        assert first.running(), first.logs()


def test_a_tier_of_its_own_stream_whose_others_had_the_old_defaults_is_told_to_name_them(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """Before the names followed the input stream, a tier given `--stream PROD_IN` alone used
    `KVHANDOFF_DONE` and `KVHANDOFF_LOG`. Upgraded, it must not start on a new, empty log: the
    new names' subjects are the old streams', so it exits 2 naming the one to give."""
    old_names = ("--done-stream", "KVHANDOFF_DONE", "--log-stream", "KVHANDOFF_LOG")
    with WorkerProcess(nats_server.url, tmp_path / "a.db", "--stream", "PROD_IN", *old_names) as a:
        a.start()
    upgraded = WorkerProcess(nats_server.url, tmp_path / "a.db", "--stream", "PROD_IN")
    upgraded.launch()
    assert upgraded.process is not None
    try:
        assert upgraded.process.wait(timeout=60) == 2, upgraded.logs()
    finally:
        upgraded.stop()
    assert (
        "cannot create stream PROD_DONE for kvhandoff.done.* as this tier's completion stream: "
        "KVHANDOFF_DONE captures them" in upgraded.logs()
    )
    assert "name that stream with --done-stream" in upgraded.logs()
