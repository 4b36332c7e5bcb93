"""Element-wise torch ops whose every element gets the same bits wherever it sits in its tensor.

torch's CPU kernels of transcendental element-wise ops (``sigmoid``, ``softplus``, ``silu``…) compute a
tensor's vector body and its scalar tail in different code, whose last bits differ: a row's result then
depends on how many rows come before it — a decode row alone against the same row batched (issue #30),
or a verify row against the decode row it stands for (issue #33). :func:`row_invariant` pads each row to
a multiple of :data:`VECTOR_SPAN` elements, so every element is computed in the vector body (lane by
lane, the same bits in any lane). A tensor of more than :data:`PARALLEL_GRAIN` elements is split over
threads at chunk edges that need not fall on a vector's (with 3 threads, 2-11 rows of 11008: 6 rows
differed from themselves alone), so decode rows are computed in pieces of whole rows that torch does not
split; prefill rows keep torch's threaded loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from metrale.worker.kernels.products import decode_rows

VECTOR_SPAN = 64
"""Elements per row that torch's CPU element-wise loops take in whole vectors (two AVX-512 fp32 vectors
unrolled is 32, two AVX2 bf16 ones 32; 64 covers both twice)."""

PARALLEL_GRAIN = 32768
"""torch's CPU element-wise loops run a tensor of up to this many elements on one thread
(``at::internal::GRAIN_SIZE``); a larger one is cut into one chunk per thread."""


def row_invariant(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``op(x)`` for an element-wise ``op``, ``x [N, ..., W]`` (``N`` the forward's rows): on the CPU each
    row computed at the same lanes whatever the rows around it and the thread count (``W`` padded to a
    multiple of :data:`VECTOR_SPAN`, then cut back; the leading decode rows in pieces of whole rows of at
    most :data:`PARALLEL_GRAIN` elements, or one row a piece where a row is more, as a row alone is cut)."""
    width = x.shape[-1]
    padding = -width % VECTOR_SPAN
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return op(x)
    padded = F.pad(x, (0, padding)) if padding else x
    out = _by_pieces(op, padded)
    return out[..., :width] if padding else out


def _by_pieces(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2 or x.numel() <= PARALLEL_GRAIN:
        return op(x)
    rows = x.shape[0]
    decode = decode_rows(rows)
    per_piece = max(1, PARALLEL_GRAIN // (x.numel() // rows)) if rows else 1
    parts = [op(x[start : min(start + per_piece, decode)]) for start in range(0, decode, per_piece)]
    if decode < rows:
        parts.append(op(x[decode:]))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
