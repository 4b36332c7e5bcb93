"""The release-shaped tiny model holds what the Kimi-Linear release holds, and transformers loads it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from metrale.text.tokenizer import Tokenizer
from metrale.worker.model.release_layout import RELEASE_ARCH, release_config_dict, write_release_model
from tests.text.kimi_reference import no_tiktoken_cache

REFERENCE_CONFIG = Path(__file__).parent / "data" / "kimi-linear-48b-a3b-instruct.config.json"
"""The release's own ``config.json`` (moonshotai/Kimi-Linear-48B-A3B-Instruct), copied key for key."""

# The README of the reference folder: every tensor name of the release, N a layer, E an expert.
RELEASE_NAME_PATTERNS = [
    r"model\.embed_tokens\.weight",
    r"lm_head\.weight",
    r"model\.norm\.weight",
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight",
    r"model\.layers\.\d+\.self_attn\.([qkv]_proj|[qkv]_conv1d|[fg]_[ab]_proj|b_proj|o_norm|o_proj)\.weight",
    r"model\.layers\.\d+\.self_attn\.(A_log|dt_bias)",
    r"model\.layers\.\d+\.self_attn\.(q_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj|o_proj)\.weight",
    r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight",
    r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight",
    r"model\.layers\.\d+\.block_sparse_moe\.gate\.(weight|e_score_correction_bias)",
    r"model\.layers\.\d+\.block_sparse_moe\.shared_experts\.(gate|up|down)_proj\.weight",
]


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release_model(tmp_path_factory.mktemp("release"))


def stored(directory: Path) -> dict[str, tuple[str, torch.dtype, tuple[int, ...]]]:
    """Tensor name → (file, dtype, shape), read from the shards."""
    out: dict[str, tuple[str, torch.dtype, tuple[int, ...]]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name)
                out[name] = (file.name, tensor.dtype, tuple(tensor.shape))
    return out


def test_the_config_has_the_release_keys_and_agrees_with_the_tokenizer(release_dir: Path) -> None:
    config = json.loads((release_dir / "config.json").read_text())
    assert set(config) == set(json.loads(REFERENCE_CONFIG.read_text()))
    assert config["dtype"] == "bfloat16"
    kda, full = config["linear_attn_config"]["kda_layers"], config["linear_attn_config"]["full_attn_layers"]
    assert kda and full and sorted(kda + full) == list(range(1, config["num_hidden_layers"] + 1))
    assert config["moe_router_activation_func"] == "sigmoid" and config["use_grouped_topk"] is True
    assert config["first_k_dense_replace"] == 1
    tokenizer = Tokenizer.from_dir(release_dir)
    assert config["vocab_size"] == tokenizer.vocab_size
    assert config["bos_token_id"] == tokenizer.token_to_id("[BOS]")
    assert config["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    assert config["pad_token_id"] == tokenizer.token_to_id("[PAD]") == config["vocab_size"] - 1
    generation = json.loads((release_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_tensors_have_the_release_names_and_dtypes_in_indexed_shards(release_dir: Path) -> None:
    tensors = stored(release_dir)
    for name in tensors:
        assert any(re.fullmatch(pattern, name) for pattern in RELEASE_NAME_PATTERNS), name
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in tensors
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in tensors  # layer 4 (1-indexed) is MLA
    for name, (_, dtype, shape) in tensors.items():
        fp32 = name.endswith(("A_log", "dt_bias"))
        assert dtype == (torch.float32 if fp32 else torch.bfloat16), name
        if name.endswith("A_log"):
            assert shape == (1, 1, RELEASE_ARCH["linear_attn_config"]["num_heads"], 1)
    index = json.loads((release_dir / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {name: file for name, (file, _, _) in tensors.items()}
    files = sorted({file for file, _, _ in tensors.values()})
    assert len(files) >= 2
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    sizes = {name: torch.Size(shape).numel() * dtype.itemsize for name, (_, dtype, shape) in tensors.items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())


def test_transformers_loads_the_folder(release_dir: Path) -> None:
    from transformers import AutoTokenizer, KimiLinearForCausalLM

    with no_tiktoken_cache():
        tokenizer: Any = AutoTokenizer.from_pretrained(release_dir)
    config = json.loads((release_dir / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.eos_token_id == config["eos_token_id"]
    assert "<|im_assistant|>assistant<|im_middle|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    model, info = KimiLinearForCausalLM.from_pretrained(release_dir, output_loading_info=True)
    assert not any(info.values()), info
    assert model.dtype == torch.bfloat16
    kinds = {type(layer.self_attn).__name__ for layer in model.model.layers}
    assert kinds == {"KimiLinearAttention", "KimiLinearDeltaAttention"}


def test_overrides_are_release_keys_only() -> None:
    from metrale.text.tiktoken_vocab.kimi_writer import KimiTokenizerIds

    ids = KimiTokenizerIds(10, 266, 10, 12, 265)
    assert release_config_dict(ids, num_experts=4)["num_experts"] == 4
    with pytest.raises(ValueError, match="rms_norm_eps"):
        release_config_dict(ids, rms_norm_eps=1e-6)
