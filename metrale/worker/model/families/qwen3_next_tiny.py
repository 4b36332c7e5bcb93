"""``met model init-tiny --family qwen3_next``: a tiny Qwen3-Next model in the release's layout.

What a Qwen3-Next-Instruct release folder holds, at a size a CPU runs: a flat ``config.json``
(``Qwen3NextForCausalLM``, no ``layer_types``: every 4th layer full attention; ``rope_theta`` and
``partial_rotary_factor`` at the top level, ``torch_dtype``, ``norm_topk_prob``, ``decoder_sparse_step``,
``mlp_only_layers``), untied embeddings, bf16 tensors under ``model.`` sharded with an index: each Gated
DeltaNet layer's fused ``in_proj_qkvz`` / ``in_proj_ba`` (interleaved per key head), MoE experts one tensor
each (``mlp.experts.E.{gate,up,down}_proj``) beside ``mlp.gate``, ``mlp.shared_expert.*`` and
``mlp.shared_expert_gate``. The tokenizer is the built-in ChatML one with ``<tool_call>``/``<think>`` added
(as the Qwen2/3 tokenizer has them) and a ChatML template with tools in the Hermes JSON format, the
Instruct release's. Seeded: the same arguments write the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer

from metrale.text.builtin_tokenizer import BOS_ID, IM_END_ID, IM_END_TOKEN, PAD_ID, write_builtin_tokenizer
from metrale.worker.model.families.qwen3_5_tiny import ADDED_TOKENS, random_tensor
from metrale.worker.model.families.qwen3_5_weights import build_weight_map
from metrale.worker.model.families.qwen3_next import linear_attention_heads
from metrale.worker.model.families.qwen3_next_config import Qwen3NextConfig
from metrale.worker.model.families.qwen3_next_layout import fuse_in_proj_ba, fuse_in_proj_qkvz
from metrale.worker.model.release_layout import write_shards

GENERATION_DEFAULTS: dict[str, Any] = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
"""The sampling the Qwen3-Next-Instruct model card recommends."""

ARCH: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 16384,
    "rope_scaling": None,
    "rope_theta": 10_000_000,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0",
}


def tiny_qwen3_next_config_dict(vocab_size: int) -> dict[str, Any]:
    """The ``config.json`` of the tiny Qwen3-Next model over a tokenizer of ``vocab_size`` ids."""
    return {**ARCH, "vocab_size": vocab_size, "bos_token_id": BOS_ID, "eos_token_id": IM_END_ID}


def release_tensors(config: Qwen3NextConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random bf16 tensors under the release's names: the Gated DeltaNet projections fused as
    Qwen3-Next stores them, the experts one tensor each."""
    generator = torch.Generator().manual_seed(seed)
    drawn: dict[str, torch.Tensor] = {}
    for parameter, recipes in build_weight_map(config).items():
        if parameter == "lm_head.weight" and config.tie_word_embeddings:
            continue
        # The last recipe of the experts' is one tensor per expert; every other parameter has one layout.
        for name, shape in recipes[-1 if ".experts_" in parameter else 0].sources:
            drawn[name] = random_tensor(name, shape, generator).to(torch.bfloat16)
    heads = linear_attention_heads(config)
    for p in [name.removesuffix(".in_proj_qkv.weight") for name in drawn if name.endswith(".in_proj_qkv.weight")]:
        qkv, z = drawn.pop(f"{p}.in_proj_qkv.weight"), drawn.pop(f"{p}.in_proj_z.weight")
        b, a = drawn.pop(f"{p}.in_proj_b.weight"), drawn.pop(f"{p}.in_proj_a.weight")
        drawn[f"{p}.in_proj_qkvz.weight"] = fuse_in_proj_qkvz(qkv, z, heads)
        drawn[f"{p}.in_proj_ba.weight"] = fuse_in_proj_ba(b, a, heads)
    return {(name if name.startswith("lm_head") else f"model.{name}"): t for name, t in drawn.items()}


def write_tokenizer(directory: Path) -> int:
    """The built-in byte-level BPE with ChatML tokens and its Hermes-tools ChatML template, ``ADDED_TOKENS``
    added, ``<|im_end|>`` its eos; return the vocab size."""
    write_builtin_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in ADDED_TOKENS])
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config_file = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text(encoding="utf-8"))
    config_file.write_text(json.dumps({**tokenizer_config, "eos_token": IM_END_TOKEN}, indent=2) + "\n")
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def write_tiny_qwen3_next(directory: str | Path, *, seed: int = 0, num_shards: int = 2) -> Path:
    """Write the tiny Qwen3-Next model (config, bf16 shards, tokenizer, chat template) to ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = tiny_qwen3_next_config_dict(write_tokenizer(directory))
    (directory / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [IM_END_ID], "pad_token_id": PAD_ID, **GENERATION_DEFAULTS}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_shards(directory, release_tensors(Qwen3NextConfig.from_hf_dict(data), seed), num_shards)
    return directory
