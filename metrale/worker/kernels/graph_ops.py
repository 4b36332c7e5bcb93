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

The ops are declared by schema through ``torch.library.Library`` rather than ``torch.library.custom_op``:
a compiled step calls them once per stateful layer, and ``custom_op``'s Python layer (its autograd and
mutation bookkeeping) cost more per call than a one-row kernel itself (~35 µs against ~7 µs for the
conv on a 2-vCPU AVX2 machine; docs/BENCHMARKS.md, session 9). The schemas state what each op writes
(``Tensor(a!)``), as ``mutates_args`` would.

Where the C kernels run, a graph calls their C++ twins instead (``kernels.native.graph_ops``,
``torch.ops.metrale_native``: the same schemas, padding rules and bits, without the hop into Python);
these Python ops remain for the torch references, Triton, and machines without a C++ compiler.
"""

from __future__ import annotations

import torch

PAD_SLOT = -1
"""The slot id (and latent cache index) of a padding row: no state belongs to it."""

_LIBRARY = torch.library.Library("metrale", "DEF")
_LIBRARY.define(
    "kda_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state_pool, Tensor slots, "
    "float scale) -> Tensor"
)
_LIBRARY.define(
    "gdn_decode(Tensor q, Tensor k, Tensor v, Tensor log_decay, Tensor beta, Tensor(a!) states, Tensor slots, "
    "float scale) -> Tensor"
)
_LIBRARY.define("causal_conv1d_update(Tensor x, Tensor weight, Tensor(a!) conv_states, Tensor slots) -> Tensor")
_LIBRARY.define("store_latents(Tensor(a!) kv_cache, Tensor latents, Tensor slot_mapping) -> ()")


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


def _kda_decode(
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


def _gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``kernels.ops.gdn_decode`` over the real rows: fp32 ``o [B, Hv, V]``, ``states[slots]`` advanced."""
    from metrale.worker.kernels import ops

    n = _real_rows(slots)
    if n == slots.shape[0]:
        return ops.gdn_decode(q, k, v, log_decay, beta, states, slots, scale)
    out = ops.gdn_decode(q[:n], k[:n], v[:n], log_decay[:n], beta[:n], states, slots[:n], scale)
    return _padded(out, slots.shape[0])


def _gdn_decode_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return v.new_empty(v.shape, dtype=torch.float32)


def _causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """``kernels.ops.causal_conv1d_update`` over the real rows: ``[B, D]``, ``conv_states[slots]`` shifted."""
    from metrale.worker.kernels import ops

    n = _real_rows(slots)
    if n == slots.shape[0]:
        return ops.causal_conv1d_update(x, weight, conv_states, slots)
    return _padded(ops.causal_conv1d_update(x[:n], weight, conv_states, slots[:n]), slots.shape[0])


def _conv_update_shape(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape)


def _store_latents(kv_cache: torch.Tensor, latents: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``kernels.ops.store_latents`` for the real rows (``slot_mapping`` not ``PAD_SLOT``)."""
    from metrale.worker.kernels import ops

    n = _real_rows(slot_mapping)
    ops.store_latents(kv_cache, latents[:n], slot_mapping[:n])


def _store_latents_shape(kv_cache: torch.Tensor, latents: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    return None


for _name, _kernel, _shape in (
    ("kda_decode", _kda_decode, _kda_decode_shape),
    ("gdn_decode", _gdn_decode, _gdn_decode_shape),
    ("causal_conv1d_update", _causal_conv1d_update, _conv_update_shape),
    ("store_latents", _store_latents, _store_latents_shape),
):
    _LIBRARY.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"metrale::{_name}", _shape, lib=_LIBRARY)

kda_decode = torch.ops.metrale.kda_decode
gdn_decode = torch.ops.metrale.gdn_decode
causal_conv1d_update = torch.ops.metrale.causal_conv1d_update
store_latents = torch.ops.metrale.store_latents
