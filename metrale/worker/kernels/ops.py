"""The kernels the model calls, each dispatched per call to its Triton twin or its torch reference.

The process-wide backend (``set_kernel_backend``; a worker sets it from ``MET_KERNELS``) decides:

- ``torch``: the torch references everywhere.
- ``native``: the C kernels (``kernels/native``, compiled on first use) for the CPU calls that have
  one — the KDA and Gated DeltaNet recurrences and the short conv, decode and prefill; the decode rows
  of MLA and GQA attention — and the torch references for the rest.
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
from metrale.worker.kernels import conv, gqa, graph_ops, mla, norm, tiled_prefill
from metrale.worker.kernels.gdn import chunked as gdn_chunked
from metrale.worker.kernels.gdn import decode as gdn_decode_reference
from metrale.worker.kernels.kda import chunked, decode
from metrale.worker.kernels.native import conv as native_conv
from metrale.worker.kernels.native import gdn as native_gdn
from metrale.worker.kernels.native import gqa as native_gqa
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


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One Gated DeltaNet token per sequence, states updated in place: ``kernels.gdn.decode.gdn_decode``
    (q, k ``[B, Hk, K]`` L2-normalised by the caller, v ``[B, Hv, V]``, log_decay and beta ``[B, Hv]``,
    states fp32 ``[P, Hv, K, V]``; returns fp32 ``[B, Hv, V]``). While ``torch.compile`` traces, the
    custom op ``graph_ops.gdn_decode`` (no C++ twin yet: the op calls back into this dispatcher)."""
    args = (q, k, v, log_decay, beta, states, slots, scale)
    if torch.compiler.is_compiling():
        return graph_ops.gdn_decode(*args)
    if uses_triton(q):
        from metrale.worker.kernels.triton import gdn_decode as triton_decode

        return triton_decode.gdn_decode(*args)
    if uses_native() and native_gdn.supports(states, slots):
        return native_gdn.gdn_decode(*args)
    return gdn_decode_reference.gdn_decode(*args)


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Varlen Gated DeltaNet over pooled states: ``kernels.gdn.chunked.gdn_chunked_prefill``.

    ``chunk_size`` None takes the chosen implementation's own default; the C kernel on the CPU runs the
    recurrence token by token (no chunks), so a chunk size given asks for the chunked torch form.
    """
    args = (q, k, v, log_decay, beta, cu_seqlens, states, slots, has_initial_state, scale)
    if uses_triton(q):
        from metrale.worker.kernels.triton import gdn_chunked as triton_chunked

        return triton_chunked.gdn_chunked_prefill(
            *args, chunk_size=triton_chunked.DEFAULT_CHUNK if chunk_size is None else chunk_size
        )
    if chunk_size is not None:
        return gdn_chunked.gdn_chunked_prefill(*args, chunk_size=chunk_size)
    if uses_native() and native_gdn.supports(states, slots):
        return native_gdn.gdn_prefill(*args)
    return gdn_chunked.gdn_chunked_prefill(*args)


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
    batch, and a lone row's attention in latent space, through the C kernel, ``kernels.native.mla``,
    where it runs). While ``torch.compile`` traces (decode steps only: one row per sequence),
    ``kernels.mla.paged_mla_decode``, in static shapes: its attention through the C kernel's graph op
    where the C++ ops loaded (``metrale_native::mla_decode_latent``), else in torch."""
    if torch.compiler.is_compiling():
        decode_args = (q_nope, q_rope, kv_cache, block_tables, context_lens, w_uk, w_uv, scale)
        if _native_graph_ops() and native_graph_ops.supports_mla(kv_cache, block_tables):
            return mla.paged_mla_decode(*decode_args, torch.ops.metrale_native.mla_decode_latent)
        return mla.paged_mla_decode(*decode_args)
    args = (q_nope, q_rope, kv_cache, block_tables, cu_seqlens, context_lens, w_uk, w_uv, scale)
    if uses_triton(q_nope):
        from metrale.worker.kernels.triton import mla as triton_mla

        return triton_mla.paged_mla_attention(*args)
    native = uses_native() and native_mla.supports(kv_cache, block_tables)
    if q_nope.shape[0] == 1 and _backend is not KernelBackend.TORCH:  # one stream's decode step
        return mla.paged_mla_attention_one_row(*args, native_mla.attend_single_rows if native else None)
    if native:
        return mla.paged_mla_attention(
            *args, attend_single_rows=native_mla.attend_single_rows, attend_sequence_rows=_mla_sequence_rows()
        )
    return mla.paged_mla_attention(*args, attend_sequence_rows=_mla_sequence_rows())


def _mla_sequence_rows() -> mla.SequenceRowsAttention | None:
    """The prefill chunks' attention off Triton: the tiled one (``kernels.tiled_prefill``) under every
    backend but ``torch``, which keeps the reference."""
    return None if _backend is KernelBackend.TORCH else tiled_prefill.mla_sequence_rows


def store_kv(kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write keys and values into the paged cache in place: ``kernels.gqa.store_kv``."""
    if uses_triton(kv_cache):
        from metrale.worker.kernels.triton import gqa as triton_gqa

        triton_gqa.store_kv(kv_cache, keys, values, slot_mapping)
    else:
        gqa.store_kv(kv_cache, keys, values, slot_mapping)


def paged_gqa_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal grouped-query attention over the paged cache: ``kernels.gqa.paged_gqa_attention`` (Triton:
    every row; on the CPU, the one-row sequences of a batch through the C kernel, ``kernels.native.gqa``,
    where it runs; prefill chunks tiled, ``kernels.tiled_prefill``). No graph-traced form: the compiled
    decode step runs Kimi Linear only."""
    args = (q, kv_cache, block_tables, cu_seqlens, context_lens, scale)
    if uses_triton(q):
        from metrale.worker.kernels.triton import gqa as triton_gqa

        return triton_gqa.paged_gqa_attention(*args)
    if uses_native() and native_gqa.supports(kv_cache, block_tables):
        return gqa.paged_gqa_attention(
            *args, single_rows=native_gqa.attend_single_rows, sequence_rows=_gqa_sequence_rows()
        )
    return gqa.paged_gqa_attention(*args, sequence_rows=_gqa_sequence_rows())


def _gqa_sequence_rows() -> gqa.SequenceRowsAttention | None:
    """The prefill chunks' attention off Triton: the tiled one (``kernels.tiled_prefill``) under every
    backend but ``torch``, which keeps the reference."""
    return None if _backend is KernelBackend.TORCH else tiled_prefill.gqa_sequence_rows


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
