"""The stateful kernels as torch custom ops, so a compiled decode forward (``model.decode_graph``) calls
each as one opaque node instead of breaking its graph at every layer.

Each op runs the eager dispatcher of ``kernels.ops`` (the C kernels on the CPU, Triton on CUDA, else the
torch references), declares the state it writes (``mutates_args``) and has a fake implementation giving
the output's shape, so ``torch.compile`` traces through it.

Padding rows. A compiled graph has a fixed batch size (its bucket); the rows past the real batch are
padding: their ``slots`` and ``slot_mapping`` are ``PAD_SLOT`` (-1), their ``context_lens`` 0. Padding
rows are always the last ones. Each op runs its kernel on the real rows only — no state of a sequence
outside the batch is read or written — and returns zeros for the padding rows.

``kernels.ops`` sends its calls here while ``torch.compile`` traces; the ops call back into it at run time
(imported there, when the op runs, as ``ops`` imports this module).
"""

from __future__ import annotations

import torch

PAD_SLOT = -1
"""The slot id (and latent cache index) of a padding row: no state belongs to it."""


def _real_rows(slots: torch.Tensor) -> int:
    """How many leading rows of ``slots`` ``[B]`` are real (the rest are ``PAD_SLOT``)."""
    if int(slots[-1]) != PAD_SLOT:  # no padding: the common case costs one read
        return slots.shape[0]
    return int((slots != PAD_SLOT).sum())


def _padded(rows: torch.Tensor, total: int) -> torch.Tensor:
    """``rows`` ``[n, ...]`` followed by zero rows up to ``total``."""
    if rows.shape[0] == total:
        return rows
    out = rows.new_zeros(total, *rows.shape[1:])
    out[: rows.shape[0]] = rows
    return out


@torch.library.custom_op("metrale::kda_decode", mutates_args=("state_pool",))
def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``kernels.ops.kda_decode`` over the real rows: ``o [B, H, V]``, ``state_pool[slots]`` advanced."""
    from metrale.worker.kernels import ops

    n = _real_rows(slots)
    if n == slots.shape[0]:
        return ops.kda_decode(q, k, v, g, beta, state_pool, slots, scale)
    out = ops.kda_decode(q[:n], k[:n], v[:n], g[:n], beta[:n], state_pool, slots[:n], scale)
    return _padded(out, slots.shape[0])


@kda_decode.register_fake
def _kda_decode_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


@torch.library.custom_op("metrale::causal_conv1d_update", mutates_args=("conv_states",))
def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """``kernels.ops.causal_conv1d_update`` over the real rows: ``[B, D]``, ``conv_states[slots]`` shifted."""
    from metrale.worker.kernels import ops

    n = _real_rows(slots)
    if n == slots.shape[0]:
        return ops.causal_conv1d_update(x, weight, conv_states, slots)
    return _padded(ops.causal_conv1d_update(x[:n], weight, conv_states, slots[:n]), slots.shape[0])


@causal_conv1d_update.register_fake
def _conv_update_shape(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("metrale::store_latents", mutates_args=("kv_cache",))
def store_latents(kv_cache: torch.Tensor, latents: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``kernels.ops.store_latents`` for the real rows (``slot_mapping`` not ``PAD_SLOT``)."""
    from metrale.worker.kernels import ops

    n = _real_rows(slot_mapping)
    ops.store_latents(kv_cache, latents[:n], slot_mapping[:n])


@store_latents.register_fake
def _store_latents_shape(kv_cache: torch.Tensor, latents: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    return None
