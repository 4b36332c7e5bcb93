"""Benchmark models, all made locally: the built-in tiny Kimi-Linear model and larger ones of that family,
and Qwen3.5-shaped ones of the Kimi bench model's size in the Qwen3.5 release layout."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer

from metrale.text.builtin_tokenizer import BOS_ID, BUILTIN_VOCAB_SIZE, IM_END_ID, PAD_ID
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.families.qwen3_5_config import Qwen35Config, Qwen35MoeConfig
from metrale.worker.model.families.qwen3_5_tiny import (
    ADDED_TOKENS,
    GENERATION_DEFAULTS,
    STORED_FP32,
    release_tensors,
    tiny_qwen3_5_config_dict,
    write_tokenizer,
)
from metrale.worker.model.families.qwen3_5_weights import build_weight_map as qwen3_5_weight_map
from metrale.worker.model.release_layout import write_shards
from metrale.worker.model.tiny import tiny_config_dict, write_tiny_model
from metrale.worker.model.weight_map import build_weight_map as kimi_weight_map

MEDIUM: dict[str, Any] = {
    # 8 layers, hidden 512, MoE 8×top-2 (+1 shared): ~19M parameters active per token.
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7],
        "full_attn_layers": [4, 8],
        "num_heads": 4,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}

LARGE: dict[str, Any] = {
    # 8 layers, hidden 1024, MoE 32×top-4 (+1 shared): ~0.41B parameters, ~0.81 GB in bf16 — large enough
    # that the weights dominate the interpreter's own memory (bench/load_memory.py).
    **MEDIUM,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_experts": 32,
    "num_experts_per_token": 4,
    "num_expert_group": 4,
    "topk_group": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 256,
    "linear_attn_config": {**MEDIUM["linear_attn_config"], "num_heads": 8},
}
MEDIUM_4_HEADS: dict[str, Any] = {
    # ``medium`` with its 2 MLA layers at 4 heads of twice the width (as many heads as its KDA layers have:
    # llama.cpp's Kimi-Linear sizes both from one head count, so it cannot load ``medium`` itself). The
    # KDA layers, MoE and vocabulary are unchanged; MLA's kv_b and o projections keep their shapes, q
    # shrinks from 768 to 640 rows.
    **MEDIUM,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}
_ARCHITECTURES = {"tiny": {}, "medium": MEDIUM, "medium-4-heads": MEDIUM_4_HEADS, "large": LARGE}

QWEN3_5_MEDIUM: dict[str, Any] = {
    # The Kimi ``medium-4-heads`` model's size in Qwen3.5's shape: hidden 512, 8 layers in the release's
    # 3 Gated DeltaNet : 1 gated attention pattern; DeltaNet with head dims 128 and twice as many value
    # heads as key heads (2 and 4, as the 4B–397B releases); GQA 4 query heads on 2 KV heads of 128,
    # a quarter rotary (mRoPE sections of 16 rotary pairs); a dense SwiGLU MLP of 896, which brings the
    # parameters to ~19.7M (tied embeddings), against ``medium-4-heads``' ~19.9M active per token.
    "hidden_size": 512,
    "intermediate_size": 896,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    },
}
QWEN3_5_MOE_MEDIUM: dict[str, Any] = {
    # ``qwen3_5-medium`` with the MoE release's MLP in every layer: 8 experts of 256, top-2, plus a gated
    # shared expert of 256 — the Kimi bench model's MoE (~18M active of ~37M, against its ~20M of ~36M).
    **QWEN3_5_MEDIUM,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
}
_QWEN3_5_ARCHITECTURES = {"qwen3_5-medium": (QWEN3_5_MEDIUM, False), "qwen3_5_moe-medium": (QWEN3_5_MOE_MEDIUM, True)}
MODEL_NAMES = (*_ARCHITECTURES, *_QWEN3_5_ARCHITECTURES)
"""Every benchmark model ``bench_model`` writes."""


def bench_model(name: str, root: Path, dtype: str = "float32") -> Path:
    """Write (once) and return the folder of benchmark model ``name`` (one of ``MODEL_NAMES``) stored in
    ``dtype``."""
    directory = root / (name if dtype == "float32" else f"{name}-{dtype}")
    if name in _QWEN3_5_ARCHITECTURES:
        if not (directory / "config.json").exists():
            architecture, moe = _QWEN3_5_ARCHITECTURES[name]
            write_qwen3_5_model(directory, architecture, moe=moe, dtype=dtype)
        return directory
    if not (directory / "model.safetensors").exists():
        write_tiny_model(directory, dtype=dtype, **_ARCHITECTURES[name])
    return directory


END_OF_TEXT = "<|endoftext|>"


def add_end_of_text(directory: Path) -> int:
    """Add the release's ``<|endoftext|>`` (special) to the folder's ``tokenizer.json``; return the vocab
    size. transformers' ``Qwen3_5Tokenizer`` adds it when missing, one id past the model's vocabulary,
    which llama.cpp's converter refuses (every token id must have an embedding row)."""
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=False)])
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def write_qwen3_5_model(
    directory: Path, architecture: dict[str, Any], *, moe: bool, dtype: str = "float32", seed: int = 0
) -> Path:
    """A Qwen3.5 (``moe``: Qwen3.5 MoE) release-layout folder as ``met model init-tiny --family qwen3_5``
    writes it — ``text_config`` nested, tensors under ``model.language_model.*`` in 2 shards with an index,
    the ChatML tokenizer, chat template and ``generation_config.json`` — with ``architecture`` overriding the
    tiny ``text_config`` and the tensors stored in ``dtype`` (``A_log``/``dt_bias`` in fp32, as the release).
    ``config.json`` is written last: a folder with one is complete."""
    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory)
    data = tiny_qwen3_5_config_dict(add_end_of_text(directory), moe=moe)
    data["text_config"] = {**data["text_config"], **architecture, "dtype": dtype}
    stored = getattr(torch, dtype)
    tensors = {
        name: tensor if name.endswith(STORED_FP32) else tensor.to(stored)
        for name, tensor in release_tensors(Qwen35Config.from_hf_dict(data), seed).items()
    }
    write_shards(directory, tensors, num_shards=2)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [IM_END_ID], "pad_token_id": PAD_ID, **GENERATION_DEFAULTS}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    return directory


