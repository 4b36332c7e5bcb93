"""Our KimiLinear forward against transformers 5.23's on checkpoints that transformers itself saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.loader import load_model
from tests.worker.model.helpers import all_row_logits, greedy_continuation
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
