"""Kimi's sigmoid router over decode rows in one C call (``router.c``).

Contract: ``layers.mlp.MoE.route`` (the plain twin): the same scores and choice, bit for bit but for ties
(the lower expert id wins here); the ids come out ascending, and the renormalizing sum is taken in that
order (the twin's bits for ``top_k <= 2``, to rounding beyond). A row's result depends on that row alone.
"""

from __future__ import annotations

import torch

from metrale.worker.kernels.native.library import native_library


def supports(x: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """Whether the C router runs this call: CPU, an fp32 or bf16 router weight, built library."""
    return (
        x.device.type == "cpu"
        and router_weight.device.type == "cpu"
        and router_weight.dtype in (torch.float32, torch.bfloat16)
        and native_library() is not None
    )


def sigmoid_route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    num_groups: int,
    topk_group: int,
    top_k: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, D]``, ``router_weight [E, D]``, ``bias [E]`` -> (ids int64 ``[M, top_k]`` ascending, weights
    fp32 ``[M, top_k]``): the ``E`` experts in ``num_groups`` groups, the ``topk_group`` best kept, ``top_k``
    experts a row, their weights renormalized (``renormalize``) and times ``scaling``."""
    rows = x.detach().float().contiguous()
    # Held in names: a temporary's memory would be freed before the call reads it.
    weight, bias = router_weight.contiguous(), bias.float().contiguous()
    count, experts = rows.shape[0], router_weight.shape[0]
    ids = torch.empty(count, top_k, dtype=torch.int64)
    weights = torch.empty(count, top_k, dtype=torch.float32)
    library = native_library()
    assert library is not None, "call supports() first"
    status = library.met_sigmoid_route(
        rows.data_ptr(),
        count,
        rows.shape[1],
        weight.data_ptr(),
        weight.dtype is torch.bfloat16,
        bias.data_ptr(),
        experts,
        num_groups,
        topk_group,
        top_k,
        renormalize,
        scaling,
        ids.data_ptr(),
        weights.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the C router could not allocate its scratch rows")
    return ids, weights
