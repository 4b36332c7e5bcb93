"""Prefill attention in tiles: a chunk's query rows attend causally to their sequence's paged cache with
an online softmax over key tiles (flash attention's running max, running sum and rescaled accumulator),
never holding more than one ``[SCORE_ROWS, KEY_TILE]`` tile of scores.

The plain twins are ``mla._attend_sequence_rows`` and ``gqa._attend_sequence_rows``, which score a
chunk's rows against the whole context at once (``[M, H, L]``: gigabytes at 32k tokens). Here:

- key tiles are fixed in absolute positions (``key_tiles``: 0-63, 64-127, 128-255, ... doubling up to
  ``KEY_TILE`` positions, then ``KEY_TILE`` each) and always scored at their full width (positions past
  the context read position 0, masked as causally later), so a row meets the same key operands in the
  same order whichever chunk it arrives in: its output is bitwise the same however its prompt was split
  into chunks (tested; the whole-context twins are not: a product's reduction order depends on its
  length). The doubling keeps a short prompt's padding below its own length;
- query rows go a tile at a time (``SCORE_ROWS`` rows x heads); a query tile visits only the key tiles
  at or before its last position, and within a key tile only the rows that see some of it, from a
  multiple of ``ROW_GRANULE`` on (a row that sees none of a tile keeps its state bitwise: weight 0,
  rescale 1). Every product's row count is a multiple of ``ROW_GRANULE`` (padded with zero queries):
  BLAS computes a product's last rows short of its micro-kernel's height another way, so a row's bits
  would depend on where the chunk put it (measured with torch's CPU BLAS here: 4-row groups);
- scores, the softmax and the accumulator are fp32 whatever the cache dtype (a bf16 cache is widened as
  a tile is read; the output is rounded to the query dtype once).

MLA runs in its absorbed form (heads share the latent rows, so all ``M x H`` query rows take one
product per tile); GQA runs one product per KV head over its group's ``M x H / Hkv`` query rows.
"""

from __future__ import annotations

import torch

FIRST_KEY_TILE = 64
"""Positions of the first key tile (and of the second); each later one doubles up to ``KEY_TILE``."""
KEY_TILE = 2048
"""Positions of every key tile from position ``KEY_TILE`` on."""
ROW_GRANULE = 48
"""Every product's row count is a multiple of this (of the micro-kernel heights 4, 6, 8, 16 in use)."""
SCORE_ROWS = 171 * ROW_GRANULE
"""Query rows x heads (MLA) or x group heads (GQA) scored per product (a multiple of ``ROW_GRANULE``):
an ``[SCORE_ROWS, KEY_TILE]`` fp32 tile is 64 MB, whatever the context. Few, large products: on a CPU
shared with other work each product's thread barrier waits for descheduled threads; at 2 threads on
this project's loaded 2-core machine, tiles of 2,016 x 1,024 ran an 8k-context chunk 2-3x slower than
these (``docs/BENCHMARKS.md``, "Long context")."""


