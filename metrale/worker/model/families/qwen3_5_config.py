"""Qwen3.5 model configuration (dense and MoE), read from a Hugging Face ``config.json``.

The releases are vision-language checkpoints (``Qwen3_5ForConditionalGeneration``, ``model_type``
``qwen3_5``; ``Qwen3_5MoeForConditionalGeneration``, ``qwen3_5_moe``) whose language model is described
by the nested ``text_config``; a text-only ``*ForCausalLM`` (``qwen3_5_text``, ``qwen3_5_moe_text``) has
the same fields at the top level. A MoE model runs Qwen's MoE block in every layer. Only the fields that
change the math are kept; a value Metrale does not implement is refused naming its field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal

from metrale.worker.model.config import ModelConfigError
from metrale.worker.model.state_layout import StateLayout

QwenLayerType = Literal["linear_attention", "full_attention"]
_LAYER_TYPES: tuple[QwenLayerType, ...] = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen35Config:
    """The architecture of a Qwen3.5 dense model: Gated DeltaNet and gated GQA layers, SwiGLU MLPs."""

    family: ClassVar[str] = "qwen3_5"

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[QwenLayerType, ...]
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # gated attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # tokens
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelConfigError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelConfigError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelConfigError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives {self.rotary_dim} rotary dims "
                f"of head_dim={self.head_dim} (must be even and in 2..head_dim)"
            )

    # Derived sizes -------------------------------------------------------------------------------
    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_key_dim(self) -> int:
        """Width of each of the Gated DeltaNet's q and k: key heads × key head dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        """Width of the Gated DeltaNet's v (and of its output gate z): value heads × value head dim."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: q, k and v side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each attention head that RoPE rotates (``head_dim × partial_rotary_factor``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def state_layout(self) -> StateLayout:
        return StateLayout(
            family=self.family,
            recurrent_kind="gdn",
            recurrent_layers=self.linear_layers,
            recurrent_shape=(self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim),
            conv_channels=self.conv_dim,
            conv_kernel=self.linear_conv_kernel_dim,
            attention_kind="gqa",
            attention_layers=self.attention_layers,
            token_shape=(2, self.num_key_value_heads, self.head_dim),
        )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` runs Qwen's MoE block (else a dense SwiGLU MLP of ``intermediate_size``)."""
        return False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> Qwen35Config:
        """Build from an HF ``config.json`` (nested ``text_config`` or flat); raise ``ModelConfigError``
        naming any bad field."""
        return QwenConfigFields(data).build()


@dataclass(frozen=True)
class Qwen35MoeConfig(Qwen35Config):
    """A Qwen3.5 MoE model: every layer's MLP is routed experts (softmax top-k, renormalized) plus a
    shared expert scaled by a sigmoid gate."""

    family: ClassVar[str] = "qwen3_5_moe"

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # Qwen3.5 MoE's router always renormalizes its top k

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_experts()

    def check_experts(self) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"
            )

    def is_moe_layer(self, layer: int) -> bool:
        return True

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> Qwen35MoeConfig:
        config = QwenConfigFields(data).build()
        if not isinstance(config, Qwen35MoeConfig):
            raise ModelConfigError("config.json: num_experts is missing: not a Qwen3.5 MoE config")
        return config


class QwenConfigFields:
    """The language model's fields of a Qwen3.5 config (or a flat Qwen3-Next one), with the top level's as
    fallbacks."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.top = data
        self.text = data.get("text_config") or data
        self.prefix = "text_config." if "text_config" in data else ""

    def get(self, name: str, default: Any = None) -> Any:
        value = self.text.get(name)
        return default if value is None else value

    def require(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise ModelConfigError(f"config.json: missing field '{self.prefix}{name}'")
        return value

    def check_supported(self) -> None:
        unsupported = {
            "hidden_act": ("silu", self.get("hidden_act", "silu")),
            "attention_bias": (False, self.get("attention_bias", False)),
            "attn_output_gate": (True, self.get("attn_output_gate", True)),
        }
        for field, (supported, value) in unsupported.items():
            if value != supported:
                raise ModelConfigError(
                    f"config.json: {self.prefix}{field}={value!r} is not supported (only {supported!r})"
                )
        rope_type = self.rope().get("rope_type", "default")
        if rope_type != "default":
            raise ModelConfigError(
                f"config.json: {self.prefix}rope_parameters.rope_type={rope_type!r} is not supported (only 'default')"
            )
        state_dtype = self.get("mamba_ssm_dtype", "float32")
        if state_dtype != "float32":
            raise ModelConfigError(
                f"config.json: {self.prefix}mamba_ssm_dtype={state_dtype!r} is not supported "
                "(Metrale keeps recurrent states in 'float32')"
            )

    def rope(self) -> dict[str, Any]:
        return dict(self.get("rope_parameters") or self.get("rope_scaling") or {})

    def layer_types(self, num_layers: int) -> tuple[QwenLayerType, ...]:
        listed = self.get("layer_types")
        if listed:
            for kind in listed:
                if kind not in _LAYER_TYPES:
                    raise ModelConfigError(
                        f"config.json: {self.prefix}layer_types entry {kind!r} is not one of {list(_LAYER_TYPES)}"
                    )
            return tuple(listed)
        interval = int(self.get("full_attention_interval", 4))
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))

    def tied(self) -> bool:
        """The top level's ``tie_word_embeddings`` governs a nested config (as transformers reads it)."""
        if "text_config" in self.top and self.top.get("tie_word_embeddings") is not None:
            return bool(self.top["tie_word_embeddings"])
        return bool(self.get("tie_word_embeddings", False))

    def moe_fields(self) -> dict[str, int]:
        """The MoE block's sizes; a MoE layer on some layers only is refused naming the field."""
        if self.get("mlp_only_layers"):
            raise ModelConfigError(f"config.json: {self.prefix}mlp_only_layers is not supported (MoE in every layer)")
        return {
            "num_experts": int(self.require("num_experts")),
            "num_experts_per_tok": int(self.require("num_experts_per_tok")),
            "moe_intermediate_size": int(self.require("moe_intermediate_size")),
            "shared_expert_intermediate_size": int(self.require("shared_expert_intermediate_size")),
        }

    def build(self) -> Qwen35Config:
        self.check_supported()
        moe = self.get("num_experts") is not None
        extra: dict[str, Any] = self.moe_fields() if moe else {}
        config_class = Qwen35MoeConfig if moe else Qwen35Config
        intermediate_size = int(self.get("intermediate_size", 0) if moe else self.require("intermediate_size"))
        return config_class(**extra, **self.common_fields(), intermediate_size=intermediate_size)

    def common_fields(self) -> dict[str, Any]:
        """The keyword arguments of :class:`Qwen35Config` every family reads alike (all but
        ``intermediate_size`` and the experts'); call :meth:`check_supported` first."""
        num_layers = int(self.require("num_hidden_layers"))
        rope = self.rope()
        eos = self.get("eos_token_id", self.top.get("eos_token_id"))
        return dict(
            vocab_size=int(self.require("vocab_size")),
            hidden_size=int(self.require("hidden_size")),
            num_hidden_layers=num_layers,
            layer_types=self.layer_types(num_layers),
            rms_norm_eps=float(self.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=self.tied(),
            max_position_embeddings=int(self.get("max_position_embeddings", 32768)),
            num_attention_heads=int(self.require("num_attention_heads")),
            num_key_value_heads=int(self.require("num_key_value_heads")),
            head_dim=int(self.get("head_dim", 256)),
            rope_theta=float(rope.get("rope_theta", self.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", self.get("partial_rotary_factor", 0.25))),
            linear_num_key_heads=int(self.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(self.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(self.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(self.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(self.get("linear_conv_kernel_dim", 4)),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            bos_token_id=self.get("bos_token_id"),
            pad_token_id=self.get("pad_token_id"),
            dtype=str(self.get("dtype", self.get("torch_dtype", self.top.get("dtype", "float32")))),
        )
