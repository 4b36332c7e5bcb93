"""A tiny random-weight Qwen3.5 dense model in the release's layout, written by our code.

What a Qwen3.5 release folder holds, at a size a CPU runs: ``config.json`` as
``Qwen3_5ForConditionalGeneration`` with the language model under ``text_config`` (``layer_types`` 3 linear
: 1 full, ``head_dim`` 16 with a quarter of it rotary, mRoPE parameters, ``mamba_ssm_dtype`` float32),
tied embeddings, bf16 tensors under ``model.language_model.*`` (``A_log`` and ``dt_bias`` in fp32) sharded
with an index, a ChatML tokenizer with ``<tool_call>``/``<think>`` as added (not special) tokens, the
Qwen3.5 chat template and ``generation_config.json``. ``moe=True`` writes the Qwen3.5 MoE release's shape
instead (``Qwen3_5MoeForConditionalGeneration``: every layer's MLP routed experts, fused 3-D, plus a gated
shared expert). The vision tower is not written: a text server
never reads it (transformers, loading the folder, reports only ``model.visual.*`` missing). Seeded: the
same arguments write the same bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers

from metrale.text.builtin_tokenizer import BOS_ID, IM_END_ID, IM_END_TOKEN, PAD_ID, write_builtin_tokenizer
from metrale.text.chat_templates.qwen import QWEN3_5_CHAT_TEMPLATE
from metrale.worker.model.families.qwen3_5_config import Qwen35Config
from metrale.worker.model.families.qwen3_5_weights import build_weight_map
from metrale.worker.model.release_layout import write_shards

ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
"""Added as in the release: not special, so they survive ``skip_special_tokens``."""

END_OF_TEXT = "<|endoftext|>"
"""The release's special ``<|endoftext|>``, last: transformers' ``Qwen3_5Tokenizer`` adds it to a tokenizer
that lacks it, one id past the model's vocabulary (an id with no embedding row)."""

GENERATION_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
"""The sampling defaults of the Qwen3.5 releases' ``generation_config.json``."""

TEXT_ARCH: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "attn_output_gate": True,
    "attention_bias": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 16384,
    "mamba_ssm_dtype": "float32",
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
}

VISION_ARCH: dict[str, Any] = {
    "model_type": "qwen3_5",
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 4,
    "spatial_merge_size": 1,
    "temporal_patch_size": 1,
}

MOE_ARCH: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
}
"""What the MoE release's ``text_config`` has on top of ``TEXT_ARCH`` (its ``intermediate_size`` unused)."""

QWEN3_5_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""The Qwen3.5 releases' pre-tokenizer split (Qwen2's, with combining marks in words and single digits), as
in transformers' ``Qwen3_5Tokenizer``."""

STORED_FP32 = ("A_log", "dt_bias")


def tiny_qwen3_5_config_dict(vocab_size: int, *, moe: bool = False) -> dict[str, Any]:
    """The ``config.json`` of the tiny Qwen3.5 model (the MoE one with ``moe``) over a tokenizer of
    ``vocab_size`` ids."""
    tokens = {"vocab_size": vocab_size, "bos_token_id": BOS_ID, "eos_token_id": IM_END_ID, "pad_token_id": PAD_ID}
    text = {**TEXT_ARCH, **(MOE_ARCH if moe else {}), **tokens}
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "vision_config": {**VISION_ARCH, "model_type": "qwen3_5_moe" if moe else "qwen3_5"},
        "tie_word_embeddings": True,
        "transformers_version": "4.57.0.dev0",
    }


def release_tensors(config: Qwen35Config, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random tensors under the release's names (bf16; ``A_log`` and ``dt_bias`` fp32); no
    ``lm_head.weight`` when the embeddings are tied, as in the release."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for parameter, recipes in build_weight_map(config).items():
        if parameter == "lm_head.weight" and config.tie_word_embeddings:
            continue
        for name, shape in recipes[0].sources:
            dtype = torch.float32 if name.endswith(STORED_FP32) else torch.bfloat16
            stored = name if name.startswith("lm_head") else f"model.language_model.{name}"
            tensors[stored] = random_tensor(name, shape, generator).to(dtype)
    return tensors


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A seeded random tensor for the canonical tensor ``name``, drawn as its kind of weight needs."""
    if name.endswith("linear_attn.norm.weight"):  # the gated norm: plain weight, around one
        return torch.empty(shape).normal_(1.0, 0.1, generator=generator)
    if name.endswith("norm.weight"):  # zero-centred: the norm multiplies by 1 + w
        return torch.empty(shape).normal_(0.0, 0.1, generator=generator)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log()
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp()
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    # Logits spread wide enough that greedy decoding has few near-ties, as the Kimi tiny model's, and layers
    # strong enough against the tied embeddings that the next token depends on the whole state (at 0.08 greedy
    # decoding repeated one token whatever the prompt, and a corrupted recurrent state went unseen).
    std = 0.5 if name.startswith("embed_tokens") else 0.2
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def write_tokenizer(directory: Path) -> int:
    """The built-in byte-level BPE with ChatML tokens, ``ADDED_TOKENS`` and ``END_OF_TEXT``, the Qwen3.5
    release's normalizer and split pattern, and the Qwen3.5 chat template (``chat_template.jinja``),
    ``<|im_end|>`` its eos; return the vocab size."""
    write_builtin_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in ADDED_TOKENS])
    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=False)])
    # The release's pipeline, which transformers' Qwen3_5Tokenizer imposes on any folder it loads: with the
    # built-in GPT-2 split, text like "U\n\r 1" tokenized differently here and there.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config_file = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text(encoding="utf-8"))
    tokenizer_config.pop("chat_template")
    config_file.write_text(json.dumps({**tokenizer_config, "eos_token": IM_END_TOKEN}, indent=2) + "\n")
    (directory / "chat_template.jinja").write_text(QWEN3_5_CHAT_TEMPLATE, encoding="utf-8")
    return int(tokenizer.get_vocab_size(with_added_tokens=True))


def write_tiny_qwen3_5(directory: str | Path, *, seed: int = 0, num_shards: int = 2, moe: bool = False) -> Path:
    """Write the tiny Qwen3.5 model (config, bf16 shards, tokenizer, chat template) to ``directory``;
    with ``moe``, the tiny Qwen3.5 MoE model."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = tiny_qwen3_5_config_dict(write_tokenizer(directory), moe=moe)
    (directory / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [IM_END_ID], "pad_token_id": PAD_ID, **GENERATION_DEFAULTS}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_shards(directory, release_tensors(Qwen35Config.from_hf_dict(data), seed), num_shards)
    return directory
