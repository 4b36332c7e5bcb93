"""Small drivers of a ModelExecutor for model tests: whole-prompt logits and greedy continuation."""

from __future__ import annotations

import torch

from metrale.worker.model.batch import BatchLayout
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk


def blocks_for(executor: ModelExecutor, length: int, first: int = 0) -> list[int]:
    """Consecutive block ids starting at ``first`` covering ``length`` tokens."""
    return list(range(first, first + -(-length // executor.block_size)))


def chunk_logits(executor: ModelExecutor, chunk: ForwardChunk) -> torch.Tensor:
    """Logits ``[len(chunk.token_ids), vocab]`` of every row of one chunk (advances the slot's state)."""
    layout = BatchLayout.build([chunk], executor.block_size, executor.device)
    rows = torch.arange(layout.num_rows)
    return executor.model(layout, executor.pool, rows).float()


def all_row_logits(executor: ModelExecutor, prompt: list[int], slot: int = 0) -> torch.Tensor:
    """Logits of every prompt position, from one fresh prefill."""
    return chunk_logits(executor, ForwardChunk(slot, blocks_for(executor, len(prompt)), 0, prompt))


def greedy_continuation(executor: ModelExecutor, prompt: list[int], steps: int, slot: int = 0) -> list[int]:
    """Prefill then decode one token at a time, state carried in ``slot``; return the argmax tokens."""
    total = len(prompt) + steps
    blocks = blocks_for(executor, total)
    logits = executor.forward([ForwardChunk(slot, blocks, 0, prompt)])
    out = [int(logits[0].argmax())]
    while len(out) < steps:
        position = len(prompt) + len(out) - 1
        logits = executor.forward([ForwardChunk(slot, blocks, position, [out[-1]])])
        out.append(int(logits[0].argmax()))
    return out


def teacher_forced_logits(executor: ModelExecutor, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits ``[len(continuation), vocab]`` predicting each token of ``continuation``: prefill ``prompt``,
    then decode ``continuation`` one token per step (whatever the model would have picked)."""
    blocks = blocks_for(executor, len(prompt) + len(continuation))
    logits = [executor.forward([ForwardChunk(0, blocks, 0, prompt)])[0]]
    for offset, token in enumerate(continuation[:-1]):
        logits.append(executor.forward([ForwardChunk(0, blocks, len(prompt) + offset, [token])])[0])
    return torch.stack(logits)
