"""Our KimiLinear forward against transformers 5.23's on checkpoints that transformers itself saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.loader import load_model
from tests.worker.model.helpers import all_row_logits, greedy_continuation, teacher_forced_logits
from tests.worker.model.hf_reference import HF_CONFIGS, make_hf_checkpoint

PROMPT_LEN = 80  # more than one 64-token KDA chunk


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    return make_hf_checkpoint(request.param, directory), directory


def _prompt(vocab: int, length: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prompt_logits_match_transformers(checkpoint: tuple[Any, Path]) -> None:
    hf, directory = checkpoint
    prompt = _prompt(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    executor = ModelExecutor(load_model(directory), num_slots=2, num_blocks=16, block_size=16)
    got = all_row_logits(executor, prompt)
    assert (got - expected).abs().max().item() <= 1e-4


def test_greedy_tokens_match_transformers_generate(checkpoint: tuple[Any, Path]) -> None:
    hf, directory = checkpoint
    prompt = _prompt(hf.config.vocab_size, length=24, seed=2)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None)
    expected = out[0, len(prompt) :].tolist()
    assert len(expected) == 32
    executor = ModelExecutor(load_model(directory), num_slots=2, num_blocks=16, block_size=16)
    assert greedy_continuation(executor, prompt, 32) == expected


# bf16 -----------------------------------------------------------------------------------------------
# Both sides round to bf16 at different places, so neither is the truth: the truth is the fp32
# computation over the same (bf16-rounded) weights, which is what our fp32 path gives (checked above to
# 1e-4 against transformers). Routers get fixed routing (see ``make_hf_checkpoint``): a near-tie
# between experts flips with any rounding, in transformers' bf16 as in ours.

BF16_LOGIT_TOLERANCE = 0.3
"""Largest logit difference allowed against transformers' bf16 (logits span about ±5 here; bf16 keeps
8 bits of mantissa: measured 0.11–0.25)."""


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def bf16_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    directory = tmp_path_factory.mktemp(f"{request.param}-bf16")
    return make_hf_checkpoint(request.param, directory, dtype=torch.bfloat16, fixed_routing=True), directory


def _relative_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    return ((got - truth).norm() / truth.norm()).item()


def test_bf16_logits_match_transformers_bf16(bf16_checkpoint: tuple[Any, Path]) -> None:
    hf, directory = bf16_checkpoint
    prompt = _prompt(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    model = load_model(directory)  # auto: the config's bfloat16
    assert model.weight_dtype == torch.bfloat16
    got = all_row_logits(ModelExecutor(model, num_slots=2, num_blocks=16, block_size=16), prompt)
    truth = all_row_logits(
        ModelExecutor(load_model(directory, dtype="float32"), num_slots=2, num_blocks=16, block_size=16), prompt
    )
    assert (got - expected).abs().max().item() <= BF16_LOGIT_TOLERANCE
    # Ours is about as close to the fp32 truth as transformers' bf16 is (measured 0.8–1.1× its error).
    assert _relative_error(got, truth) <= 1.25 * _relative_error(expected, truth)


def test_bf16_greedy_choices_match_transformers_bf16(bf16_checkpoint: tuple[Any, Path]) -> None:
    """Along transformers' own bf16 greedy continuation, decoding one token per step, we pick its token
    at every step where its choice is clear (top-2 margin above our logit tolerance); random tiny models
    have many near-ties, and bf16 logits exact ties, where either pick is right."""
    hf, directory = bf16_checkpoint
    executor = ModelExecutor(load_model(directory), num_slots=2, num_blocks=16, block_size=16)
    agreed = total = 0
    for seed in (2, 3, 4, 5):
        prompt = _prompt(hf.config.vocab_size, length=24, seed=seed)
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
        expected = out.sequences[0, len(prompt) :]
        top2 = torch.stack([step[0].float() for step in out.logits]).topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > BF16_LOGIT_TOLERANCE
        picks = teacher_forced_logits(executor, prompt, expected.tolist()).argmax(-1)
        assert torch.equal(picks[clear], expected[clear]), f"seed {seed}"
        agreed, total = agreed + int((picks == expected).sum()), total + len(expected)
    assert agreed >= 0.95 * total  # measured 125–126 of 128
