"""A model's vital numbers from its config alone: parameters (total and active per token), weight and
state bytes, and how many sequences of a given context fit in a given memory.

Nothing is read but ``config.json``, and the family it names decides how it is sized:

- Kimi Linear: the parameters are those of our model built on the meta device (no memory), i.e.
  exactly what loading would allocate — fused projections hold the same elements as the checkpoint
  tensors they are made of, and the LM head is counted even when tied (we keep our own);
- Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (``families.qwen_sizing``): the language model we serve, tensor
  by tensor (tied embeddings once), and apart from it the release parts a text server skips (Qwen3.5's
  vision tower, the MTP head). The weight bytes are what loading allocates: a tied LM head is a tensor
  of its own there.

The state bytes are those the worker's pools allocate (``StatePool``: per slot and per cached token), so
``Capacity`` is what an engine sized that way holds (tests/worker/model/test_limits.py).

A family adds itself with one ``Summarizer`` in ``SUMMARIZERS`` (keyed by ``model_type``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch

from metrale.worker.model.config import ModelConfig
from metrale.worker.model.families import qwen_sizing, registry
from metrale.worker.model.families.kimi_linear import KimiLinearModel
from metrale.worker.model.families.qwen_sizing import QwenShape
from metrale.worker.model.precision import AUTO, DtypeChoice, dtype_name, parameter_dtype, parse_dtype, weight_dtype
from metrale.worker.model.state import StateSizes, state_sizes

ROUTED_EXPERT_PARAMETERS = ("experts_gate_up", "experts_down")
"""The routed experts' parameters: a token runs ``top_k`` of the ``num_experts`` experts in them."""


@dataclass(frozen=True)
class ParameterCount:
    """``total`` parameters; ``active`` per token (all but the routed experts, plus ``top_k`` of them);
    ``weight_bytes`` at the weight dtype (a few small parameters stay fp32)."""

    total: int
    active: int
    weight_bytes: int


@dataclass(frozen=True)
class Capacity:
    """Sequences of ``context`` tokens whose state fits in ``memory`` bytes beside the weights."""

    memory: int
    context: int
    sequence_bytes: int
    free_bytes: int

    @property
    def sequences(self) -> int:
        return max(self.free_bytes, 0) // self.sequence_bytes


def count_parameters(config: ModelConfig, dtype: torch.dtype) -> ParameterCount:
    """Parameters of ``config``'s Kimi Linear model (built on the meta device), with their bytes at ``dtype``."""
    with torch.device("meta"):
        model = KimiLinearModel(config)
    total = routed = weight_bytes = 0
    for name, parameter in model.named_parameters():
        total += parameter.numel()
        weight_bytes += parameter.numel() * parameter_dtype(name, dtype).itemsize
        if name.rpartition(".")[2] in ROUTED_EXPERT_PARAMETERS:
            routed += parameter.numel()
    active = total - routed + routed * config.num_experts_per_token // max(config.num_experts, 1)
    return ParameterCount(total, active, weight_bytes)


@dataclass(frozen=True)
class ModelSummary:
    """What ``met model inspect`` prints: ``architecture`` rows (the family's words), the parameters
    served, the state (``state_kinds``: what the per-sequence and the per-token parts are), and
    ``skipped`` rows for release parts that are not served."""

    directory: Path
    architecture: list[tuple[str, str]]
    parameters: ParameterCount
    state: StateSizes
    state_kinds: tuple[str, str]
    dtype: torch.dtype
    context: int
    parameters_note: str = "routed top-k + shared experts, embeddings"
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def capacity(self, memory: int, context: int) -> Capacity:
        """How many sequences of ``context`` tokens fit in ``memory`` bytes: memory minus the weights,
        over one sequence's state (recurrent, constant) plus ``context`` tokens of attention cache."""
        return Capacity(memory, context, self.state.total(context), memory - self.parameters.weight_bytes)

    def rows(self) -> list[tuple[str, str]]:
        p, (per_sequence, per_token) = self.parameters, self.state_kinds
        return [
            *self.architecture,
            ("context", f"{self.context:,}"),
            ("parameters", f"{p.total:,} ({human_count(p.total)})"),
            ("active per token", f"{p.active:,} ({human_count(p.active)}; {self.parameters_note})"),
            *self.skipped,
            ("weights", f"{p.weight_bytes:,} bytes ({human_bytes(p.weight_bytes)}, {dtype_name(self.dtype)})"),
            (
                "state per sequence",
                f"{self.state.slot_bytes:,} bytes ({human_bytes(self.state.slot_bytes)}, {per_sequence})",
            ),
            ("state per token", f"{self.state.token_bytes:,} bytes ({per_token}, {dtype_name(self.dtype)})"),
        ]


