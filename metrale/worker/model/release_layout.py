"""A small random-weight model in exactly the layout of the Kimi-Linear-48B-A3B-Instruct release.

What the release folder holds, at a size a CPU runs: ``config.json`` with the release's keys and no others
(``RELEASE_KEYS``; 1-indexed ``linear_attn_config`` layers, a dense first layer, a sigmoid router with
``e_score_correction_bias`` and ``use_grouped_topk``), the release's tensor names (``block_sparse_moe``,
per-expert ``w1/w2/w3``, separate ``q/k/v_conv1d``), bf16 tensors but ``A_log`` and ``dt_bias`` in fp32,
``"dtype": "bfloat16"``, the weights sharded into ``model-0000N-of-0000M.safetensors`` with
``model.safetensors.index.json``, Kimi's tiktoken tokenizer (``text/tiktoken_vocab/kimi_writer.py``) and
``generation_config.json``. Seeded: the same arguments write the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from metrale.text.tiktoken_vocab.kimi_writer import KimiTokenizerIds, write_kimi_tokenizer
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.loader import INDEX_FILE
from metrale.worker.model.tiny import random_weights

RELEASE_TRANSFORMERS_VERSION = "4.57.1"

RELEASE_ARCH: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_kimi.KimiLinearConfig",
        "AutoModel": "modeling_kimi.KimiLinearModel",
        "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM",
    },
    "model_type": "kimi_linear",
    "dtype": "bfloat16",
    "transformers_version": RELEASE_TRANSFORMERS_VERSION,
    "hidden_size": 64,
    "head_dim": 16,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "model_max_length": 16384,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "linear_attn_config": {
        "full_attn_layers": [4],
        "kda_layers": [1, 2, 3],
        "num_heads": 2,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
    },
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
}
"""The release's ``config.json`` at a small size, but the token ids, which the tokenizer decides."""

RELEASE_KEYS = frozenset({*RELEASE_ARCH, "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"})
"""The keys of the release's ``config.json``."""

FP32_TENSORS = ("A_log", "dt_bias")
"""Tensors the release stores in fp32 (the others are bf16)."""


def release_config_dict(ids: KimiTokenizerIds, **overrides: Any) -> dict[str, Any]:
    """The ``config.json`` of a release-shaped model over the tokenizer with ``ids``; ``overrides``
    change release keys only (a key the release does not have raises ``ValueError``)."""
    unknown = sorted(set(overrides) - RELEASE_KEYS)
    if unknown:
        raise ValueError(f"not keys of the release config: {', '.join(unknown)}")
    tokens = {
        "vocab_size": ids.vocab_size,
        "bos_token_id": ids.bos_token_id,
        "eos_token_id": ids.eos_token_id,
        "pad_token_id": ids.pad_token_id,
    }
    return {**RELEASE_ARCH, **tokens, **overrides}


def release_tensors(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random tensors under the release's names and dtypes."""
    tensors: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(seed + 1)
    for name, tensor in random_weights(config, seed).items():
        if name.endswith("e_score_correction_bias"):  # non-zero, so that routing depends on it
            tensor = torch.empty(tensor.shape).normal_(0.0, 0.1, generator=generator)
        dtype = torch.float32 if name.rpartition(".")[2] in FP32_TENSORS else torch.bfloat16
        tensors[_release_name(config, name)] = tensor.to(dtype)
    return tensors


def _release_name(config: ModelConfig, name: str) -> str:
    """The release spells a MoE layer's MLP ``block_sparse_moe``."""
    parts = name.split(".")
    if len(parts) > 3 and parts[1] == "layers" and config.mlp_layer_types[int(parts[2])] == "moe":
        return name.replace(".mlp.", ".block_sparse_moe.", 1)
    return name


def write_shards(directory: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> list[str]:
    """Write ``tensors`` as ``num_shards`` (≥ 2) safetensors files of about equal size, in name order,
    plus their index; return the file names."""
    names = sorted(tensors, key=_layer_order)
    sizes = [tensors[name].numel() * tensors[name].element_size() for name in names]
    total, before = sum(sizes), 0
    files = [f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)]
    weight_map: dict[str, str] = {}
    for name, size in zip(names, sizes, strict=True):
        weight_map[name] = files[min(num_shards - 1, before * num_shards // total)]
        before += size
    if num_shards < 2 or set(weight_map.values()) != set(files):
        raise ValueError(f"cannot shard {len(names)} tensors into {num_shards} files")
    for file in files:
        shard = {name: tensors[name].contiguous() for name in names if weight_map[name] == file}
        save_file(shard, str(directory / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def _layer_order(name: str) -> tuple[int, str]:
    """Embeddings first, then layer by layer, then the final norm and head (as HF shards)."""
    parts = name.split(".")
    if name.startswith("model.embed_tokens"):
        return (-1, name)
    if len(parts) > 2 and parts[1] == "layers":
        return (int(parts[2]), name)
    return (1 << 30, name)


def write_release_model(directory: str | Path, *, seed: int = 0, num_shards: int = 2, **overrides: Any) -> Path:
    """Write a release-shaped model to ``directory`` (``overrides``: release config keys)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ids = write_kimi_tokenizer(directory)
    data = release_config_dict(ids, **overrides)
    (directory / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    generation = {
        "bos_token_id": ids.bos_token_id,
        "eos_token_id": ids.eos_token_id,
        "pad_token_id": ids.pad_token_id,
        "transformers_version": RELEASE_TRANSFORMERS_VERSION,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    config = ModelConfig.from_hf_dict(data)
    write_shards(directory, release_tensors(config, seed), num_shards)
    return directory