class _OnlineSoftmax:
    """Running max ``[Q]``, running sum ``[Q]`` and rescaled accumulator ``[Q, D]`` of ``Q`` query rows
    (fp32), folded one key tile at a time; ``rows`` selects the trailing rows a tile is folded into."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.running_max = torch.full((rows,), float("-inf"), device=device)
        self.running_sum = torch.zeros(rows, device=device)
        self.acc = torch.zeros(rows, width, device=device)

    def fold(self, first: int, scores: torch.Tensor, values: torch.Tensor) -> None:
        """Fold ``scores [Q - first, T]`` (fp32, masked entries -inf; overwritten) over ``values [T, D]``
        (fp32) into rows ``first:``."""
        old_max = self.running_max[first:]
        new_max = torch.maximum(old_max, scores.amax(dim=-1))
        rescale = torch.exp(old_max - new_max)
        weights = scores.sub_(new_max.unsqueeze(-1)).exp_()
        self.running_sum[first:] = self.running_sum[first:] * rescale + weights.sum(dim=-1)
        acc = self.acc[first:]
        acc.mul_(rescale.unsqueeze(-1)).addmm_(weights, values)
        self.running_max[first:] = new_max

    def result(self) -> torch.Tensor:
        """``acc / running_sum``: ``[Q, D]`` fp32."""
        return self.acc / self.running_sum.unsqueeze(-1)


def key_tiles(context_len: int) -> list[tuple[int, int]]:
    """``(start, width)`` of the key tiles covering positions ``0 .. context_len - 1`` (the last one may
    reach past the context)."""
    tiles, start = [], 0
    while start < context_len:
        width = min(max(FIRST_KEY_TILE, start), KEY_TILE)
        tiles.append((start, width))
        start += width
    return tiles


def _padded_positions(tiles: list[tuple[int, int]], context_len: int, device: torch.device) -> torch.Tensor:
    """Positions ``0 ..`` the end of the last tile, those past the context replaced by 0 (a position
    every sequence has; the causal mask hides it there)."""
    start, width = tiles[-1]
    positions = torch.arange(start + width, device=device)
    return positions.masked_fill(positions >= context_len, 0)


def _gather_rows(kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Cache rows ``[P, *cache.shape[2:]]`` at ``positions [P]`` of a sequence paged by ``block_table``."""
    block_size = kv_cache.shape[1]
    flat_index = block_table[positions // block_size] * block_size + positions % block_size
    return kv_cache.view(-1, *kv_cache.shape[2:])[flat_index]


def _attend_rows(
    queries: torch.Tensor,
    first_position: int,
    group: int,
    tiles: list[tuple[int, int]],
    keys: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """Causal online-softmax attention of flat query rows over tiles of shared keys and values.

    Args:
        queries: fp32 ``[N, K]``, already scaled; row ``i`` is at position ``first_position + i // group``.
        first_position: the first row's position.
        group: query rows per position (heads sharing these keys).
        tiles: ``key_tiles`` of the context.
        keys: ``[P, K]`` (any float dtype, widened per tile), position ``p`` at row ``p``; ``P`` covers
            every tile.
        values: ``[P, D]``, likewise.

    Returns:
        fp32 ``[N, D]``.
    """
    rows, device = queries.shape[0], queries.device
    out = torch.empty(rows, values.shape[-1], device=device)
    for q_start in range(0, rows, SCORE_ROWS):
        q_end = min(q_start + SCORE_ROWS, rows)
        padded = -(-(q_end - q_start) // ROW_GRANULE) * ROW_GRANULE
        tile_queries = queries.new_zeros(padded, queries.shape[-1])
        tile_queries[: q_end - q_start] = queries[q_start:q_end]
        # Padding rows take the tile's last position: they see what its last row sees, so stay finite.
        row_positions = first_position + (torch.arange(q_start, q_start + padded, device=device) // group)
        row_positions.clamp_(max=first_position + (q_end - 1) // group)
        first, last = first_position + q_start // group, first_position + (q_end - 1) // group
        state = _OnlineSoftmax(padded, values.shape[-1], device)
        for key_start, width in tiles:
            if key_start > last:
                break
            # the first row that sees the tile, rounded down to a granule
            seeing = max(0, (key_start - first) * group - q_start % group)
            seeing = seeing // ROW_GRANULE * ROW_GRANULE
            tile_keys = keys[key_start : key_start + width].float()
            scores = tile_queries[seeing:] @ tile_keys.T  # [padded - seeing, width]
            if key_start + width - 1 > int(row_positions[seeing]):
                later = torch.arange(key_start, key_start + width, device=device)
                scores.masked_fill_(later.unsqueeze(0) > row_positions[seeing:].unsqueeze(1), float("-inf"))
            state.fold(seeing, scores, values[key_start : key_start + width].float())
        out[q_start:q_end] = state.result()[: q_end - q_start]
    return out


def mla_sequence_rows(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Prefill: the last ``M`` positions of one sequence attend causally to its latent cache, tiled;
    the contract of ``mla._attend_sequence_rows``.

    Args:
        q_latent: ``[M, H, C]`` queries with ``w_uk`` absorbed.
        q_rope: ``[M, H, R]``.
        kv_cache: ``[num_blocks, block_size, C + R]``.
        block_table: int64 ``[max_blocks]``; entries past the context's last block are not read.
        context_len: cached tokens including these rows (``>= M``).
        scale: score multiplier.

    Returns:
        ``[M, H, C]`` softmax-weighted sums of the compressed latents, in ``q_latent.dtype``.
    """
    rows, heads, kv_rank = q_latent.shape
    tiles = key_tiles(context_len)
    latents = _gather_rows(kv_cache, block_table, _padded_positions(tiles, context_len, q_latent.device))
    queries = (torch.cat([q_latent, q_rope], dim=-1).float() * scale).view(rows * heads, -1)  # [M * H, C + R]
    out = _attend_rows(queries, context_len - rows, heads, tiles, latents, latents[:, :kv_rank])
    return out.view(rows, heads, kv_rank).to(q_latent.dtype)


def gqa_sequence_rows(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int, scale: float
) -> torch.Tensor:
    """Prefill: the last ``M`` positions of one sequence attend causally to its key/value cache, tiled;
    the contract of ``gqa._attend_sequence_rows``.

    Args:
        q: ``[M, H, D]`` queries (normed and rotated); head ``h`` reads KV head ``h // (H / Hkv)``.
        kv_cache: ``[num_blocks, block_size, 2, Hkv, D]``.
        block_table: int64 ``[max_blocks]``; entries past the context's last block are not read.
        context_len: cached tokens including these rows (``>= M``).
        scale: score multiplier.

    Returns:
        ``[M, H, D]`` in ``q.dtype``.
    """
    rows, heads, dim = q.shape
    kv_heads = kv_cache.shape[3]
    groups = heads // kv_heads
    tiles = key_tiles(context_len)
    cached = _gather_rows(kv_cache, block_table, _padded_positions(tiles, context_len, q.device))  # [P, 2, Hkv, D]
    # [Hkv, M * groups, D]: a KV head's query rows, position-major then group head.
    queries = (q.float() * scale).view(rows, kv_heads, groups, dim).transpose(0, 1).reshape(kv_heads, -1, dim)
    out = torch.stack(
        [
            _attend_rows(queries[h], context_len - rows, groups, tiles, cached[:, 0, h], cached[:, 1, h])
            for h in range(kv_heads)
        ]
    )  # [Hkv, M * groups, D]
    return out.view(kv_heads, rows, groups, dim).transpose(0, 1).reshape(rows, heads, dim).to(q.dtype)