def capacity_rows(capacity: Capacity) -> list[tuple[str, str]]:
    """The rows saying how many sequences fit, and why."""
    per_sequence = f"{human_bytes(capacity.sequence_bytes)} per sequence of {capacity.context:,} tokens"
    free = f"{human_bytes(capacity.free_bytes)} left beside the weights" if capacity.free_bytes > 0 else "no room"
    return [
        ("memory", f"{capacity.memory:,} bytes ({human_bytes(capacity.memory)}): {free}"),
        ("sequences", f"{capacity.sequences:,} ({per_sequence}; weights and state only, no activations)"),
    ]


def summarize(directory: Path, config: ModelConfig, dtype: torch.dtype) -> ModelSummary:
    """The summary of Kimi Linear ``config`` (read from ``directory``) with weights and MLA latents in ``dtype``."""
    c = config
    pattern = " ".join(f"{t}/{m}" for t, m in zip(c.layer_types, c.mlp_layer_types, strict=True))
    moe = (
        f"{c.num_experts} experts, top-{c.num_experts_per_token}, {c.num_shared_experts} shared"
        if "moe" in c.mlp_layer_types
        else "none"
    )
    architecture = [
        ("family", "kimi_linear"),
        ("layers", f"{c.num_hidden_layers}: {pattern}"),
        ("hidden size", str(c.hidden_size)),
        ("KDA", f"{c.linear_num_heads} heads × {c.linear_head_dim}, conv {c.linear_conv_kernel_dim}"),
        ("MLA", f"{c.num_attention_heads} heads, kv_lora_rank {c.kv_lora_rank}, q_lora_rank {c.q_lora_rank}"),
        ("MoE", moe),
        ("vocab", str(c.vocab_size)),
    ]
    return ModelSummary(
        directory,
        architecture,
        count_parameters(config, dtype),
        state_sizes(config, dtype),
        ("KDA fp32", "MLA latents"),
        dtype,
        c.max_position_embeddings,
    )


