"""A Kimi-Linear model's decoder layers over decode rows as one C call (``native.decode_layers``) against the
layers run one by one: bit for bit — every step's logits and every state after — since a decode row of
one path must be the twin of the same row through the other (a verify row, a decode row beside a
prefill, a bf16 model's, all take the layers one by one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.models import bench_model
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.kimi_linear_decode import FusedDecodeLayers
from metrale.worker.model.interface import ForwardChunk, SequenceState
from metrale.worker.model.loader import load_model

BLOCK, BLOCKS = 16, 6


def _decode_run(
    model_dir: Path, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[torch.Tensor], list[SequenceState]]:
    """Three prompts prefilled, four decode steps of all three, then one of the second alone."""
    calls = {"run": 0}
    run = FusedDecodeLayers.run

    def counted(self: FusedDecodeLayers, *args: Any) -> torch.Tensor:
        calls["run"] += 1
        return run(self, *args)

    monkeypatch.setattr(FusedDecodeLayers, "run", counted)
    if not fused:
        monkeypatch.setattr(FusedDecodeLayers, "takes", lambda *args: False)
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
    monkeypatch.undo()
    assert calls["run"] == (5 if fused else 0)
    return logits, states


@pytest.fixture(scope="module")
def medium_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Kimi bench model's shape (MoE with grouped routing and a shared expert, 4-head MLA)."""
    return bench_model("medium-4-heads", tmp_path_factory.mktemp("medium"))


@pytest.mark.parametrize("which", ["tiny", "medium-4-heads"])
def test_fused_decode_layers_are_the_layer_by_layer_bits(
    which: str, tiny_model_dir: Path, medium_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_model_dir if which == "tiny" else medium_model_dir
    fused_logits, fused_states = _decode_run(model_dir, True, monkeypatch)
    plain_logits, plain_states = _decode_run(model_dir, False, monkeypatch)
    for step, (fused, plain) in enumerate(zip(fused_logits, plain_logits, strict=True)):
        assert torch.equal(fused, plain), step
    for fused_state, plain_state in zip(fused_states, plain_states, strict=True):
        assert fused_state.keys() == plain_state.keys()
        for name, tensor in fused_state.items():
            assert torch.equal(tensor, plain_state[name]), name


def test_a_bf16_model_takes_the_layers_one_by_one(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype="bfloat16")
    assert not model._fused_layers().fits
