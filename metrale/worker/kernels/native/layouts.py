"""The tensor layouts the C kernels read, checked without loading them: shared by the ctypes entry points
(``native.kda``, ``native.gdn``, ``native.mla``, ``native.gqa``, which also need the library built) and the
compiled graph's C++ ops (``native.graph_ops``, whose check that the library built is made once, before
Dynamo traces)."""

from __future__ import annotations

import torch

PAGED_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def state_pool_fits(state_pool: torch.Tensor) -> bool:
    """A recurrent state pool the kernels update in place: CPU, fp32, contiguous."""
    return state_pool.device.type == "cpu" and state_pool.dtype == torch.float32 and state_pool.is_contiguous()


def paged_cache_fits(kv_cache: torch.Tensor, block_tables: torch.Tensor) -> bool:
    """A paged cache the attention kernels read in place: CPU, fp32 or bf16, contiguous; int64 block
    tables with unit-stride rows."""
    return (
        kv_cache.device.type == "cpu"
        and kv_cache.dtype in PAGED_CACHE_DTYPES
        and kv_cache.is_contiguous()
        and block_tables.dtype == torch.int64
        and block_tables.stride(-1) == 1
    )
