"""Sizing from the config alone: parameter counts against transformers' own model and the release's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.worker.model.config import ModelConfig, ModelConfigError
from metrale.worker.model.families import qwen_sizing
from metrale.worker.model.inspect import count_parameters, summarize, summarize_directory
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


# Qwen3.5 / Qwen3.5-MoE / Qwen3-Next ---------------------------------------------------------------

DATA = Path(__file__).parent / "data"
QWEN_RELEASES = {  # the releases' config.json, key for key (../shared/reference/qwen3.5-qwen3-next)
    "qwen3.5-0.8B": "qwen3.5-0.8B.config.json",
    "qwen3.5-4B": "qwen3.5-4B.config.json",
    "qwen3.5-35b-a3b-text": "qwen3.5-35b-a3b-text.config.json",
    "qwen3-next-80b-a3b-instruct": "qwen3-next-80b-a3b-instruct.config.json",
}


def _qwen_dir(name: str, tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text((DATA / QWEN_RELEASES[name]).read_text())
    return tmp_path


def _transformers_counts(directory: Path) -> tuple[int, int, int]:
    """transformers' (language model, routed experts, vision tower) parameters of the config in
    ``directory``, its models built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    config = AutoConfig.from_pretrained(directory)
    text = getattr(config, "text_config", config)
    text.tie_word_embeddings = config.tie_word_embeddings
    with torch.device("meta"):
        language_model = AutoModelForCausalLM.from_config(text)
        vision = 0
        if type(config).__name__ == "Qwen3_5Config":
            whole = Qwen3_5ForConditionalGeneration(config)
            vision = sum(p.numel() for n, p in whole.named_parameters() if ".visual." in n)
    total = sum(p.numel() for p in language_model.parameters())  # tied weights once
    routed = sum(p.numel() for n, p in language_model.named_parameters() if ".mlp.experts." in n)
    return total, routed, vision


@pytest.mark.parametrize("name", sorted(QWEN_RELEASES))
def test_qwen_parameters_equal_transformers_models(name: str, tmp_path: Path) -> None:
    summary = summarize_directory(_qwen_dir(name, tmp_path))
    counts = qwen_sizing.parameter_counts(
        qwen_sizing.QwenShape.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    )
    total, routed, vision = _transformers_counts(tmp_path)
    assert summary.parameters.total == counts.served == total
    assert counts.routed == routed
    assert counts.vision == vision


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        ("qwen3.5-0.8B", 0.85e9, None),  # the model card's size: with the vision tower
        ("qwen3.5-35b-a3b-text", 35e9, 3e9),
        ("qwen3-next-80b-a3b-instruct", 80e9, 3e9),
    ],
)
def test_qwen_releases_are_sized_as_published(name: str, total: float, active: float | None, tmp_path: Path) -> None:
    summary = summarize_directory(_qwen_dir(name, tmp_path))
    counts = qwen_sizing.parameter_counts(
        qwen_sizing.QwenShape.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    )
    assert counts.served + counts.vision == pytest.approx(total, rel=0.01)
    if active is not None:
        # "A3B" is a rounded name: without the embeddings and LM head the 35B-A3B activates 2.44B per
        # token, the Next-80B-A3B 3.25B (3.45B and 3.87B with them, as the table prints first).
        embeddings = 2 * counts_vocab_hidden(tmp_path)
        assert summary.parameters.active - embeddings == pytest.approx(active, rel=0.2)


def counts_vocab_hidden(directory: Path) -> int:
    text = json.loads((directory / "config.json").read_text())
    return int(text["vocab_size"]) * int(text["hidden_size"])


def test_qwen3_next_with_its_mtp_head_is_the_release_index_total(tmp_path: Path) -> None:
    """The release's index holds 81.3B parameters: the 79.7B served plus its one MTP layer (an attention
    layer and a 512-expert MoE) and the head's projection and norms."""
    counts = qwen_sizing.parameter_counts(
        qwen_sizing.QwenShape.from_hf_dict(
            json.loads((DATA / QWEN_RELEASES["qwen3-next-80b-a3b-instruct"]).read_text())
        )
    )
    assert counts.served + counts.mtp == pytest.approx(81.3e9, rel=0.001)


def test_qwen3_5_state_and_kv_bytes(tmp_path: Path) -> None:
    summary = summarize_directory(_qwen_dir("qwen3.5-0.8B", tmp_path), "bfloat16")
    linear_layers, full_layers = 18, 6
    recurrent = 16 * 128 * 128 * 4  # [Hv, K, V] fp32
    conv = (2 * 16 * 128 + 16 * 128) * 3 * 4  # q, k, v channels × (kernel - 1), fp32
    assert summary.state.slot_bytes == linear_layers * (recurrent + conv)
    assert summary.state.token_bytes == full_layers * 2 * 2 * 256 * 2  # K and V × 2 KV heads × 256, bf16
    capacity = summary.capacity(24 * 10**9, 32 * 1024)
    assert capacity.sequences == (24 * 10**9 - summary.parameters.weight_bytes) // summary.state.total(32 * 1024)


def test_qwen3_next_state_and_kv_bytes(tmp_path: Path) -> None:
    summary = summarize_directory(_qwen_dir("qwen3-next-80b-a3b-instruct", tmp_path))
    assert summary.dtype == torch.bfloat16  # the config's torch_dtype
    linear_layers, full_layers = 36, 12
    assert summary.state.slot_bytes == linear_layers * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 4
    assert summary.state.token_bytes == full_layers * 2 * 2 * 256 * 2


def test_an_unknown_family_is_refused_naming_those_served(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelConfigError, match=r"model_type 'llama' is not supported .*kimi_linear.*qwen3_next"):
        summarize_directory(tmp_path)


def test_met_model_inspect_prints_a_qwen_release(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from metrale.cli.model_cmd import app

    result = CliRunner().invoke(
        app,
        ["inspect", str(_qwen_dir("qwen3-next-80b-a3b-instruct", tmp_path)), "--memory", "141GB", "--context", "32k"],
    )
    assert result.exit_code == 0, result.output
    for words in ("qwen3_next", "Gated DeltaNet", "79.7B", "MTP head", "81.3B", "sequences"):
        assert words in result.output


def test_every_served_family_is_sized() -> None:
    """``met model inspect`` takes the family from the registry: each one served has its summarizer."""
    from metrale.worker.model.families.registry import FAMILIES
    from metrale.worker.model.inspect import SUMMARIZERS

    assert set(SUMMARIZERS) == {family.name for family in FAMILIES}
