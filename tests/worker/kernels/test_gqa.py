"""The paged GQA attention reference against torch's own attention over the same keys and values laid flat."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.worker.kernels.gqa import paged_gqa_attention, store_kv

BLOCK = 4


def _flat_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Rows of positions ``start..`` attending causally to ``k, v [L, Hkv, D]`` (``repeat_kv`` heads)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    rows, length = q.shape[0], k.shape[0]
    mask = torch.arange(length).unsqueeze(0) <= torch.arange(start, start + rows).unsqueeze(1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
def test_paged_gqa_matches_flat_attention(heads: int, kv_heads: int, decode_only: bool) -> None:
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    dim, scale = 8, 8**-0.5
    # (cached before, new rows) per sequence; blocks handed out shuffled
    shapes = [(9, 1), (0, 1), (3, 1)] if decode_only else [(0, 7), (5, 1), (6, 3), (0, 1)]
    blocks = torch.randperm(32, generator=generator).tolist()
    cache = torch.zeros(32, BLOCK, 2, kv_heads, dim)
    tables, keys, values, queries = [], [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [blocks.pop() for _ in range(-(-total // BLOCK))]
        tables.append(table)
        k, v = (torch.randn(total, kv_heads, dim, generator=generator) for _ in range(2))
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(total)])
        store_kv(cache, k, v, slots)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(new, heads, dim, generator=generator))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    cu = torch.tensor([0, *[new for _, new in shapes]]).cumsum(0)
    context = torch.tensor([cached + new for cached, new in shapes])
    got = paged_gqa_attention(torch.cat(queries), cache, block_tables, cu, context, scale)
    expected = torch.cat(
        [
            _flat_attention(q, k, v, cached, scale)
            for q, k, v, (cached, _) in zip(queries, keys, values, shapes, strict=True)
        ]
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
