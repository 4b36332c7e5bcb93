"""A few decode steps of three sequences through a real executor, to compare two paths' bits: the logits of
every step and each sequence's whole state after."""

from __future__ import annotations

from pathlib import Path

import torch

from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk, SequenceState
from metrale.worker.model.loader import load_model

BLOCK, BLOCKS = 16, 6


def decode_run(model_dir: Path) -> tuple[list[torch.Tensor], list[SequenceState]]:
    """Three prompts prefilled, four decode steps of all three, then one of the second alone (fp32)."""
    model = load_model(model_dir, dtype="float32")
    executor = ModelExecutor(model, num_slots=3, num_blocks=3 * BLOCKS, block_size=BLOCK)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (5, 17, 30)]
    blocks = [list(range(s * BLOCKS, (s + 1) * BLOCKS)) for s in range(3)]
    executor.forward([ForwardChunk(s, blocks[s], 0, prompts[s]) for s in range(3)])
    logits = []
    for step in range(4):
        chunks = [ForwardChunk(s, blocks[s], len(prompts[s]) + step, [40 + 7 * s + step]) for s in range(3)]
        logits.append(executor.forward(chunks))
    logits.append(executor.forward([ForwardChunk(1, blocks[1], len(prompts[1]) + 4, [99])]))
    states = [executor.export_state(s, blocks[s], len(prompts[s]) + 4 + (s == 1)) for s in range(3)]
    return logits, states


DECODE_FORWARDS = 5
"""The decode forwards of a :func:`decode_run`."""


def assert_same_bits(
    first: tuple[list[torch.Tensor], list[SequenceState]], second: tuple[list[torch.Tensor], list[SequenceState]]
) -> None:
    """Two :func:`decode_run` results are equal bit for bit: every step's logits, every state tensor."""
    for step, (a, b) in enumerate(zip(first[0], second[0], strict=True)):
        assert torch.equal(a, b), f"logits of decode forward {step}"
    for a_state, b_state in zip(first[1], second[1], strict=True):
        assert a_state.keys() == b_state.keys()
        for name, tensor in a_state.items():
            assert torch.equal(tensor, b_state[name]), name
