"""How each of our parameters is made from tensors of an HF KimiLinear checkpoint (``weight_recipe``).

Checkpoint layouts differ: per-expert ``w1/w2/w3`` or packed experts; three short-conv weights or one.
Source names are canonical: no ``model.`` prefix, ``block_sparse_moe`` spelled ``mlp`` and the forget
gate's tensors directly under ``self_attn``.
"""

from __future__ import annotations

import re

import torch

from metrale.worker.model.config import ModelConfig
from metrale.worker.model.weight_recipe import Recipe, recipe


def canonical_name(name: str) -> str:
    """Map any accepted spelling of an HF tensor name to the canonical one."""
    if name.startswith("model."):
        name = name[len("model.") :]
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"\.self_attn\.forget_gate\.", ".self_attn.", name)


def build_weight_map(config: ModelConfig) -> dict[str, list[Recipe]]:
    """Our parameter name → its recipes, in order of preference."""
    d, v = config.hidden_size, config.vocab_size
    out: dict[str, list[Recipe]] = {
        "embed_tokens.weight": [recipe([("embed_tokens.weight", (v, d))])],
        "norm.weight": [recipe([("norm.weight", (d,))])],
    }
    # A stored LM head wins even when tie_word_embeddings is set (transformers does the same).
    out["lm_head.weight"] = [recipe([("lm_head.weight", (v, d))])]
    if config.tie_word_embeddings:
        out["lm_head.weight"].append(recipe([("embed_tokens.weight", (v, d))]))
    for i in range(config.num_hidden_layers):
        hf, ours = f"layers.{i}", f"layers.{i}"
        out[f"{ours}.input_norm.weight"] = [recipe([(f"{hf}.input_layernorm.weight", (d,))])]
        out[f"{ours}.post_attn_norm.weight"] = [recipe([(f"{hf}.post_attention_layernorm.weight", (d,))])]
        attn = _kda_map if config.layer_types[i] == "kda" else _mla_map
        out.update({f"{ours}.attn.{k}": r for k, r in attn(config, f"{hf}.self_attn").items()})
        mlp = _moe_map if config.mlp_layer_types[i] == "moe" else _dense_map
        out.update({f"{ours}.mlp.{k}": r for k, r in mlp(config, f"{hf}.mlp").items()})
    return out


def _kda_map(config: ModelConfig, p: str) -> dict[str, list[Recipe]]:
    d, h, k, w = (
        config.hidden_size,
        config.linear_num_heads,
        config.linear_head_dim,
        config.linear_conv_kernel_dim,
    )
    width = config.linear_dim
    return {
        "in_proj.weight": [
            recipe(
                [
                    (f"{p}.q_proj.weight", (width, d)),
                    (f"{p}.k_proj.weight", (width, d)),
                    (f"{p}.v_proj.weight", (width, d)),
                    (f"{p}.f_a_proj.weight", (k, d)),
                    (f"{p}.g_a_proj.weight", (k, d)),
                    (f"{p}.b_proj.weight", (h, d)),
                ]
            )
        ],
        "conv_weight": [
            recipe([(f"{p}.{n}_conv1d.weight", (width, 1, w)) for n in "qkv"]),
            recipe([(f"{p}.conv1d.weight", (3 * width, 1, w))]),
        ],
        "f_b_proj.weight": [recipe([(f"{p}.f_b_proj.weight", (width, k))])],
        "dt_bias": [recipe([(f"{p}.dt_bias", (width,))])],
        "A_log": [recipe([(f"{p}.A_log", (1, 1, h, 1))])],
        "g_b_proj.weight": [recipe([(f"{p}.g_b_proj.weight", (width, k))])],
        "o_norm_weight": [recipe([(f"{p}.o_norm.weight", (k,))])],
        "o_proj.weight": [recipe([(f"{p}.o_proj.weight", (d, width))])],
    }


def _mla_map(config: ModelConfig, p: str) -> dict[str, list[Recipe]]:
    d, heads = config.hidden_size, config.num_attention_heads
    q_width = heads * config.qk_head_dim
    kv_a = (f"{p}.kv_a_proj_with_mqa.weight", (config.latent_dim, d))
    out = {
        "kv_a_norm_weight": [recipe([(f"{p}.kv_a_layernorm.weight", (config.kv_lora_rank,))])],
        "kv_b_proj.weight": [
            recipe(
                [
                    (
                        f"{p}.kv_b_proj.weight",
                        (heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank),
                    )
                ]
            )
        ],
        "o_proj.weight": [recipe([(f"{p}.o_proj.weight", (d, heads * config.v_head_dim))])],
    }
    rank = config.q_lora_rank
    if rank is None:
        out["in_proj.weight"] = [recipe([(f"{p}.q_proj.weight", (q_width, d)), kv_a])]
    else:
        out["in_proj.weight"] = [recipe([(f"{p}.q_a_proj.weight", (rank, d)), kv_a])]
        out["q_a_norm_weight"] = [recipe([(f"{p}.q_a_layernorm.weight", (rank,))])]
        out["q_b_proj.weight"] = [recipe([(f"{p}.q_b_proj.weight", (q_width, rank))])]
    return out


def _dense_map(config: ModelConfig, p: str, size: int | None = None, ours: str = "") -> dict[str, list[Recipe]]:
    d, i = config.hidden_size, size or config.intermediate_size
    return {
        f"{ours}gate_up.weight": [recipe([(f"{p}.gate_proj.weight", (i, d)), (f"{p}.up_proj.weight", (i, d))])],
        f"{ours}down.weight": [recipe([(f"{p}.down_proj.weight", (d, i))])],
    }


def _moe_map(config: ModelConfig, p: str) -> dict[str, list[Recipe]]:
    d, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    experts = range(e)

    def gate_up(buffer: torch.Tensor) -> list[torch.Tensor]:  # [E, 2I, D] ← w1_0..w1_E, then w3_0..w3_E
        return [buffer[j, :i] for j in experts] + [buffer[j, i:] for j in experts]

    def stack(buffer: torch.Tensor) -> list[torch.Tensor]:  # [E, D, I] ← w2_0..w2_E
        return list(buffer.unbind(0))

    out = {
        "router_weight": [recipe([(f"{p}.gate.weight", (e, d))])],
        "router_bias": [recipe([(f"{p}.gate.e_score_correction_bias", (e,))])],
        "experts_gate_up": [
            recipe(
                [(f"{p}.experts.{j}.w1.weight", (i, d)) for j in experts]
                + [(f"{p}.experts.{j}.w3.weight", (i, d)) for j in experts],
                gate_up,
            ),
            recipe([(f"{p}.experts.gate_up_proj", (e, 2 * i, d))]),
        ],
        "experts_down": [
            recipe([(f"{p}.experts.{j}.w2.weight", (d, i)) for j in experts], stack),
            recipe([(f"{p}.experts.down_proj", (e, d, i))]),
        ],
    }
    if config.num_shared_experts > 0:
        out.update(_dense_map(config, f"{p}.shared_experts", i * config.num_shared_experts, "shared."))
    return out
