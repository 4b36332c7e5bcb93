"""Sizing from the config alone: parameter counts against transformers' own model and the release's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.worker.model.config import ModelConfig
from metrale.worker.model.inspect import count_parameters, summarize
from tests.worker.model.hf_reference import HF_CONFIGS, make_hf_checkpoint

RELEASE_CONFIG = Path(__file__).parent / "data" / "kimi-linear-48b-a3b-instruct.config.json"  # the release, key for key
"""The Kimi-Linear-48B-A3B-Instruct release's config.json (its README sizes it at 49.13B by hand, and
its index at 49.12B parameters)."""


def _hf_total(hf: Any) -> int:
    """transformers' parameters plus the router score-correction biases, which it keeps as buffers
    (stored in every checkpoint, the release's included; a parameter of ours)."""
    biases = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in hf.parameters()) + biases


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_total_parameters_equal_transformers_models(name: str, tmp_path: Path) -> None:
    hf = make_hf_checkpoint(name, tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)  # only the config is read
    counted = count_parameters(config, torch.float32)
    assert counted.total == _hf_total(hf)
    assert counted.weight_bytes == 4 * counted.total


def test_active_parameters_are_all_but_the_routed_experts_not_chosen(tmp_path: Path) -> None:
    hf = make_hf_checkpoint("moe-qlora-mla-kda-kda-mla", tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    routed = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    active = count_parameters(config, torch.float32).active
    assert active == _hf_total(hf) - routed + routed * 2 // 8  # top-2 of 8 routed experts per token


@pytest.fixture
def release_dir(tmp_path: Path) -> Path:
    """A folder holding only the release's config.json."""
    if not RELEASE_CONFIG.is_file():
        pytest.skip(f"{RELEASE_CONFIG} is not on this machine")
    (tmp_path / "config.json").write_text(RELEASE_CONFIG.read_text())
    return tmp_path


def test_the_release_is_sized_from_its_config_alone(release_dir: Path) -> None:
    config = ModelConfig.from_pretrained(release_dir)
    summary = summarize(release_dir, config, torch.bfloat16)
    assert summary.parameters.total == pytest.approx(49.13e9, rel=0.01)
    assert summary.parameters.active == pytest.approx(3.5e9, rel=0.05)  # 8 routed + 1 shared, embeddings
    # Weights: 2 bytes each, but conv taps, A_log, dt_bias and router biases stay fp32.
    assert 2 * summary.parameters.total < summary.parameters.weight_bytes < 2.001 * summary.parameters.total
    kda_layers, mla_layers = 20, 7
    assert summary.state.slot_bytes == kda_layers * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 4)
    assert summary.state.token_bytes == mla_layers * (512 + 64) * 2
    capacity = summary.capacity(141 * 10**9, 32 * 1024)
    expected = (141 * 10**9 - summary.parameters.weight_bytes) // summary.state.total(32 * 1024)
    assert capacity.sequences == expected
    assert 100 < expected < 200


def test_config_dtype_key_is_the_release_one(release_dir: Path) -> None:
    assert json.loads((release_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert ModelConfig.from_pretrained(release_dir).dtype == "bfloat16"
