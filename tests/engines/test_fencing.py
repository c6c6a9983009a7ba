"""A mock engine whose lease lapses (its connection cut through a proxy) fences itself: it drops
what the handoff held at once, and once back on the bus answers a later cancel
of that handoff with `noop` and anything else with a refusal, while it serves new handoffs."""

from __future__ import annotations

import uuid

from kvhandoff.client import Connection
from kvhandoff.events.leases import LEASE_EXPIRED
from kvhandoff.events.messages import (
    NOOP,
    SUBMITTED,
    ActionFailed,
    ActionOutcome,
    CancelSource,
    Input,
    StartTransfer,
    SubmitPrefill,
)
from kvhandoff.events.subjects import Subjects
from kvhandoff.worker.bus.connection import Bus
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.engines import EngineModel, EnginesConfig, MockEngines
from tests.client.proxy import CuttableProxy
from tests.engines.harness import ONE_PAIR, PROMPT, SOURCE, WorkerSide, held
from tests.eventually import until

# A prefill of several seconds: the handoff is held, not yet reported, when the lease lapses.
SLOW = EngineModel(shortest_prompt=PROMPT, longest_prompt=PROMPT, prefill_tokens_per_s=20.0)


async def test_an_engine_whose_lease_lapsed_drops_its_handoffs_and_refuses_their_actions(
    proxy: CuttableProxy, subjects: Subjects, worker_side: WorkerSide
) -> None:
    bus = await Bus.connect(NatsSettings(url=proxy.url), "test-fenced-engines")
    config = EnginesConfig(roster=ONE_PAIR, model=SLOW, lease_ttl_s=1.0)
    engines = MockEngines(Connection(bus, subjects), config)
    await engines.start()
    source = engines.engines[SOURCE]
    h = uuid.uuid4()
    await worker_side.send(SOURCE, SubmitPrefill(h, 0))
    await worker_side.expect(h, ActionOutcome(h, 0, SUBMITTED))
    await until(lambda: held(source) > 0, "the prefill holds its blocks")

    await proxy.cut()
    await until(lambda: source.client.stats.fenced == 1, "the engine fenced itself")

    assert held(source) == 0  # dropped at once, while still cut off
    await proxy.open()
    lease = source.client.lease
    assert lease is not None
    await until(lease.valid, "a new lease")
    await worker_side.send(SOURCE, CancelSource(h, 1))
    await worker_side.send(SOURCE, StartTransfer(h, 2, 0.0))
    expected = [
        ActionOutcome(h, 1, NOOP),
        ActionOutcome(h, 2, ActionFailed(f"{SOURCE}: {LEASE_EXPIRED}, the handoff was dropped")),
    ]
    # The `submitted` stored before the cut may come again: its publish, in flight as the
    # connection went, is retried once it is back (at least once, as the bus promises).
    submitted = ActionOutcome(h, 0, SUBMITTED)
    answers: list[Input] = []
    while len(answers) < len(expected):
        if (answer := await worker_side.next(h)) != submitted:
            answers.append(answer)
    assert answers == expected
    # A new handoff is served as usual.
    fresh = uuid.uuid4()
    await worker_side.send(SOURCE, SubmitPrefill(fresh, 0))
    await worker_side.expect(fresh, ActionOutcome(fresh, 0, SUBMITTED))
    await engines.stop()
    await bus.close()
