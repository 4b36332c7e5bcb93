"""Our Qwen families (Qwen3.5 dense and MoE, Qwen3-Next) against transformers 5.23's
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` / ``Qwen3NextForCausalLM``, both
loaded in float32 from the same release-layout checkpoint (bf16 tensors written by ``save_pretrained``)."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from metrale.worker.engine.engine import Engine
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.qwen3_5 import Qwen35Model
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig
from tests.worker.model.helpers import all_row_logits, greedy_continuation
from tests.worker.model.qwen_reference import (
    QWEN_CONFIGS,
    QWEN_MOE_CONFIGS,
    QWEN_NEXT_CONFIGS,
    hf_model_class,
    make_hf_qwen_checkpoint,
)

BLOCK = 16


@pytest.fixture(scope="module", params=[*sorted(QWEN_CONFIGS), *sorted(QWEN_MOE_CONFIGS), *sorted(QWEN_NEXT_CONFIGS)])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    make_hf_qwen_checkpoint(request.param, directory, seed=3)
    hf, info = hf_model_class(request.param).from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # transformers reads the layout whole
    return hf.eval(), directory


def _executor(directory: Path, slots: int = 2, blocks: int = 32) -> ModelExecutor:
    return ModelExecutor(
        load_model(directory, dtype=torch.float32), num_slots=slots, num_blocks=blocks, block_size=BLOCK
    )


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_loads_the_release_layout_as_a_qwen3_5_model(checkpoint: tuple[Any, Path]) -> None:
    _, directory = checkpoint
    model = load_model(directory, dtype=torch.float32)
    assert isinstance(model, Qwen35Model)  # Qwen3-Next's decoder is Qwen3.5's
    assert model.config.family == (
        "qwen3_next" if directory.name.startswith("next") else "qwen3_5_moe" if "moe" in directory.name else "qwen3_5"
    )
    assert model.weight_dtype is torch.float32


@pytest.mark.parametrize("length", [1, 7, 64, 150])  # one row, a few, one 64-token chunk, several
def test_prompt_logits_match_transformers(checkpoint: tuple[Any, Path], length: int) -> None:
    hf, directory = checkpoint
    prompt = _prompt(hf.config.get_text_config().vocab_size, length, seed=length)
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([prompt])).logits[0]
    got = all_row_logits(_executor(directory), prompt)
    delta = (got - expected).abs().max().item()
    print(f"{directory.name} T={length}: max |Δ logits| = {delta:.3g} (logits up to {expected.abs().max():.3g})")
    assert delta <= 1e-4


def test_decode_steps_match_transformers_generate(checkpoint: tuple[Any, Path]) -> None:
    hf, directory = checkpoint
    prompt = _prompt(hf.config.get_text_config().vocab_size, 24, seed=2)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert greedy_continuation(_executor(directory), prompt, 24) == out[0, len(prompt) :].tolist()


def test_greedy_batch_of_varied_prompts_matches_transformers(checkpoint: tuple[Any, Path]) -> None:
    """Sixteen prompts of 1 to 100 tokens generated together by the engine (chunked prefill, decode rows
    and prefill chunks in one forward), each token-identical to transformers' greedy generate alone."""
    hf, directory = checkpoint
    rng = random.Random(7)
    vocab = hf.config.get_text_config().vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 100))] for _ in range(16)]
    config = SchedulerConfig(
        max_batch_tokens=96, max_seqs=16, num_slots=16, num_blocks=160, block_size=BLOCK, max_model_len=160 * BLOCK
    )
    engine = Engine(_executor(directory, slots=16, blocks=160), config, eos_token_ids=(), seed=0)
    results = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert result.completions[0].token_ids == out[0, len(prompt) :].tolist(), len(prompt)


def test_vision_tower_and_mtp_head_are_skipped_with_one_log_line_each(
    checkpoint: tuple[Any, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, directory = checkpoint
    mtp = directory / "mtp.safetensors"  # as releases carry it; transformers' save_pretrained does not
    save_file({"mtp.fc.weight": torch.zeros(64, 128), "mtp.norm.weight": torch.zeros(64)}, str(mtp))
    try:
        with caplog.at_level(logging.INFO, logger="metrale.worker.model.loader"):
            load_model(directory, dtype=torch.float32)
    finally:
        mtp.unlink()
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    has_vision = not directory.name.startswith("next")  # Qwen3-Next is text only
    assert len(lines) == 1 + has_vision, lines
    assert has_vision == any("vision tower" in line and "model.visual." in line for line in lines)
    assert any("multi-token-prediction head (2 tensors under mtp.*)" in line for line in lines)


@pytest.fixture(params=sorted(QWEN_MOE_CONFIGS))
def moe_directory(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    make_hf_qwen_checkpoint(request.param, directory, seed=5)
    return directory


def test_moe_experts_stored_one_tensor_each_load_the_same(moe_directory: Path, tmp_path: Path) -> None:
    """Some MoE checkpoints store ``experts.J.{gate,up,down}_proj.weight`` where transformers writes the
    fused ``experts.gate_up_proj`` / ``experts.down_proj``: both load to the same model."""
    from safetensors.torch import load_file

    directory = moe_directory
    tensors: dict[str, torch.Tensor] = {}
    for file in directory.glob("*.safetensors"):
        for name, tensor in load_file(str(file)).items():
            prefix, _, part = name.rpartition(".experts.")
            if part == "gate_up_proj":
                for j, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                    tensors[f"{prefix}.experts.{j}.gate_proj.weight"] = gate.contiguous()
                    tensors[f"{prefix}.experts.{j}.up_proj.weight"] = up.contiguous()
            elif part == "down_proj":
                tensors.update({f"{prefix}.experts.{j}.down_proj.weight": t for j, t in enumerate(tensor)})
            else:
                tensors[name] = tensor
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    fused, per_expert = load_model(directory, dtype=torch.float32), load_model(tmp_path, dtype=torch.float32)
    assert any(".experts." in name for name in tensors)
    for (name, a), (_, b) in zip(fused.named_parameters(), per_expert.named_parameters(), strict=True):
        assert torch.equal(a, b), name
