"""The serving forward: chunking, batching and state export/import never change the numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model
from tests.worker.model.helpers import all_row_logits, blocks_for, chunk_logits, greedy_continuation

BLOCK = 16


@pytest.fixture(scope="module")
def executor(tiny_model_dir: Path) -> ModelExecutor:
    return ModelExecutor(load_model(tiny_model_dir), num_slots=8, num_blocks=96, block_size=BLOCK)


def _prompt(executor: ModelExecutor, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, executor.vocab_size, (length,), generator=g).tolist()


@pytest.mark.parametrize("chunk", [1, 7, 64, 150], ids=lambda c: f"chunk{c}")
def test_chunked_prefill_equals_one_shot(executor: ModelExecutor, chunk: int) -> None:
    prompt = _prompt(executor, 150, seed=chunk)
    expected = all_row_logits(executor, prompt, slot=0)
    blocks = blocks_for(executor, len(prompt), first=20)
    pieces = [
        chunk_logits(executor, ForwardChunk(1, blocks, start, prompt[start : start + chunk]))
        for start in range(0, len(prompt), chunk)
    ]
    assert (torch.cat(pieces) - expected).abs().max().item() <= 1e-5


def test_batch_of_sequences_at_different_positions_equals_each_alone(executor: ModelExecutor) -> None:
    """Decode rows and prefill chunks (fresh and continuing) of several sequences in one forward."""
    prompts = [_prompt(executor, n, seed=n) for n in (5, 33, 70, 12)]
    # Bring sequences 0 and 1 to positions 5 and 20 first, each alone, in slots 0 and 1.
    cut = [len(prompts[0]) - 1, 20]
    blocks = [blocks_for(executor, 80, first=6 * i) for i in range(4)]
    for i in (0, 1):
        executor.forward([ForwardChunk(i, blocks[i], 0, prompts[i][: cut[i]])])
    chunks = [
        ForwardChunk(0, blocks[0], cut[0], prompts[0][cut[0] :]),  # one decode row
        ForwardChunk(1, blocks[1], cut[1], prompts[1][cut[1] :]),  # continuing prefill
        ForwardChunk(2, blocks[2], 0, prompts[2]),  # fresh prefill
        ForwardChunk(3, blocks[3], 0, prompts[3]),
    ]
    batched = executor.forward(chunks)
    for i, prompt in enumerate(prompts):
        alone = all_row_logits(executor, prompt, slot=5)[-1]
        assert (batched[i] - alone).abs().max().item() <= 1e-5, f"sequence {i}"


def test_fresh_chunk_ignores_whatever_the_slot_held(executor: ModelExecutor) -> None:
    prompt = _prompt(executor, 40, seed=7)
    clean = all_row_logits(executor, prompt, slot=2)
    executor.forward([ForwardChunk(2, blocks_for(executor, 40), 0, _prompt(executor, 40, seed=8))])
    for pool in (*executor.pool.recurrent.values(), *executor.pool.conv.values()):
        pool[2].fill_(1e30)
    assert torch.equal(all_row_logits(executor, prompt, slot=2), clean)


def test_state_export_import_into_other_slot_and_blocks_is_bit_identical(executor: ModelExecutor) -> None:
    prompt = _prompt(executor, 45, seed=9)
    steps = 12
    blocks_a = blocks_for(executor, 80, first=40)
    blocks_b = list(reversed(blocks_for(executor, 80, first=60)))  # different, non-contiguous order
    prefill = executor.forward([ForwardChunk(3, blocks_a, 0, prompt)])
    state = executor.export_state(3, blocks_a, len(prompt))
    assert all(t.device.type == "cpu" for t in state.values())
    executor.import_state(state, 6, blocks_b)
    token = [int(prefill[0].argmax())]
    for step in range(steps):
        position = len(prompt) + step
        a = executor.forward([ForwardChunk(3, blocks_a, position, token)])
        b = executor.forward([ForwardChunk(6, blocks_b, position, token)])
        assert torch.equal(a, b), f"step {step}"
        token = [int(a[0].argmax())]
    assert executor.state_nbytes(len(prompt)) == sum(t.nbytes for t in state.values())


def test_greedy_decode_is_reproducible_across_slots(executor: ModelExecutor) -> None:
    prompt = _prompt(executor, 20, seed=11)
    assert greedy_continuation(executor, prompt, 16, slot=4) == greedy_continuation(executor, prompt, 16, slot=7)
