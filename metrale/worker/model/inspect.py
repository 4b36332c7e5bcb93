"""A model's vital numbers from its config alone: parameters (total and active per token), weight and
state bytes, and how many sequences of a given context fit in a given memory.

Nothing is read but ``config.json``: the parameters are those of our model built on the meta device
(no memory), i.e. exactly what loading would allocate — fused projections hold the same elements as
the checkpoint tensors they are made of, and the LM head is counted even when tied (we keep our own).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.worker.model.config import ModelConfig
from metrale.worker.model.kimi_linear import KimiLinearModel
from metrale.worker.model.precision import dtype_name, parameter_dtype
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
    """Parameters of ``config``'s model (built on the meta device), with their bytes at ``dtype``."""
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
    directory: Path
    config: ModelConfig
    parameters: ParameterCount
    state: StateSizes
    dtype: torch.dtype

    def capacity(self, memory: int, context: int) -> Capacity:
        """How many sequences of ``context`` tokens fit in ``memory`` bytes: memory minus the weights,
        over one sequence's state (KDA, constant) plus ``context`` tokens of MLA latents."""
        return Capacity(memory, context, self.state.total(context), memory - self.parameters.weight_bytes)

    def rows(self) -> list[tuple[str, str]]:
        c, p = self.config, self.parameters
        pattern = " ".join(f"{t}/{m}" for t, m in zip(c.layer_types, c.mlp_layer_types, strict=True))
        moe = (
            f"{c.num_experts} experts, top-{c.num_experts_per_token}, {c.num_shared_experts} shared"
            if "moe" in c.mlp_layer_types
            else "none"
        )
        return [
            ("layers", f"{c.num_hidden_layers}: {pattern}"),
            ("hidden size", str(c.hidden_size)),
            ("KDA", f"{c.linear_num_heads} heads × {c.linear_head_dim}, conv {c.linear_conv_kernel_dim}"),
            ("MLA", f"{c.num_attention_heads} heads, kv_lora_rank {c.kv_lora_rank}, q_lora_rank {c.q_lora_rank}"),
            ("MoE", moe),
            ("vocab", str(c.vocab_size)),
            ("context", f"{c.max_position_embeddings:,}"),
            ("parameters", f"{p.total:,} ({human_count(p.total)})"),
            ("active per token", f"{p.active:,} ({human_count(p.active)}; routed top-k + shared experts, embeddings)"),
            ("weights", f"{p.weight_bytes:,} bytes ({human_bytes(p.weight_bytes)}, {dtype_name(self.dtype)})"),
            ("state per sequence", f"{self.state.slot_bytes:,} bytes ({human_bytes(self.state.slot_bytes)}, KDA fp32)"),
            ("state per token", f"{self.state.token_bytes:,} bytes (MLA latents, {dtype_name(self.dtype)})"),
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
    """The summary of ``config`` (read from ``directory``) with weights and MLA latents in ``dtype``."""
    return ModelSummary(directory, config, count_parameters(config, dtype), state_sizes(config, dtype), dtype)


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
