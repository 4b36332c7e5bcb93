"""The capacity bench's arithmetic: the fit of Redis CPU to steps and tokens, and the model's worker counts."""

from __future__ import annotations

import pytest

from bench.fleet_cpu import Measured
from bench.relay_capacity import Fit, Row, busiest_share, capacity, fit

ALPHA_US, BETA_US = 80.0, 1.5
"""Made-up costs: µs of Redis CPU per step and per token."""


def _row(steps: int, tokens: int, redis_s: dict[str, float]) -> Row:
    measured = Measured(
        setup="relay",
        concurrency=64,
        tokens=tokens,
        tokens_per_s=1000.0,
        cpu_us_per_token={},
        worker_counts={"steps": steps, "events": tokens, "tokens": tokens},
        cpu_s=redis_s,
        wall_s=1.0,
    )
    return Row("one", 64, measured)


def _exact(steps: int, tokens: int) -> float:
    return 1e-6 * (ALPHA_US * steps + BETA_US * tokens)


def test_the_fit_recovers_the_costs_of_loads_with_different_tokens_per_step() -> None:
    rows = [_row(steps, tokens, {"redis": _exact(steps, tokens)}) for steps, tokens in ((1000, 16_000), (900, 57_600))]
    got = fit(rows, "all")
    assert got.per_step_us == pytest.approx(ALPHA_US)
    assert got.per_token_us == pytest.approx(BETA_US)


def test_the_fit_refuses_loads_that_cannot_separate_the_costs() -> None:
    rows = [_row(steps, 64 * steps, {"redis": _exact(steps, 64 * steps)}) for steps in (500, 1000)]
    with pytest.raises(ValueError, match="tokens per step"):
        fit(rows, "all")


def test_a_cluster_row_tells_its_mean_and_busiest_primary_from_its_replicas() -> None:
    cpu = {"redis primary :1": 0.3, "redis primary :2": 0.1, "redis replica :3": 0.2, "redis replica :4": 0.2}
    row = _row(100, 1000, cpu)
    assert row.redis_s("all") == pytest.approx(0.8)
    assert row.redis_s("primary") == pytest.approx(0.2)
    assert row.redis_s("busiest") == pytest.approx(0.3)
    assert row.redis_s("replicas") == pytest.approx(0.4)


def test_the_busiest_primary_holds_its_rounded_up_part_of_the_twelve_request_shards() -> None:
    assert busiest_share(3) == pytest.approx(4 / 12)
    assert busiest_share(5) == pytest.approx(3 / 12)
    assert busiest_share(12) == pytest.approx(1 / 12)


def test_the_model_counts_workers_per_core_from_the_costs() -> None:
    # 10k tokens/s at 64 a step: 156.25 steps/s; one Redis 156.25·80 + 10,000·1.5 µs = 27.5 ms a second.
    model = capacity(Fit(ALPHA_US, BETA_US, 4), Fit(40.0, 0.8, 4), 10_000, 64, 100, measured=3)
    assert model.one_redis_core_s_per_worker == pytest.approx(0.0275)
    assert model.workers_per_redis_core == pytest.approx(1 / 0.0275)
    assert model.primary_core_s_per_worker == pytest.approx(0.01425)  # 6.25 ms of steps, 8 ms of tokens
    # Per node: 100 · (6.25 + 8 · 3·share(N)) ms: 1.225 s at 4 or 5, 1.025 s at 6 to 11, 0.825 s at 12.
    assert model.shards_if_steps_per_node == 12
    # Per slot: 100 · 14.25 ms · 3·share(N): 1.069 s at 4 or 5, 0.7125 s at 6.
    assert model.shards_if_steps_per_slot == 6


def test_the_model_finds_no_cluster_when_the_per_step_part_alone_fills_a_primary() -> None:
    model = capacity(Fit(ALPHA_US, BETA_US, 4), Fit(100.0, 0.5, 4), 10_000, 64, 100, measured=3)
    assert model.shards_if_steps_per_node is None  # 100 · 15.6 ms of steps on every primary
