"""Our forward against transformers 5.23's on release-shaped checkpoints (bf16 shards, the release's tensor
names), both loaded in float32 from the same files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.loader import load_model
from metrale.worker.model.release_layout import RELEASE_ARCH, write_release_model
from tests.worker.model.helpers import all_row_logits, greedy_continuation

PROMPT_LEN = 80  # more than one 64-token KDA chunk


def _layers(kda: list[int], full: list[int]) -> dict[str, Any]:
    """``linear_attn_config`` with these (1-indexed) layers, the release-shaped heads otherwise."""
    return {**RELEASE_ARCH["linear_attn_config"], "kda_layers": kda, "full_attn_layers": full}


RELEASE_CONFIGS: dict[str, dict[str, Any]] = {
    "kda-kda-kda-mla-8experts": {},
    "mla-kda-kda-kda-mla-16experts-grouped-qlora": {
        "num_hidden_layers": 5,
        "linear_attn_config": _layers([2, 3, 4], [1, 5]),
        "num_experts": 16,
        "num_experts_per_token": 4,
        "num_expert_group": 4,
        "topk_group": 2,
        "q_lora_rank": 16,
    },
    "interleaved-4experts-top1-2shared-norenorm-2dense": {
        "num_hidden_layers": 6,
        "linear_attn_config": _layers([1, 3, 5], [2, 4, 6]),
        "num_experts": 4,
        "num_experts_per_token": 1,
        "num_shared_experts": 2,
        "moe_renormalize": False,
        "first_k_dense_replace": 2,
    },
}


@pytest.fixture(scope="module", params=sorted(RELEASE_CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import KimiLinearForCausalLM

    directory = write_release_model(tmp_path_factory.mktemp(request.param), seed=3, **RELEASE_CONFIGS[request.param])
    hf, info = KimiLinearForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # every release tensor used, none missing
    return hf.eval(), directory


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prompt_logits_match_transformers(checkpoint: tuple[Any, Path]) -> None:
    hf, directory = checkpoint
    prompt = _prompt(hf.config.vocab_size, PROMPT_LEN, seed=1)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    executor = ModelExecutor(load_model(directory, dtype=torch.float32), num_slots=2, num_blocks=16, block_size=16)
    got = all_row_logits(executor, prompt)
    delta = (got - expected).abs().max().item()
    print(f"{directory.name}: max |Δ logits| = {delta:.3g} (logits up to {expected.abs().max().item():.3g})")
    assert delta <= 1e-4


def test_greedy_tokens_match_transformers_generate(checkpoint: tuple[Any, Path]) -> None:
    hf, directory = checkpoint
    prompt = _prompt(hf.config.vocab_size, 24, seed=2)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = out[0, len(prompt) :].tolist()
    executor = ModelExecutor(load_model(directory, dtype=torch.float32), num_slots=2, num_blocks=16, block_size=16)
    assert greedy_continuation(executor, prompt, 24) == expected
