"""The kernels the model calls, each dispatched per call to its Triton twin or its torch reference.

The process-wide backend (``set_kernel_backend``; a worker sets it from ``MET_KERNELS``) decides:

- ``torch``: the torch references everywhere.
- ``native``: the C kernels (``kernels/native``, compiled on first use) for the CPU calls that have
  one — the KDA recurrence and the short conv, decode and prefill — and the torch references for the rest.
- ``auto`` (the default): Triton iff the call's first tensor is on a CUDA device and Triton is
  installed; on the CPU, as ``native`` when a C compiler built the kernels, else ``torch``.
- ``triton``: Triton everywhere. On CPU tensors that runs Triton's interpreter, which needs
  ``TRITON_INTERPRET=1`` in the environment before the kernels are imported (tests do this); without
  it, or without Triton installed, the call raises ``TritonUnavailableError``.

Triton is imported only when a Triton kernel is about to run, so every torch path works without it.
Each function has the contract of the reference named in its docstring.
"""

from __future__ import annotations

import importlib.util

import torch

from metrale.shared.settings import KernelBackend
from metrale.worker.kernels import conv, graph_ops, mla, norm
from metrale.worker.kernels.kda import chunked, decode
from metrale.worker.kernels.native import conv as native_conv
from metrale.worker.kernels.native import graph_ops as native_graph_ops
from metrale.worker.kernels.native import kda as native_kda
from metrale.worker.kernels.native import mla as native_mla
from metrale.worker.kernels.native import norm as native_norm
from metrale.worker.kernels.triton import TritonUnavailableError

_backend = KernelBackend.AUTO


def set_kernel_backend(backend: KernelBackend) -> None:
    """Choose the kernels every later call in this process runs (see the module docstring)."""
    global _backend
    _backend = KernelBackend(backend)


def kernel_backend() -> KernelBackend:
    """The backend set by ``set_kernel_backend`` (``auto`` until then)."""
    return _backend


def uses_triton(tensor: torch.Tensor) -> bool:
    """Whether a kernel called on ``tensor`` runs Triton under the current backend.

    Raises:
        TritonUnavailableError: the backend is ``triton`` but the triton package is not installed.
    """
    if _backend in (KernelBackend.TORCH, KernelBackend.NATIVE):
        return False
    if _backend is KernelBackend.AUTO:
        return tensor.is_cuda and _triton_installed()
    if not _triton_installed():
        raise TritonUnavailableError("the kernel backend is 'triton', but the triton package is not installed")
    return True


def uses_native() -> bool:
    """Whether a CPU call that has a C kernel runs it under the current backend (if the kernel supports it)."""
    return _backend in (KernelBackend.NATIVE, KernelBackend.AUTO)


def _native_graph_ops() -> bool:
    """Whether a graph being traced calls the C kernels as C++ ops (``kernels.native.graph_ops``)."""
    return uses_native() and native_graph_ops.loaded


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


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
    """One KDA token per sequence, states updated in place: ``kernels.kda.decode.kda_decode``."""
    if torch.compiler.is_compiling():
        if _native_graph_ops() and native_graph_ops.supports_kda(state_pool):
            return torch.ops.metrale_native.kda_decode(q, k, v, g, beta, state_pool, slots, scale)
        return graph_ops.kda_decode(q, k, v, g, beta, state_pool, slots, scale)
    if uses_triton(q):
        from metrale.worker.kernels.triton import kda_decode as triton_decode

        return triton_decode.kda_decode(q, k, v, g, beta, state_pool, slots, scale)
    if uses_native() and native_kda.supports(state_pool, slots):
        return native_kda.kda_decode(q, k, v, g, beta, state_pool, slots, scale)
    return decode.kda_decode(q, k, v, g, beta, state_pool, slots, scale)


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Varlen KDA over pooled states: ``kernels.kda.chunked.kda_chunked_prefill``.

    ``chunk_size`` None takes the chosen implementation's own default; the C kernel on the CPU runs the
    recurrence token by token (no chunks), so a chunk size given asks for the chunked torch form.
    """
    args = (q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial_state, scale)
    if uses_triton(q):
        from metrale.worker.kernels.triton import kda_chunked as triton_chunked

        return triton_chunked.kda_chunked_prefill(
            *args, chunk_size=triton_chunked.DEFAULT_CHUNK if chunk_size is None else chunk_size
        )
    if chunk_size is not None:
        return chunked.kda_chunked_prefill(*args, chunk_size=chunk_size)
    if uses_native() and native_kda.supports(state_pool, slots):
        return native_kda.kda_prefill(*args)
    return chunked.kda_chunked_prefill(*args)


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One short-conv step per sequence, states shifted in place: ``kernels.conv.causal_conv1d_update``."""
    if torch.compiler.is_compiling():
        if _native_graph_ops() and native_graph_ops.supports_conv(x, weight, conv_states):
            return torch.ops.metrale_native.causal_conv1d_update(x, weight, conv_states, slots)
        return graph_ops.causal_conv1d_update(x, weight, conv_states, slots)
    if uses_triton(x):
        from metrale.worker.kernels.triton import conv as triton_conv

        return triton_conv.causal_conv1d_update(x, weight, conv_states, slots)
    if uses_native() and native_conv.supports(x, weight, conv_states):
        return native_conv.causal_conv1d_update(x, weight, conv_states, slots)
    return conv.causal_conv1d_update(x, weight, conv_states, slots)


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Varlen short conv over pooled states: ``kernels.conv.causal_conv1d_prefill``."""
    if uses_triton(x):
        from metrale.worker.kernels.triton import conv as triton_conv

        return triton_conv.causal_conv1d_prefill(x, weight, cu_seqlens, conv_states, slots, has_initial_state)
    if uses_native() and native_conv.supports(x, weight, conv_states):
        return native_conv.causal_conv1d_prefill(x, weight, cu_seqlens, conv_states, slots, has_initial_state)
    return conv.causal_conv1d_prefill(x, weight, cu_seqlens, conv_states, slots, has_initial_state)


def store_latents(kv_cache: torch.Tensor, latents: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write latents into the paged cache in place: ``kernels.mla.store_latents``."""
    if torch.compiler.is_compiling():
        if _native_graph_ops() and native_graph_ops.supports_store(kv_cache):
            torch.ops.metrale_native.store_latents(kv_cache, latents, slot_mapping)
        else:
            graph_ops.store_latents(kv_cache, latents, slot_mapping)
        return
    if uses_triton(kv_cache):
        from metrale.worker.kernels.triton import mla as triton_mla

        triton_mla.store_latents(kv_cache, latents, slot_mapping)
    else:
        mla.store_latents(kv_cache, latents, slot_mapping)


