"""Qwen3-Next's fused linear-attention projections, in Qwen3.5's terms.

A Qwen3-Next Gated DeltaNet layer stores two fused projections, interleaved per key head:
``in_proj_qkvz`` ``[Hk·(2·K + 2·r·V), D]`` is, for each key head ``g`` in turn, its query rows ``[K]``, key
rows ``[K]``, then the value rows ``[r·V]`` and gate rows ``[r·V]`` of the ``r = Hv / Hk`` value heads that
share it; ``in_proj_ba`` ``[2·Hv, D]`` is, per key head, the ``r`` beta rows then the ``r`` decay rows.
Qwen3.5 stores the same rows un-interleaved, in head order: ``in_proj_qkv`` ``[2·Hk·K + Hv·V, D]`` (every
query row, every key row, every value row), ``in_proj_z`` ``[Hv·V, D]``, ``in_proj_b`` and ``in_proj_a``
``[Hv, D]``. Value head ``h`` is ``g·r + j`` (transformers' ``fix_query_key_value_ordering``), so splitting is
a reshape, a split and a reshape; fusing is its inverse (to write Qwen3-Next-shaped checkpoints).

The functions act on dim 0 (the output rows of a weight); any trailing dims ride along.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LinearAttentionHeads:
    """The head layout of a Gated DeltaNet layer: ``Hk`` key heads of ``K`` dims, ``Hv`` value heads of ``V``."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.num_key_heads}"
            )

    @property
    def values_per_key_head(self) -> int:
        return self.num_value_heads // self.num_key_heads

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim


def split_in_proj_qkvz(qkvz: torch.Tensor, heads: LinearAttentionHeads) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next ``in_proj_qkvz`` ``[Hk·(2K + 2rV), ...]`` → Qwen3.5 (``in_proj_qkv`` ``[2·Hk·K + Hv·V, ...]``,
    ``in_proj_z`` ``[Hv·V, ...]``); both new tensors."""
    k, group_v = heads.key_head_dim, heads.values_per_key_head * heads.value_head_dim
    grouped = qkvz.reshape(heads.num_key_heads, 2 * k + 2 * group_v, *qkvz.shape[1:])
    q, key, v, z = grouped.split([k, k, group_v, group_v], dim=1)
    rows = qkvz.shape[1:]
    qkv = torch.cat([q.reshape(-1, *rows), key.reshape(-1, *rows), v.reshape(-1, *rows)])
    return qkv, z.reshape(-1, *rows)


def split_in_proj_ba(ba: torch.Tensor, heads: LinearAttentionHeads) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next ``in_proj_ba`` ``[2·Hv, ...]`` → Qwen3.5 (``in_proj_b``, ``in_proj_a``), each ``[Hv, ...]``."""
    r, rows = heads.values_per_key_head, ba.shape[1:]
    b, a = ba.reshape(heads.num_key_heads, 2 * r, *rows).split([r, r], dim=1)
    return b.reshape(-1, *rows), a.reshape(-1, *rows)


def fuse_in_proj_qkvz(qkv: torch.Tensor, z: torch.Tensor, heads: LinearAttentionHeads) -> torch.Tensor:
    """The inverse of :func:`split_in_proj_qkvz`."""
    hk, rows = heads.num_key_heads, qkv.shape[1:]
    q, k, v = qkv.split([heads.key_dim, heads.key_dim, heads.value_dim])
    parts = [t.reshape(hk, -1, *rows) for t in (q, k, v, z)]
    return torch.cat(parts, dim=1).reshape(-1, *rows)


def fuse_in_proj_ba(b: torch.Tensor, a: torch.Tensor, heads: LinearAttentionHeads) -> torch.Tensor:
    """The inverse of :func:`split_in_proj_ba`."""
    hk, rows = heads.num_key_heads, b.shape[1:]
    return torch.cat([b.reshape(hk, -1, *rows), a.reshape(hk, -1, *rows)], dim=1).reshape(-1, *rows)


def is_full_attention(layer: int, full_attention_interval: int = 4) -> bool:
    """Qwen3-Next lists no ``layer_types``: layer ``i`` is full attention when ``(i + 1) % interval == 0``."""
    return (layer + 1) % full_attention_interval == 0