def summarize_qwen(directory: Path, shape: QwenShape, dtype: torch.dtype) -> ModelSummary:
    """The summary of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next ``shape`` with weights and K/V in ``dtype``."""
    s, counts = shape, qwen_sizing.parameter_counts(shape)
    active = counts.served - counts.routed + counts.routed * s.num_experts_per_tok // max(s.num_experts, 1)
    fp32 = qwen_sizing.fp32_parameters(shape)
    embeddings = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    # The parameters are the release's (tied embeddings once); the bytes are what loading allocates,
    # and the model keeps an LM head of its own even when the release ties it to the embeddings.
    own_lm_head = s.vocab_size * s.hidden_size if s.tie_word_embeddings else 0
    weight_bytes = (counts.served - fp32 + own_lm_head) * dtype.itemsize + fp32 * 4
    moe_layers = sum(s.moe_layers)
    moe = (
        f"{moe_layers} layers: {s.num_experts} experts × {s.moe_intermediate_size}, top-{s.num_experts_per_tok}, "
        f"shared expert × {s.shared_expert_intermediate_size}"
        if moe_layers
        else "none"
    )
    architecture = [
        ("family", s.family),
        (
            "layers",
            f"{len(s.layer_types)}: {s.linear_attention_layers} Gated DeltaNet, "
            f"{s.full_attention_layers} gated attention",
        ),
        ("hidden size", str(s.hidden_size)),
        (
            "Gated DeltaNet",
            f"{s.linear_num_key_heads} key heads × {s.linear_key_head_dim}, "
            f"{s.linear_num_value_heads} value heads × {s.linear_value_head_dim}, conv {s.linear_conv_kernel_dim}",
        ),
        ("attention", f"{s.num_attention_heads} query heads, {s.num_key_value_heads} KV heads × {s.head_dim}"),
        (
            "dense FFN",
            f"{len(s.layer_types) - moe_layers} layers × {s.intermediate_size}"
            if moe_layers < len(s.layer_types)
            else "none",
        ),
        ("MoE", moe),
        ("vocab", f"{s.vocab_size}{' (embeddings tied to the LM head)' if s.tie_word_embeddings else ''}"),
    ]
    skipped = []
    if counts.vision:
        with_vision = counts.served + counts.vision
        skipped.append(
            (
                "vision tower (not served)",
                f"{counts.vision:,} ({human_count(counts.vision)}); "
                f"with it {with_vision:,} ({human_count(with_vision)})",
            )
        )
    if counts.mtp:
        with_mtp = counts.served + counts.vision + counts.mtp
        skipped.append(
            (
                "MTP head (not served)",
                f"{counts.mtp:,} ({human_count(counts.mtp)}); "
                f"the release's tensors {with_mtp:,} ({human_count(with_mtp)})",
            )
        )
    kv_bytes = qwen_sizing.kv_elements_per_token(shape) * dtype.itemsize
    return ModelSummary(
        directory,
        architecture,
        ParameterCount(counts.served, active, weight_bytes),
        StateSizes(qwen_sizing.recurrent_state_bytes(shape), kv_bytes),
        ("Gated DeltaNet fp32", "K and V of the gated attention layers"),
        dtype,
        s.max_position_embeddings,
        parameters_note=(
            f"{'routed top-k + the shared expert' if moe_layers else 'every parameter'}, embeddings and LM head; "
            f"{human_count(active - embeddings)} without them"
        ),
        skipped=skipped,
    )


Summarizer = Callable[[Path, dict[str, Any], DtypeChoice], ModelSummary]


def _kimi(directory: Path, data: dict[str, Any], dtype: DtypeChoice) -> ModelSummary:
    config = ModelConfig.from_hf_dict(data)
    return summarize(directory, config, weight_dtype(dtype, config))


def _qwen(directory: Path, data: dict[str, Any], dtype: DtypeChoice) -> ModelSummary:
    shape = QwenShape.from_hf_dict(data)
    chosen = shape.dtype if dtype is None or dtype == AUTO else dtype
    return summarize_qwen(directory, shape, chosen if isinstance(chosen, torch.dtype) else parse_dtype(chosen))


SUMMARIZERS: dict[str, Summarizer] = {"kimi_linear": _kimi, **dict.fromkeys(get_args(qwen_sizing.QwenFamily), _qwen)}
"""Family name (``families/registry.py``) → how a config of that family is sized."""


def summarize_directory(directory: Path, dtype: DtypeChoice = None) -> ModelSummary:
    """The summary of the model whose ``config.json`` is in ``directory``, weights in ``dtype`` (None or
    ``auto``: the config's); the family is the registry's choice, and one not served is refused with
    ``ModelConfigError`` listing those that are."""
    data = registry.read_config_dict(directory)
    return SUMMARIZERS[registry.family_for(data).name](Path(directory), data, dtype)


def human_count(n: int) -> str:
    """``49_123_000_000`` → ``49.1B``."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def human_bytes(n: int) -> str:
    """Bytes in SI units: ``98_246_000_000`` → ``98.2 GB``."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