def paged_mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal absorbed MLA over the paged cache: ``kernels.mla.paged_mla_attention`` (one row on the CPU
    or CUDA without Triton: ``kernels.mla.paged_mla_attention_one_row``; the one-row sequences of a CPU
    batch through the C kernel, ``kernels.native.mla``, where it runs). While ``torch.compile`` traces
    (decode steps only: one row per sequence), ``kernels.mla.paged_mla_decode``, in static shapes."""
    if torch.compiler.is_compiling():
        return mla.paged_mla_decode(q_nope, q_rope, kv_cache, block_tables, context_lens, w_uk, w_uv, scale)
    args = (q_nope, q_rope, kv_cache, block_tables, cu_seqlens, context_lens, w_uk, w_uv, scale)
    if uses_triton(q_nope):
        from metrale.worker.kernels.triton import mla as triton_mla

        return triton_mla.paged_mla_attention(*args)
    if q_nope.shape[0] == 1 and _backend is not KernelBackend.TORCH:  # one stream's decode step
        return mla.paged_mla_attention_one_row(*args)
    if uses_native() and native_mla.supports(kv_cache, block_tables):
        return mla.paged_mla_attention(*args, attend_single_rows=native_mla.attend_single_rows)
    return mla.paged_mla_attention(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of the last dimension: ``kernels.norm.rms_norm`` (on the CPU its fused twin,
    ``kernels.norm.fused_rms_norm``)."""
    if uses_triton(x):
        from metrale.worker.kernels.triton import norm as triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    if _cpu_fast_path(x):
        if not torch.compiler.is_compiling() and native_norm.supports(x, weight):
            return native_norm.rms_norm(x, weight, eps)
        return norm.fused_rms_norm(x, weight, eps)
    return norm.rms_norm(x, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm with a sigmoid output gate: ``kernels.norm.gated_rms_norm`` (on the CPU its fused twin,
    ``kernels.norm.fused_gated_rms_norm``)."""
    if uses_triton(x):
        from metrale.worker.kernels.triton import norm as triton_norm

        return triton_norm.gated_rms_norm(x, gate, weight, eps)
    if _cpu_fast_path(x):
        if not torch.compiler.is_compiling() and native_norm.supports(x, weight, gate):
            return native_norm.gated_rms_norm(x, gate, weight, eps)
        return norm.fused_gated_rms_norm(x, gate, weight, eps)
    return norm.gated_rms_norm(x, gate, weight, eps)


def _cpu_fast_path(x: torch.Tensor) -> bool:
    """Whether a CPU call takes a C kernel or a reference's fast torch twin (every backend but ``torch``;
    the norms' C kernels only eagerly: a graph being traced keeps torch's norms, which inductor fuses)."""
    return _backend is not KernelBackend.TORCH and x.device.type == "cpu"
