"""``ForwardChunk.every_row``: a prefill chunk that asks for every row's logits gets exactly the logits
a forward of it alone gives for each of its tokens, next to decode rows and other prefills."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk, logit_row_counts
from metrale.worker.model.loader import load_model
from tests.worker.model.helpers import all_row_logits, blocks_for


@pytest.fixture(scope="module")
def executor(tiny_model_dir: Path) -> ModelExecutor:
    return ModelExecutor(load_model(tiny_model_dir), num_slots=8, num_blocks=96, block_size=16)


def test_every_row_chunks_among_decode_rows_and_prefills_equal_each_alone(executor: ModelExecutor) -> None:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, executor.vocab_size, (n,), generator=g).tolist() for n in (6, 40, 9, 17)]
    blocks = [blocks_for(executor, 64, first=8 * i) for i in range(4)]
    executor.forward([ForwardChunk(0, blocks[0], 0, prompts[0][:5])])
    executor.forward([ForwardChunk(1, blocks[1], 0, prompts[1][:20])])
    chunks = [
        ForwardChunk(3, blocks[3], 0, prompts[3], every_row=True),  # fresh prefill, every row
        ForwardChunk(0, blocks[0], 5, prompts[0][5:], every_row=True),  # a decode row asking for every row
        ForwardChunk(2, blocks[2], 0, prompts[2]),  # fresh prefill, last row
        ForwardChunk(1, blocks[1], 20, prompts[1][20:], every_row=True),  # continuing prefill, every row
    ]
    logits = executor.forward(chunks)
    counts = logit_row_counts(chunks)
    assert counts == [17, 1, 1, 20] and logits.shape[0] == sum(counts)
    expected = [
        all_row_logits(executor, prompts[3], slot=5),
        all_row_logits(executor, prompts[0], slot=5)[5:],
        all_row_logits(executor, prompts[2], slot=5)[-1:],
        all_row_logits(executor, prompts[1], slot=5)[20:],
    ]
    assert (logits - torch.cat(expected)).abs().max().item() <= 1e-5
