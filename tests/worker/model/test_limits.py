"""``met model inspect`` and the engine agree on what fits: the bytes inspect predicts are the bytes the
worker allocates (weights and state pools), the sequences it says fit in a memory are what an engine
sized that way holds, and a prompt past the limit is refused with the numbers behind the limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.model.inspect import summarize_directory
from metrale.worker.model.state import StatePool
from metrale.worker.scheduler.config import SchedulerConfig, blocks_for
from metrale.worker.scheduler.scheduler import PromptTooLongError, Scheduler
from metrale.worker.scheduler.sequence import Priority, StopParams


def _pool_bytes(pool: StatePool) -> int:
    tensors = [*pool.recurrent.values(), *pool.conv.values(), *pool.kv.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_inspect_predicts_the_bytes_an_engine_allocates(family_model_dir: Path, dtype: torch.dtype) -> None:
    summary = summarize_directory(family_model_dir, dtype)
    limits = EngineLimits(max_seqs=3, num_blocks=40, block_size=16)

    loaded = build_engine(family_model_dir, limits, dtype=dtype)

    model = loaded.executor.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights == summary.parameters.weight_bytes
    expected_pool = 3 * summary.state.slot_bytes + 40 * 16 * summary.state.token_bytes
    assert _pool_bytes(loaded.executor.pool) == expected_pool


def test_the_sequences_inspect_says_fit_are_an_engine_that_fits_and_takes_a_full_context(
    tiny_model_dir: Path,
) -> None:
    """Sized from ``capacity``: that many slots and their context's blocks fit in the memory, one more
    sequence would not, and the scheduler takes a prompt of the whole context and refuses one token more."""
    summary = summarize_directory(tiny_model_dir, torch.float32)
    context, block_size = 1000, 16
    memory = summary.parameters.weight_bytes + 5 * summary.state.total(context) + summary.state.slot_bytes
    capacity = summary.capacity(memory, context)
    assert capacity.sequences == 5
    limits = EngineLimits(
        max_seqs=capacity.sequences,
        num_blocks=capacity.sequences * blocks_for(context, block_size),
        max_model_len=context,
    )

    loaded = build_engine(tiny_model_dir, limits, dtype=torch.float32)

    weights = sum(p.numel() * p.element_size() for p in loaded.executor.model.parameters())
    used = weights + _pool_bytes(loaded.executor.pool)
    assert used <= memory < used + summary.state.total(context)
    scheduler = Scheduler(loaded.engine._scheduler.config, summary.state.total)
    scheduler.add("whole", list(range(1, context + 1)), StopParams(max_tokens=1), Priority.INTERACTIVE)
    with pytest.raises(PromptTooLongError, match=f"has {context + 1:,} tokens; the limit is {context:,} tokens"):
        scheduler.add("over", list(range(1, context + 2)), StopParams(max_tokens=1), Priority.INTERACTIVE)


@pytest.mark.parametrize(
    ("num_blocks", "max_model_len", "model_context", "why"),
    [
        pytest.param(
            8,
            128,
            131072,
            "128 tokens (the cache pool: 8 blocks of 16 tokens; the model's context is 131,072)",
            id="pool",
        ),
        pytest.param(
            8192,
            4096,
            4096,
            "4,096 tokens (the model's context; the cache pool holds 131,072 tokens in 8,192 blocks of 16 tokens)",
            id="model-context",
        ),
        pytest.param(
            8192,
            1000,
            4096,
            "1,000 tokens (max_model_len; the cache pool holds 131,072 tokens, the model's context is 4,096)",
            id="operator",
        ),
    ],
)
def test_a_prompt_past_the_limit_is_refused_with_the_numbers_behind_it(
    num_blocks: int, max_model_len: int, model_context: int, why: str
) -> None:
    config = SchedulerConfig(
        max_seqs=2,
        num_slots=2,
        num_blocks=num_blocks,
        block_size=16,
        max_model_len=max_model_len,
        model_context=model_context,
    )
    scheduler = Scheduler(config, lambda length: 0)

    with pytest.raises(PromptTooLongError) as refused:
        scheduler.add("long", [1] * (max_model_len + 5), StopParams(max_tokens=1), Priority.INTERACTIVE)

    assert str(refused.value) == f"the prompt has {max_model_len + 5:,} tokens; the limit is {why}"


def test_engine_limits_cap_the_context_at_the_pool_and_say_so(tiny_model_dir: Path) -> None:
    summary = summarize_directory(tiny_model_dir, torch.float32)
    engine = build_engine(tiny_model_dir, EngineLimits(max_seqs=2, num_blocks=4), dtype=torch.float32).engine
    scheduler_config = engine._scheduler.config
    assert scheduler_config.max_model_len == min(64, summary.context)
    assert scheduler_config.model_context == summary.context
