"""How each of our Qwen3.5 parameters is made from the release's tensors (see ``weight_recipe``).

The releases are vision-language checkpoints: the language model's tensors are under
``model.language_model.``, the vision tower's under ``model.visual.`` and the multi-token-prediction
head's under ``mtp.``, which a text server does not run (``SKIPPED``). A text-only
``Qwen3_5ForCausalLM`` stores the same tensors under ``model.``. Canonical names drop either prefix.
"""

from __future__ import annotations

import torch

from metrale.worker.model.families.qwen3_5_config import Qwen35Config, Qwen35MoeConfig
from metrale.worker.model.weight_recipe import Recipe, WeightMap, recipe

SKIPPED: dict[str, str] = {"model.visual.": "the vision tower", "mtp.": "the multi-token-prediction head"}
"""Prefixes of stored tensors that are not loaded, and what they are."""

_PREFIXES = ("model.language_model.", "model.")


def canonical_name(name: str) -> str | None:
    """The canonical name of a stored tensor, or None for one that is not loaded (``SKIPPED``)."""
    if name.startswith(tuple(SKIPPED)):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def build_weight_map(config: Qwen35Config) -> WeightMap:
    """Our parameter name → its recipes, in order of preference."""
    d, v = config.hidden_size, config.vocab_size
    out: WeightMap = {
        "embed_tokens.weight": [recipe([("embed_tokens.weight", (v, d))])],
        "norm.weight": [recipe([("norm.weight", (d,))])],
        # A stored LM head wins even when tie_word_embeddings is set (transformers does the same).
        "lm_head.weight": [recipe([("lm_head.weight", (v, d))])],
    }
    if config.tie_word_embeddings:
        out["lm_head.weight"].append(recipe([("embed_tokens.weight", (v, d))]))
    for i, kind in enumerate(config.layer_types):
        p = f"layers.{i}"
        out[f"{p}.input_norm.weight"] = [recipe([(f"{p}.input_layernorm.weight", (d,))])]
        out[f"{p}.post_attn_norm.weight"] = [recipe([(f"{p}.post_attention_layernorm.weight", (d,))])]
        if kind == "linear_attention":
            attn = _gated_deltanet_map(config, f"{p}.linear_attn")
        else:
            attn = _attention_map(config, f"{p}.self_attn")
        out.update({f"{p}.attn.{name}": recipes for name, recipes in attn.items()})
        if isinstance(config, Qwen35MoeConfig) and config.is_moe_layer(i):
            out.update({f"{p}.mlp.{name}": recipes for name, recipes in _moe_map(config, f"{p}.mlp").items()})
            continue
        out[f"{p}.mlp.gate_up.weight"] = [
            recipe(
                [
                    (f"{p}.mlp.gate_proj.weight", (config.intermediate_size, d)),
                    (f"{p}.mlp.up_proj.weight", (config.intermediate_size, d)),
                ]
            )
        ]
        out[f"{p}.mlp.down.weight"] = [recipe([(f"{p}.mlp.down_proj.weight", (d, config.intermediate_size))])]
    return out


def _gated_deltanet_map(config: Qwen35Config, p: str) -> dict[str, list[Recipe]]:
    d, hv, lv = config.hidden_size, config.linear_num_value_heads, config.linear_value_dim
    return {
        "in_proj.weight": [
            recipe(
                [
                    (f"{p}.in_proj_qkv.weight", (config.conv_dim, d)),
                    (f"{p}.in_proj_z.weight", (lv, d)),
                    (f"{p}.in_proj_b.weight", (hv, d)),
                    (f"{p}.in_proj_a.weight", (hv, d)),
                ]
            )
        ],
        "conv_weight": [recipe([(f"{p}.conv1d.weight", (config.conv_dim, 1, config.linear_conv_kernel_dim))])],
        "dt_bias": [recipe([(f"{p}.dt_bias", (hv,))])],
        "A_log": [recipe([(f"{p}.A_log", (hv,))])],
        "norm_weight": [recipe([(f"{p}.norm.weight", (config.linear_value_head_dim,))])],
        "out_proj.weight": [recipe([(f"{p}.out_proj.weight", (d, lv))])],
    }


def _attention_map(config: Qwen35Config, p: str) -> dict[str, list[Recipe]]:
    d, heads, kv_heads, dim = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    return {
        "in_proj.weight": [
            recipe(
                [
                    (f"{p}.q_proj.weight", (2 * heads * dim, d)),  # per head: query rows, then gate rows
                    (f"{p}.k_proj.weight", (kv_heads * dim, d)),
                    (f"{p}.v_proj.weight", (kv_heads * dim, d)),
                ]
            )
        ],
        "q_norm.weight": [recipe([(f"{p}.q_norm.weight", (dim,))])],
        "k_norm.weight": [recipe([(f"{p}.k_norm.weight", (dim,))])],
        "o_proj.weight": [recipe([(f"{p}.o_proj.weight", (d, heads * dim))])],
    }


def _moe_map(config: Qwen35MoeConfig, p: str) -> dict[str, list[Recipe]]:
    """Qwen's MoE block: experts fused 3-D (``experts.gate_up_proj`` ``[E, 2I, D]``, ``experts.down_proj``
    ``[E, D, I]``, transformers' layout) or one tensor per expert (``experts.J.{gate,up,down}_proj``)."""
    d, e, i, s = (
        config.hidden_size,
        config.num_experts,
        config.moe_intermediate_size,
        config.shared_expert_intermediate_size,
    )
    experts = range(e)

    def gate_up(buffer: torch.Tensor) -> list[torch.Tensor]:  # [E, 2I, D] ← gate_0, up_0, gate_1, up_1, …
        return [half for j in experts for half in (buffer[j, :i], buffer[j, i:])]

    def stack(buffer: torch.Tensor) -> list[torch.Tensor]:
        return list(buffer.unbind(0))

    per_expert_gate_up = [(f"{p}.experts.{j}.{name}_proj.weight", (i, d)) for j in experts for name in ("gate", "up")]
    return {
        "router_weight": [recipe([(f"{p}.gate.weight", (e, d))])],
        "experts_gate_up": [
            recipe([(f"{p}.experts.gate_up_proj", (e, 2 * i, d))]),
            recipe(per_expert_gate_up, gate_up),
        ],
        "experts_down": [
            recipe([(f"{p}.experts.down_proj", (e, d, i))]),
            recipe([(f"{p}.experts.{j}.down_proj.weight", (d, i)) for j in experts], stack),
        ],
        "shared.gate_up.weight": [
            recipe([(f"{p}.shared_expert.gate_proj.weight", (s, d)), (f"{p}.shared_expert.up_proj.weight", (s, d))])
        ],
        "shared.down.weight": [recipe([(f"{p}.shared_expert.down_proj.weight", (d, s))])],
        "shared_gate.weight": [recipe([(f"{p}.shared_expert_gate.weight", (1, d))])],
    }