QWEN3_5_VOCAB_SIZE = BUILTIN_VOCAB_SIZE + len(ADDED_TOKENS) + 1
"""The Qwen3.5 bench models' vocabulary: the built-in tokenizer's, the tiny model's added tokens and
``END_OF_TEXT``."""


def bench_config(name: str) -> ModelConfig | Qwen35Config:
    """The configuration ``bench_model(name)`` writes, without writing it."""
    if name in _QWEN3_5_ARCHITECTURES:
        architecture, moe = _QWEN3_5_ARCHITECTURES[name]
        data = tiny_qwen3_5_config_dict(QWEN3_5_VOCAB_SIZE, moe=moe)
        return Qwen35Config.from_hf_dict({**data, "text_config": {**data["text_config"], **architecture}})
    return ModelConfig.from_hf_dict(tiny_config_dict(BUILTIN_VOCAB_SIZE, **_ARCHITECTURES[name]))


def parameter_counts(name: str) -> tuple[int, int]:
    """``(total, active per token)`` parameters of bench model ``name``: every stored tensor, and those
    with its routed experts counted at ``top-k / experts`` (a tied LM head counted once, as stored)."""
    config = bench_config(name)
    if isinstance(config, Qwen35Config):
        weight_map = qwen3_5_weight_map(config)
        tied = config.tie_word_embeddings
        routed = config.num_experts_per_tok / config.num_experts if isinstance(config, Qwen35MoeConfig) else 1.0
    else:
        weight_map, tied = kimi_weight_map(config), config.tie_word_embeddings
        routed = config.num_experts_per_token / config.num_experts
    total = active = 0.0
    for parameter, recipes in weight_map.items():
        if parameter == "lm_head.weight" and tied:
            continue
        for source, shape in recipes[0].sources:
            count = math.prod(shape)
            total += count
            active += count * (routed if ".experts." in source else 1.0)
    return int(total), int(active)
