"""KimiLinear model configuration, read from a Hugging Face ``config.json``.

Only the fields that change the math are kept. Both the original Moonshot spellings
(``num_experts``, ``linear_attn_config``, ``first_k_dense_replace``…) and transformers' spellings
(``num_local_experts``, ``layer_types``, ``mlp_layer_types``…) are accepted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from metrale.worker.model.state_layout import StateLayout

LayerType = Literal["kda", "mla"]
MlpType = Literal["dense", "moe"]

_HF_LAYER_TYPES: dict[str, LayerType] = {"linear_attention": "kda", "full_attention": "mla"}
_HF_MLP_TYPES: dict[str, MlpType] = {"dense": "dense", "sparse": "moe"}


class ModelConfigError(ValueError):
    """A config.json that Metrale cannot serve; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a KimiLinear model (KDA + MLA layers, dense or MoE MLPs)."""

    family: ClassVar[str] = "kimi_linear"

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[LayerType, ...]
    mlp_layer_types: tuple[MlpType, ...]
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    # MoE
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
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
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ModelConfigError(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries, "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        if "moe" in self.mlp_layer_types:
            self._validate_moe()

    def _validate_moe(self) -> None:
        if self.num_experts <= 0 or not 0 < self.num_experts_per_token <= self.num_experts:
            raise ModelConfigError(
                f"num_experts_per_token={self.num_experts_per_token} must be in 1..num_experts={self.num_experts}"
            )
        if self.num_experts % self.num_expert_group:
            raise ModelConfigError(
                f"num_experts={self.num_experts} is not divisible by num_expert_group={self.num_expert_group}"
            )
        if self.num_experts // self.num_expert_group < 2:
            raise ModelConfigError("grouped routing needs at least 2 experts per group (num_expert_group)")
        if not 0 < self.topk_group <= self.num_expert_group:
            raise ModelConfigError(f"topk_group={self.topk_group} must be in 1..{self.num_expert_group}")

    # Derived sizes -------------------------------------------------------------------------------
    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    @property
    def linear_dim(self) -> int:
        """Width of each of KDA's q, k and v projections: heads × head_dim."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per MLA layer: the normalized KV latent plus the shared key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def state_layout(self) -> StateLayout:
        return StateLayout(
            family=self.family,
            recurrent_kind="kda",
            recurrent_layers=self.kda_layers,
            recurrent_shape=(self.linear_num_heads, self.linear_head_dim, self.linear_head_dim),
            conv_channels=3 * self.linear_dim,
            conv_kernel=self.linear_conv_kernel_dim,
            attention_kind="mla",
            attention_layers=self.mla_layers,
            token_shape=(self.latent_dim,),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ModelConfig:
        path = Path(directory) / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"{path}: no config.json in the model directory") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ModelConfigError(f"{path}: expected a JSON object")
        return cls.from_hf_dict(data)

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from the fields of an HF ``config.json``; raise ``ModelConfigError`` naming any bad field."""
        return _HfFields(data).build()


class _HfFields:
    """Reads HF config fields with their aliases and checks the values Metrale does not implement."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.linear = data.get("linear_attn_config") or {}

    def get(self, *names: str, default: Any = None) -> Any:
        for name in names:
            if self.data.get(name) is not None:
                return self.data[name]
        return default

    def require(self, *names: str) -> Any:
        value = self.get(*names)
        if value is None:
            raise ModelConfigError(f"config.json: missing field '{names[0]}'")
        return value

    def check_supported(self) -> None:
        model_type = self.data.get("model_type")
        if model_type != "kimi_linear":
            raise ModelConfigError(
                f"config.json: model_type '{model_type}' is not supported (Metrale serves 'kimi_linear')"
            )
        unsupported = {
            "hidden_act": ("silu", self.get("hidden_act", default="silu")),
            "mla_use_nope": (True, self.get("mla_use_nope", default=True)),
            "attention_bias": (False, self.get("attention_bias", default=False)),
            "moe_router_activation_func": (
                "sigmoid",
                self.get("moe_router_activation_func", default="sigmoid"),
            ),
        }
        for field, (supported, value) in unsupported.items():
            if value != supported:
                raise ModelConfigError(f"config.json: {field}={value!r} is not supported (only {supported!r})")
        heads, kv_heads = self.get("num_attention_heads"), self.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            raise ModelConfigError(
                f"config.json: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} for MLA"
            )

    def layer_types(self, num_layers: int) -> tuple[LayerType, ...]:
        if self.data.get("layer_types"):
            return tuple(_lookup(_HF_LAYER_TYPES, t, "layer_types") for t in self.data["layer_types"])
        if "kda_layers" in self.linear and "full_attn_layers" in self.linear:
            types: list[LayerType | None] = [None] * num_layers
            for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
                for one_based in self.linear[key]:
                    if not 1 <= one_based <= num_layers:
                        raise ModelConfigError(f"config.json: linear_attn_config.{key} has layer {one_based}")
                    types[one_based - 1] = kind  # type: ignore[assignment]
            if None in types:
                missing = [i + 1 for i, t in enumerate(types) if t is None]
                raise ModelConfigError(f"config.json: layers {missing} are in neither kda_layers nor full_attn_layers")
            return tuple(t for t in types if t is not None)
        return tuple("mla" if i and i % 4 == 0 else "kda" for i in range(num_layers))

    def mlp_layer_types(self, num_layers: int, num_experts: int) -> tuple[MlpType, ...]:
        if self.data.get("mlp_layer_types"):
            return tuple(_lookup(_HF_MLP_TYPES, t, "mlp_layer_types") for t in self.data["mlp_layer_types"])
        if num_experts <= 0:
            return tuple(_moe_or_dense(False) for _ in range(num_layers))
        first_dense = int(self.get("first_k_dense_replace", default=1))
        freq = int(self.get("moe_layer_freq", default=1))
        return tuple(_moe_or_dense(i >= first_dense and i % freq == 0) for i in range(num_layers))

    def build(self) -> ModelConfig:
        self.check_supported()
        num_layers = int(self.require("num_hidden_layers"))
        num_experts = int(self.get("num_experts", "num_local_experts", default=0))
        eos = self.get("eos_token_id")
        return ModelConfig(
            vocab_size=int(self.require("vocab_size")),
            hidden_size=int(self.require("hidden_size")),
            num_hidden_layers=num_layers,
            layer_types=self.layer_types(num_layers),
            mlp_layer_types=self.mlp_layer_types(num_layers, num_experts),
            intermediate_size=int(self.require("intermediate_size")),
            rms_norm_eps=float(self.get("rms_norm_eps", default=1e-5)),
            tie_word_embeddings=bool(self.get("tie_word_embeddings", default=False)),
            max_position_embeddings=int(self.get("model_max_length", "max_position_embeddings", default=4096)),
            num_attention_heads=int(self.require("num_attention_heads")),
            q_lora_rank=self.get("q_lora_rank"),
            kv_lora_rank=int(self.require("kv_lora_rank")),
            qk_nope_head_dim=int(self.require("qk_nope_head_dim")),
            qk_rope_head_dim=int(self.require("qk_rope_head_dim")),
            v_head_dim=int(self.require("v_head_dim")),
            linear_num_heads=int(self.linear.get("num_heads", self.get("linear_num_heads", default=32))),
            linear_head_dim=int(self.linear.get("head_dim", self.get("linear_head_dim", default=128))),
            linear_conv_kernel_dim=int(
                self.linear.get("short_conv_kernel_size", self.get("linear_conv_kernel_dim", default=4))
            ),
            num_experts=num_experts,
            num_experts_per_token=int(self.get("num_experts_per_token", "num_experts_per_tok", default=0)),
            num_shared_experts=int(self.get("num_shared_experts", "n_shared_experts", default=0)),
            moe_intermediate_size=int(self.get("moe_intermediate_size", default=0)),
            routed_scaling_factor=float(self.get("routed_scaling_factor", default=1.0)),
            moe_renormalize=bool(self.get("moe_renormalize", "norm_topk_prob", default=True)),
            num_expert_group=int(self.get("num_expert_group", "n_group", default=1)),
            topk_group=int(self.get("topk_group", default=1)),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            bos_token_id=self.get("bos_token_id"),
            pad_token_id=self.get("pad_token_id"),
            dtype=str(self.get("dtype", "torch_dtype", default="float32")),
        )


def _moe_or_dense(is_moe: bool) -> MlpType:
    return "moe" if is_moe else "dense"


def _lookup(table: dict[str, Any], value: str, field: str) -> Any:
    try:
        return table[value]
    except KeyError:
        raise ModelConfigError(f"config.json: {field} entry {value!r} is not one of {sorted(table)}") from None
