"""Hypothesis strategies for random schedules: pool sizes small enough to force both kinds of
preemption, and requests arriving, stopping and being cancelled at random steps."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from metrale.worker.scheduler.config import SchedulerConfig, blocks_for
from metrale.worker.scheduler.sequence import Priority

TOKEN_RANGE = 30
"""Prompt and stop tokens lie in ``[0, TOKEN_RANGE)``, below the fake's GARBAGE id."""

MAX_REQUESTS = 6


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a scenario; its prompt starts with its own index, so prompts are distinct."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    priority: Priority
    stop_token_ids: tuple[int, ...]
    include_stop_token: bool
    greedy: bool
    ignore_eos: bool
    seed: int
    arrival_step: int
    abort_step: int | None


@dataclass(frozen=True, slots=True)
class Scenario:
    config: SchedulerConfig
    requests: tuple[RequestSpec, ...]


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(4, 20))
    watermark = draw(st.integers(0, 2))
    fewest_blocks = blocks_for(max_model_len, block_size) + watermark
    num_slots = draw(st.integers(1, 4))
    max_seqs = draw(st.integers(1, num_slots + 1))
    return SchedulerConfig(
        max_batch_tokens=draw(st.integers(max_seqs, max_seqs + 12)),
        max_seqs=max_seqs,
        num_slots=num_slots,
        num_blocks=draw(st.integers(fewest_blocks, fewest_blocks + 4)),
        block_size=block_size,
        watermark=watermark,
        swap_space_bytes=draw(st.sampled_from([0, 80, 200, 400, 100_000])),
        max_model_len=max_model_len,
        checkpoint_grid=draw(st.none() | st.integers(2, 6)),
    )


@st.composite
def request_specs(draw: st.DrawFn, index: int, max_model_len: int) -> RequestSpec:
    prompt_len = draw(st.integers(1, max_model_len // 2) | st.integers(1, max_model_len))
    rest = draw(st.lists(st.integers(0, TOKEN_RANGE - 1), min_size=prompt_len - 1, max_size=prompt_len - 1))
    return RequestSpec(
        request_id=f"r{index}",
        prompt=(index, *rest),
        max_tokens=draw(st.integers(1, 12)),
        n=draw(st.integers(1, 3)),
        priority=draw(st.sampled_from(Priority)),
        stop_token_ids=tuple(draw(st.sets(st.integers(0, TOKEN_RANGE - 1), max_size=2))),
        include_stop_token=draw(st.booleans()),
        greedy=draw(st.booleans()),
        ignore_eos=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        arrival_step=draw(st.integers(0, 6)),
        abort_step=draw(st.none() | st.none() | st.integers(0, 15)),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    config = draw(configs())
    count = draw(st.integers(1, MAX_REQUESTS))
    requests = tuple(draw(request_specs(index, config.max_model_len)) for index in range(count))
    return Scenario(config, requests)
