"""The sizes of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next model from its ``config.json`` alone.

``QwenShape`` reads the fields that decide the sizes (from ``text_config`` for Qwen3.5's vision-language
configs, from the top level for flat ones); :func:`parameter_counts` counts the language model we serve,
tensor by tensor as transformers 5.23 builds it (checked against it in tests/worker/model/test_inspect.py),
and the release parts a text server skips: Qwen3.5's vision tower and the multi-token-prediction head.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from metrale.worker.model.config import ModelConfigError

QwenFamily = Literal["qwen3_5", "qwen3_5_moe", "qwen3_next"]
MODEL_TYPES: dict[str, QwenFamily] = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}
"""``model_type`` (top level or ``text_config``) → family."""

QWEN3_NEXT_MTP_LAYERS = 1
"""Qwen3-Next's config names no MTP layers, yet its release stores one (``mtp.layers.0.*``)."""


def moe_layer_flags(
    num_layers: int, num_experts: int, decoder_sparse_step: int, mlp_only_layers: Collection[int]
) -> tuple[bool, ...]:
    """Which layers run the MoE block, as transformers' Qwen3-Next decoder layer decides: layer ``i`` does
    when there are experts, ``i`` is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``;
    the others run a dense MLP of ``intermediate_size``."""
    return tuple(
        num_experts > 0 and i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 for i in range(num_layers)
    )


@dataclass(frozen=True)
class QwenShape:
    """The sizes of a Qwen hybrid model: ``layer_types`` (``linear_attention`` / ``full_attention``) and
    ``moe_layers`` per layer; Gated DeltaNet heads; gated GQA; the experts when ``num_experts > 0``."""

    family: QwenFamily
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    moe_layers: tuple[bool, ...]
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    mtp_layers: int
    vision: dict[str, Any] | None

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> QwenShape:
        text = data.get("text_config") or data
        family = MODEL_TYPES.get(str(text.get("model_type")), MODEL_TYPES.get(str(data.get("model_type"))))
        if family is None:
            raise ModelConfigError(f"config.json: model_type '{data.get('model_type')}' is not a Qwen hybrid")

        def field(name: str, default: Any = None) -> Any:
            value = text.get(name, data.get(name, default))
            if value is None:
                raise ModelConfigError(f"config.json: missing field '{name}'")
            return value

        layers = int(field("num_hidden_layers"))
        interval = int(field("full_attention_interval", 4))
        layer_types = tuple(
            text.get("layer_types")
            or ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        )
        if len(layer_types) != layers:
            raise ModelConfigError(f"config.json: layer_types has {len(layer_types)} entries, not {layers}")
        experts = int(field("num_experts", 0)) if family != "qwen3_5" else 0
        sparse_step, dense_only = int(field("decoder_sparse_step", 1)), set(field("mlp_only_layers", []))
        moe_layers = moe_layer_flags(layers, experts, sparse_step, dense_only)
        default_mtp = QWEN3_NEXT_MTP_LAYERS if family == "qwen3_next" else 0
        return cls(
            family=family,
            vocab_size=int(field("vocab_size")),
            hidden_size=int(field("hidden_size")),
            layer_types=layer_types,
            moe_layers=moe_layers,
            intermediate_size=int(field("intermediate_size", 0)),
            tie_word_embeddings=bool(field("tie_word_embeddings", False)),
            max_position_embeddings=int(field("max_position_embeddings", 4096)),
            dtype=str(text.get("dtype") or text.get("torch_dtype") or data.get("dtype") or "bfloat16"),
            num_attention_heads=int(field("num_attention_heads")),
            num_key_value_heads=int(field("num_key_value_heads")),
            head_dim=int(field("head_dim")),
            linear_num_key_heads=int(field("linear_num_key_heads")),
            linear_num_value_heads=int(field("linear_num_value_heads")),
            linear_key_head_dim=int(field("linear_key_head_dim")),
            linear_value_head_dim=int(field("linear_value_head_dim")),
            linear_conv_kernel_dim=int(field("linear_conv_kernel_dim", 4)),
            num_experts=experts,
            num_experts_per_tok=int(field("num_experts_per_tok", 0)) if experts else 0,
            moe_intermediate_size=int(field("moe_intermediate_size", 0)) if experts else 0,
            shared_expert_intermediate_size=int(field("shared_expert_intermediate_size", 0)) if experts else 0,
            mtp_layers=int(text.get("mtp_num_hidden_layers", default_mtp)),
            vision=data.get("vision_config") if "text_config" in data else None,
        )

    @property
    def linear_attention_layers(self) -> int:
        return self.layer_types.count("linear_attention")

    @property
    def full_attention_layers(self) -> int:
        return self.layer_types.count("full_attention")

    @property
    def conv_channels(self) -> int:
        """Channels of the causal conv: q, k and v of every head."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_width

    @property
    def value_width(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


@dataclass(frozen=True)
class QwenParameters:
    """``served``: the language model's parameters (tied embeddings once); ``routed``: those in routed
    experts; ``vision`` and ``mtp``: the release's parts a text server does not load."""

    served: int
    routed: int
    vision: int
    mtp: int


