"""Exactness at length (issue #32): after an 8,192-token prompt, prefilled in 2,048-token chunks as the
engine runs it (each chunk attending to the earlier ones through the tiled prefill attention, the KDA
state carried across chunks), our greedy continuation equals transformers 5.23's ``generate`` on a
checkpoint transformers saved, and the prompt's last logits agree with its forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model
from tests.worker.model.helpers import blocks_for
from tests.worker.model.hf_reference import make_hf_checkpoint

CONFIG = "moe-qlora-mla-kda-kda-mla"
"""Two MLA layers (the quadratic part), two KDA layers, MoE, a low-rank query."""
PROMPT_LEN = 8192
CHUNK = 2048
"""The engine's default ``max_batch_tokens``: four prefill chunks."""
NEW_TOKENS = 16
LOGIT_TOLERANCE = 1e-3
"""Largest difference of the last prompt row's logits (80-token prompts agree to 1e-4; the sums here
run over 100× more positions)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    directory = tmp_path_factory.mktemp(CONFIG)
    return make_hf_checkpoint(CONFIG, directory), directory


@pytest.mark.slow
def test_the_greedy_continuation_after_8k_tokens_equals_transformers(checkpoint: tuple[Any, Path]) -> None:
    hf, directory = checkpoint
    prompt = torch.randint(3, hf.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = hf.generate(
            prompt[None],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    expected = out.sequences[0, PROMPT_LEN:].tolist()
    expected_first_logits = out.logits[0][0]

    executor = ModelExecutor(load_model(directory), num_slots=1, num_blocks=PROMPT_LEN // 16 + 4, block_size=16)
    tokens = prompt.tolist()
    blocks = blocks_for(executor, PROMPT_LEN + NEW_TOKENS)
    for start in range(0, PROMPT_LEN, CHUNK):
        logits = executor.forward([ForwardChunk(0, blocks, start, tokens[start : start + CHUNK])])
    assert (logits[0] - expected_first_logits).abs().max().item() <= LOGIT_TOLERANCE
    got = [int(logits[0].argmax())]
    while len(got) < NEW_TOKENS:
        logits = executor.forward([ForwardChunk(0, blocks, PROMPT_LEN + len(got) - 1, [got[-1]])])
        got.append(int(logits[0].argmax()))
    assert got == expected
