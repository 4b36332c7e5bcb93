"""The built-in tiny model: a seeded random-weight KimiLinear checkpoint in HF layout, made without downloads."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from metrale.text.builtin_tokenizer import BOS_ID, PAD_ID, STOP_TOKEN_IDS, write_builtin_tokenizer
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.precision import parse_dtype
from metrale.worker.model.weight_map import build_weight_map

STORED_FP32 = ("A_log", "dt_bias")
"""Tensors a checkpoint of any dtype stores in fp32, as the Kimi-Linear release does."""

TINY_ARCH: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "num_expert_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.446,
    "moe_renormalize": True,
    "first_k_dense_replace": 1,
    "linear_attn_config": {
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3],
        "num_heads": 2,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
    },
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "model_max_length": 16384,
}


def tiny_config_dict(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """An HF ``config.json`` for a KimiLinear model of the tiny shape (``overrides`` change any field)."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": vocab_size,
        "bos_token_id": BOS_ID,
        "eos_token_id": list(STOP_TOKEN_IDS),
        "pad_token_id": PAD_ID,
        "hidden_act": "silu",
        "dtype": "float32",
        **TINY_ARCH,
        **overrides,
    }


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random tensors under HF names for every tensor the loader expects, in the config's dtype
    (drawn in fp32, then rounded; ``STORED_FP32`` tensors stay fp32)."""
    generator = torch.Generator().manual_seed(seed)
    dtype = parse_dtype(config.dtype)
    tensors: dict[str, torch.Tensor] = {}
    for recipes in build_weight_map(config).values():
        for name, shape in recipes[0].sources:
            tensor = _init(name, shape, generator)
            tensor = tensor if name.endswith(STORED_FP32) else tensor.to(dtype)
            tensors[f"model.{name}" if not name.startswith("lm_head") else name] = tensor
    return tensors


def _init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith(("norm.weight", "layernorm.weight")):
        return torch.ones(shape)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log()
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp()
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape)
    # Logits spread wide enough that greedy decoding has no near-ties (std ≈ 2), yet small enough that
    # fp32 rounding between matmuls of different row counts stays far below 1e-5.
    std = {"embed_tokens": 0.5, "lm_head": 0.25}.get(name.split(".")[0], 0.08)
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def write_tiny_model(directory: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write the built-in tiny model (config, weights, tokenizer) to ``directory``; same bytes every time.

    ``overrides`` change config fields: the architecture, or ``dtype="bfloat16"`` for a bf16 checkpoint.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = write_builtin_tokenizer(directory)
    data = tiny_config_dict(vocab_size, **overrides)
    (directory / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    config = ModelConfig.from_hf_dict(data)
    save_file(random_weights(config, seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