def parameter_counts(shape: QwenShape) -> QwenParameters:
    """Parameters of ``shape``'s model, its routed experts, and the skipped vision tower and MTP head."""
    h, v = shape.hidden_size, shape.vocab_size
    served = v * h * (1 if shape.tie_word_embeddings else 2) + h  # embeddings, LM head, final norm
    routed = 0
    for kind, moe in zip(shape.layer_types, shape.moe_layers, strict=True):
        mixer = _gated_deltanet(shape) if kind == "linear_attention" else _gated_attention(shape)
        served += 2 * h + mixer + _mlp(shape, moe)
        routed += _routed_experts(shape) if moe else 0
    mtp_layer = 2 * h + _gated_attention(shape) + _mlp(shape, shape.num_experts > 0)
    mtp = 2 * h * h + 3 * h + shape.mtp_layers * mtp_layer if shape.mtp_layers else 0  # fc, 3 norms, layers
    return QwenParameters(served, routed, _vision_tower(shape.vision or {}), mtp)


def _gated_deltanet(s: QwenShape) -> int:
    """in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d (no bias), A_log, dt_bias, norm, out_proj."""
    h, hv = s.hidden_size, s.linear_num_value_heads
    projections = h * (s.conv_channels + s.value_width + 2 * hv) + s.value_width * h
    return projections + s.conv_channels * s.linear_conv_kernel_dim + 2 * hv + s.linear_value_head_dim


def _gated_attention(s: QwenShape) -> int:
    """q_proj (query and output gate), k_proj, v_proj, o_proj, q_norm, k_norm."""
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    return s.hidden_size * (2 * q + 2 * kv) + q * s.hidden_size + 2 * s.head_dim


def _mlp(s: QwenShape, moe: bool) -> int:
    h = s.hidden_size
    if not moe:
        return 3 * h * s.intermediate_size
    # router, routed experts, shared expert, shared expert gate
    return s.num_experts * h + _routed_experts(s) + 3 * h * s.shared_expert_intermediate_size + h


def _routed_experts(s: QwenShape) -> int:
    return s.num_experts * 3 * s.hidden_size * s.moe_intermediate_size


def _vision_tower(c: dict[str, Any]) -> int:
    """Qwen3.5's vision tower: patch embedding, position embedding, ``depth`` pre-norm ViT blocks and the
    patch merger (LayerNorms and Linears with biases)."""
    if not c:
        return 0
    h, i, depth = int(c["hidden_size"]), int(c["intermediate_size"]), int(c["depth"])
    patch = h * int(c.get("in_channels", 3)) * int(c.get("temporal_patch_size", 2)) * int(c["patch_size"]) ** 2 + h
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (i * h + i) + (h * i + h)
    merged = h * int(c.get("spatial_merge_size", 2)) ** 2
    out = int(c["out_hidden_size"])
    merger = 2 * h + merged * merged + merged + out * merged + out
    positions = int(c.get("num_position_embeddings", 2304))  # transformers' default (Qwen3_5VisionConfig)
    return patch + positions * h + depth * block + merger


def fp32_parameters(shape: QwenShape) -> int:
    """Parameters kept in fp32 whatever the weight dtype: each Gated DeltaNet layer's conv taps, ``A_log``
    and ``dt_bias`` (they feed the fp32 recurrent state; see ``precision``)."""
    per_layer = shape.conv_channels * shape.linear_conv_kernel_dim + 2 * shape.linear_num_value_heads
    return shape.linear_attention_layers * per_layer


def recurrent_state_bytes(shape: QwenShape) -> int:
    """One sequence's Gated DeltaNet states, fp32: per layer the ``[Hv, K, V]`` recurrent state and the
    last ``W - 1`` inputs of the causal conv over q, k and v."""
    recurrent = shape.linear_num_value_heads * shape.linear_key_head_dim * shape.linear_value_head_dim
    conv = shape.conv_channels * (shape.linear_conv_kernel_dim - 1)
    return shape.linear_attention_layers * (recurrent + conv) * 4


def kv_elements_per_token(shape: QwenShape) -> int:
    """Values one token adds to the KV caches: K and V of every KV head in every full-attention layer."""
    return shape.full_attention_layers * 2 * shape.num_key_value_heads * shape.head_dim
