"""The mock's pure parts: prompt lengths, engine ids, the model's arithmetic, the load plan and
the latency summary."""

from __future__ import annotations

import uuid
from uuid import UUID

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.events.codec import decode_input, encode
from kvhandoff.events.messages import EngineType, StartHandoff
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.engines import EngineModel, Roster, prompt_tokens
from kvhandoff.worker.errors import ConfigError
from kvhandoff.worker.loadgen.generator import LoadConfig, latency_summary, plan_handoffs


@given(st.uuids(), st.integers(1, 10_000), st.integers(0, 10_000))
def test_prompt_length_is_a_pure_function_of_the_id_within_the_range(
    handoff_id: UUID, shortest: int, extra: int
) -> None:
    tokens = prompt_tokens(handoff_id, shortest, shortest + extra)
    assert shortest <= tokens <= shortest + extra
    assert tokens == prompt_tokens(UUID(str(handoff_id)), shortest, shortest + extra)


def test_prompt_lengths_spread_over_the_range() -> None:
    lengths = {prompt_tokens(uuid.uuid4(), 1, 4) for _ in range(200)}
    assert lengths == {1, 2, 3, 4}


def test_roster_ids_are_valid_engine_ids_and_distinct() -> None:
    roster = Roster(sources=3, destinations=2)
    ids: list[str] = []
    for engine_type in roster.engine_types:
        ids += roster.source_ids(engine_type) + roster.destination_ids(engine_type)
        start = StartHandoff(
            uuid.uuid4(),
            engine_type,
            roster.source_ids(engine_type)[-1],
            roster.destination_ids(engine_type)[-1],
            1000,
        )
        assert decode_input(encode(start)) == start  # the wire's EngineId constraint holds
    assert len(ids) == len(set(ids)) == 3 * (3 + 2)
    assert "sglang-prefill-2" in ids and "trtllm-decode-1" in ids


def test_model_arithmetic() -> None:
    model = EngineModel(block_size=16, speedup=4.0, prefill_tokens_per_s=1000.0, decode_ms=400)
    assert [model.blocks_for(n) for n in (1, 16, 17, 100)] == [1, 1, 2, 7]
    assert [model.transferable_tokens(n) for n in (15, 16, 100)] == [0, 16, 96]
    assert model.prefill_s(1000) == 0.25
    assert model.transfer_s(8.0) == 0.002
    assert model.decode_s() == 0.1


@pytest.mark.parametrize(
    "settings",
    [{"block_size": 0}, {"speedup": 0.0}, {"shortest_prompt": 10, "longest_prompt": 9}],
)
def test_model_refuses_impossible_settings(settings: dict[str, int | float]) -> None:
    with pytest.raises(ConfigError):
        EngineModel(**settings)  # type: ignore[arg-type]


def test_roster_refuses_empty_or_repeated_types() -> None:
    with pytest.raises(ConfigError):
        Roster(engine_types=())
    with pytest.raises(ConfigError):
        Roster(engine_types=(EngineType.VLLM, EngineType.VLLM))
    with pytest.raises(ConfigError):
        Roster(sources=0)


def test_the_plan_mixes_types_evenly_and_cancels_the_chosen_share() -> None:
    config = LoadConfig(nats=NatsSettings(), handoffs=90, cancel_share=0.25, seed=4)
    plans = plan_handoffs(config)
    types = [plan.start.engine_type for plan in plans]
    assert {t: types.count(t) for t in EngineType} == dict.fromkeys(EngineType, 30)
    assert sum(plan.cancel_after_s is not None for plan in plans) == round(0.25 * 90)
    roster = config.roster
    for plan in plans:
        assert plan.start.source in roster.source_ids(plan.start.engine_type)
        assert plan.start.destination in roster.destination_ids(plan.start.engine_type)
    # The same seed routes the same way; ids are always fresh.
    again = plan_handoffs(config)
    assert [(p.start.source, p.start.destination) for p in again] == [
        (p.start.source, p.start.destination) for p in plans
    ]
    assert not {p.start.handoff_id for p in again} & {p.start.handoff_id for p in plans}


def test_load_config_refuses_nonsense() -> None:
    with pytest.raises(ConfigError):
        LoadConfig(nats=NatsSettings(), handoffs=0)
    with pytest.raises(ConfigError):
        LoadConfig(nats=NatsSettings(), handoffs=1, cancel_share=2.0)
    with pytest.raises(ConfigError, match="wire's bound"):  # the worker would reject them all
        LoadConfig(nats=NatsSettings(), handoffs=1, deadline_ms=2**31)
    assert LoadConfig(nats=NatsSettings(), handoffs=1, deadline_ms=5000).wait_timeout == 35.0


def test_latency_percentiles_are_nearest_rank() -> None:
    summary = latency_summary([float(v) for v in range(100, 0, -1)])
    assert (summary.count, summary.p50, summary.p90, summary.p99) == (100, 50.0, 90.0, 99.0)
    assert (summary.mean, summary.max) == (50.5, 100.0)
    assert latency_summary([7.0]).p99 == 7.0
    empty = latency_summary([])
    assert (empty.count, empty.p50, empty.mean) == (0, None, None)
