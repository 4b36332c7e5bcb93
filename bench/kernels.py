"""Recurrence and attention kernels on a GPU: Triton vs torch reference vs fla. KDA at Kimi-Linear-48B
layer shapes (H=32, K=V=128), Gated DeltaNet at Qwen3.5 / Qwen3-Next ones (``--recurrence gdn``: 32
value heads over 16 key heads, K=V=128), or the paged GQA attention of their full-attention layers
(``--attention gqa``: 16 query heads over 4 KV heads, head_dim 256, by default).

    python bench/kernels.py [--recurrence kda|gdn | --attention gqa] [--batches 1 8 32 128 256]
                            [--prefill-batches 1 4 16] [--prefill-len 1024] [--context-len 2048]
                            [--heads 32] [--key-heads 16] [--head-dim 128] [--peak-gbps 4800]
                            [--device cuda|cpu]

``--device cpu`` runs the Triton kernels through Triton's interpreter (``TRITON_INTERPRET=1`` must be
set) with wall-clock timing: a check that the script works on a machine without a GPU, not a
measurement; use tiny shapes.

Decode: B sequences advance one token each, their states scattered over a pool of 2B slots (every
other slot, so the gather is real) and updated in place. Prefill: S sequences of L tokens in one
varlen batch, half of them continuing a pooled state. Inputs are bf16 (log-decays fp32, states fp32),
as the model feeds them.

GQA attention (``--attention gqa``; ``--key-heads`` are the KV heads): decode, B sequences of
``--context-len`` cached tokens attend with one new row each; prefill, S sequences of ``--prefill-len``
new tokens attend causally over themselves. The cache is paged (blocks of 16 handed out shuffled), bf16
on a GPU and fp32 under the interpreter (whose bf16 ``tl.dot`` is wrong); its bytes are the keys and
values read once, plus queries and outputs. No fla column: fla has no paged attention.

Each row reports the median time, the bandwidth achieved over the bytes the kernel must move (inputs,
outputs, and each touched state read and written once) against the device's peak, the speed-up over
the torch reference and over fla's ``fused_recurrent_kda`` / ``chunk_kda`` (GDN:
``fused_recurrent_gated_delta_rule`` / ``chunk_gated_delta_rule``, fed q and k repeated per value head)
when fla is importable (fla is timed on pre-gathered states: it has no pool), and the largest output
difference from the torch reference. Exits with a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from metrale.worker.kernels.gdn import chunked as gdn_chunked
from metrale.worker.kernels.gdn import decode as gdn_decode
from metrale.worker.kernels.kda import chunked, decode

HBM_PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "A100-SXM4-80GB": 2039.0}
"""Fallback peaks (GB/s) by device-name fragment, for torch builds that do not report memory clocks."""


@dataclass(frozen=True)
class Shape:
    """A layer's recurrence: which one, its value heads (KDA: its heads), key heads, head size, device."""

    recurrence: str  # "kda" or "gdn"
    heads: int
    key_heads: int
    dim: int
    device: str


@dataclass(frozen=True)
class KdaBatch:
    """One batch of recurrence inputs. KDA: q, k, g ``[N, H, K]``, v ``[N, H, V]``, beta ``[N, H]``.
    Gated DeltaNet: q, k ``[N, Hk, K]`` (L2-normalised), v ``[N, Hv, V]``, g, beta ``[N, Hv]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def random(cls, rows: int, shape: Shape, seed: int) -> KdaBatch:
        generator = torch.Generator(device=shape.device).manual_seed(seed)

        def normal(*dims: int) -> torch.Tensor:
            return torch.randn(*dims, generator=generator, device=shape.device)

        heads, dim = shape.heads, shape.dim
        beta = torch.sigmoid(normal(rows, heads)).bfloat16()
        v = normal(rows, heads, dim).bfloat16()
        if shape.recurrence == "gdn":
            q, k = (F.normalize(normal(rows, shape.key_heads, dim), dim=-1).bfloat16() for _ in range(2))
            return cls(q, k, v, -F.softplus(normal(rows, heads)), beta)
        g = F.logsigmoid(2.0 * normal(rows, heads, dim) + 2.0)
        q, k = (normal(rows, heads, dim).bfloat16() for _ in range(2))
        return cls(q, k, v, g, beta)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.k, self.v, self.g, self.beta

    def fla_tensors(self) -> tuple[torch.Tensor, ...]:
        """The inputs as fla takes them: q and k one per value head."""
        repeat = self.v.shape[1] // self.q.shape[1]
        q, k = (x.repeat_interleave(repeat, dim=1) for x in (self.q, self.k))
        return q, k, self.v, self.g, self.beta

    def nbytes(self) -> int:
        """Bytes of the inputs plus the ``[N, H, V]`` output in the input dtype."""
        return sum(t.numel() * t.element_size() for t in self.tensors()) + self.v.numel() * self.v.element_size()


@dataclass
class Row:
    """One benchmark line: milliseconds per call of each implementation, bytes moved, output error."""

    label: str
    triton_ms: float
    torch_ms: float
    fla_ms: float | None
    nbytes: int
    max_error: float

    def markdown(self, peak_gbps: float | None) -> str:
        achieved = self.nbytes / self.triton_ms / 1e6
        of_peak = f"{100 * achieved / peak_gbps:.0f}%" if peak_gbps else "?"
        fla = f"{self.fla_ms / self.triton_ms:.2f}" if self.fla_ms is not None else "-"
        return (
            f"| {self.label} | {self.triton_ms * 1e3:,.1f} | {achieved:,.0f} | {of_peak} "
            f"| {self.torch_ms / self.triton_ms:.1f} | {fla} | {self.max_error:.1e} |"
        )


def time_ms(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds of ``fn`` on the GPU (Triton's ``do_bench``: warm-up, L2 flushed); on the CPU
    (``--device cpu``), the median of three wall-clock calls after one."""
    if device == "cpu":
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def peak_bandwidth_gbps(override: float | None, device: str) -> float | None:
    """The device's peak memory bandwidth: ``override``, else from its memory clock, else by name."""
    if override or device == "cpu":
        return override
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    return next((peak for fragment, peak in HBM_PEAK_GBPS.items() if fragment in props.name), None)


def load_fla(recurrence: str) -> dict[str, Any]:
    """fla's entry points for ``recurrence`` by name, empty when fla is not installed."""
    try:
        if recurrence == "gdn":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

            return {"decode": fused_recurrent_gated_delta_rule, "prefill": chunk_gated_delta_rule}
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except ImportError:
        return {}
    return {"decode": fused_recurrent_kda, "prefill": chunk_kda}


def decode_kernels(recurrence: str) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``(Triton, torch reference)`` decode steps of ``recurrence``."""
    if recurrence == "gdn":
        from metrale.worker.kernels.triton import gdn_decode as triton_gdn_decode

        return triton_gdn_decode.gdn_decode, gdn_decode.gdn_decode
    from metrale.worker.kernels.triton import kda_decode as triton_decode

    return triton_decode.kda_decode, decode.kda_decode


def prefill_kernels(recurrence: str) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``(Triton, torch reference)`` varlen prefills of ``recurrence``."""
    if recurrence == "gdn":
        from metrale.worker.kernels.triton import gdn_chunked as triton_gdn_chunked

        return triton_gdn_chunked.gdn_chunked_prefill, gdn_chunked.gdn_chunked_prefill
    from metrale.worker.kernels.triton import kda_chunked as triton_chunked

    return triton_chunked.kda_chunked_prefill, chunked.kda_chunked_prefill


def bench_decode(batch: int, shape: Shape, fla: dict[str, Any]) -> Row:
    triton_kernel, torch_kernel = decode_kernels(shape.recurrence)
    heads, dim = shape.heads, shape.dim
    inputs = KdaBatch.random(batch, shape, seed=batch)
    pool = 0.1 * torch.randn(2 * batch, heads, dim, dim, device=shape.device)
    slots = torch.arange(0, 2 * batch, 2, device=shape.device)
    scale = dim**-0.5

    def run_triton() -> torch.Tensor:
        return triton_kernel(*inputs.tensors(), pool, slots, scale)

    def run_torch() -> torch.Tensor:
        return torch_kernel(*inputs.tensors(), pool, slots, scale)

    snapshot = pool.clone()
    o_triton = run_triton()
    pool.copy_(snapshot)  # the reference advances the same states
    max_error = (o_triton.float() - run_torch().float()).abs().max().item()
    fla_ms = None
    normalizes = shape.recurrence == "kda"  # our GDN kernels take q and k normalised: so is fla fed
    if "decode" in fla:
        states = pool[slots].clone()
        as_sequences = [t.unsqueeze(1) for t in inputs.fla_tensors()]  # [B, T=1, H, *]
        fla_ms = time_ms(
            lambda: fla["decode"](
                *as_sequences,
                scale=scale,
                initial_state=states,
                output_final_state=True,
                use_qk_l2norm_in_kernel=normalizes,
            ),
            shape.device,
        )
    state_bytes = 2 * batch * heads * dim * dim * 4
    return Row(
        f"decode B={batch}",
        time_ms(run_triton, shape.device),
        time_ms(run_torch, shape.device),
        fla_ms,
        inputs.nbytes() + state_bytes,
        max_error,
    )


def bench_prefill(num_seqs: int, length: int, shape: Shape, fla: dict[str, Any]) -> Row:
    triton_kernel, torch_kernel = prefill_kernels(shape.recurrence)
    heads, dim = shape.heads, shape.dim
    inputs = KdaBatch.random(num_seqs * length, shape, seed=num_seqs)
    cu_seqlens = torch.arange(0, num_seqs * length + 1, length, device=shape.device)
    pool = 0.1 * torch.randn(num_seqs, heads, dim, dim, device=shape.device)
    slots = torch.arange(num_seqs, device=shape.device)
    carried = slots % 2 == 1
    scale = dim**-0.5
    snapshot = pool.clone()

    def run(kernel: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            pool.copy_(snapshot)  # every call starts from the same states (one extra state copy, timed)
            return kernel(*inputs.tensors(), cu_seqlens, pool, slots, carried, scale)

        return call

    run_triton, run_torch = run(triton_kernel), run(torch_kernel)
    max_error = (run_triton().float() - run_torch().float()).abs().max().item()
    fla_ms = None
    normalizes = shape.recurrence == "kda"
    if "prefill" in fla:
        as_batch = [t.unsqueeze(0) for t in inputs.fla_tensors()]  # [1, N, H, *]
        fla_ms = time_ms(
            lambda: fla["prefill"](
                *as_batch,
                scale=scale,
                initial_state=snapshot,
                output_final_state=True,
                use_qk_l2norm_in_kernel=normalizes,
                cu_seqlens=cu_seqlens,
            ),
            shape.device,
        )
    state_bytes = 2 * num_seqs * heads * dim * dim * 4
    return Row(
        f"prefill S={num_seqs} L={length}",
        time_ms(run_triton, shape.device),
        time_ms(run_torch, shape.device),
        fla_ms,
        inputs.nbytes() + state_bytes,
        max_error,
    )


@dataclass(frozen=True)
class AttentionShape:
    """A full-attention layer: query heads, key/value heads, head size, device."""

    heads: int
    kv_heads: int
    dim: int
    device: str

    @property
    def dtype(self) -> torch.dtype:
        """bf16 as the model runs; fp32 under Triton's interpreter, whose bf16 ``tl.dot`` is wrong."""
        return torch.float32 if self.device == "cpu" else torch.bfloat16


CACHE_BLOCK = 16


def paged_kv(lengths: list[int], shape: AttentionShape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_cache [blocks, 16, 2, Hkv, D], block_tables [S, W])``: random keys and values of sequences of
    ``lengths`` tokens, their blocks handed out shuffled."""
    generator = torch.Generator(device=shape.device).manual_seed(seed)
    needed = [-(-n // CACHE_BLOCK) for n in lengths]
    cache = torch.randn(
        sum(needed), CACHE_BLOCK, 2, shape.kv_heads, shape.dim, generator=generator, device=shape.device
    ).to(shape.dtype)
    order = torch.randperm(sum(needed), generator=generator, device=shape.device)
    tables = torch.zeros(len(lengths), max(needed), dtype=torch.long, device=shape.device)
    taken = 0
    for s, count in enumerate(needed):
        tables[s, :count] = order[taken : taken + count]
        taken += count
    return cache, tables


def bench_attention(lengths: list[int], new_rows: list[int], label: str, shape: AttentionShape) -> Row:
    """Triton vs the torch reference of ``gqa.paged_gqa_attention``: sequences of ``lengths`` cached
    tokens (this step's ``new_rows`` included) attending with their last ``new_rows`` positions."""
    from metrale.worker.kernels import gqa
    from metrale.worker.kernels.triton import gqa as triton_gqa

    kv_cache, tables = paged_kv(lengths, shape, seed=len(lengths))
    generator = torch.Generator(device=shape.device).manual_seed(len(lengths) + 1)
    q = torch.randn(sum(new_rows), shape.heads, shape.dim, generator=generator, device=shape.device).to(shape.dtype)
    cu_seqlens = torch.tensor([0, *new_rows], device=shape.device).cumsum(0)
    context_lens = torch.tensor(lengths, device=shape.device)
    args = (q, kv_cache, tables, cu_seqlens, context_lens, shape.dim**-0.5)

    def run_triton() -> torch.Tensor:
        return triton_gqa.paged_gqa_attention(*args)

    def run_torch() -> torch.Tensor:
        return gqa.paged_gqa_attention(*args)

    max_error = (run_triton().float() - run_torch().float()).abs().max().item()
    element = kv_cache.element_size()
    cache_bytes = sum(lengths) * 2 * shape.kv_heads * shape.dim * element
    return Row(
        label,
        time_ms(run_triton, shape.device),
        time_ms(run_torch, shape.device),
        None,
        cache_bytes + 2 * q.numel() * element,
        max_error,
    )


def run_attention(args: argparse.Namespace) -> None:
    """The ``--attention gqa`` table: decode batches at ``--context-len``, then prefill batches."""
    heads = args.heads or 16
    kv_heads = args.key_heads or 4
    dim = args.head_dim or 256
    if heads % kv_heads:
        sys.exit(f"--heads ({heads}) must be a multiple of --key-heads ({kv_heads})")
    shape = AttentionShape(heads, kv_heads, dim, args.device)
    peak = peak_bandwidth_gbps(args.peak_gbps, args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    print(
        f"device={device} peak={peak or '?'} GB/s attention=gqa H={heads} Hkv={kv_heads} D={dim} "
        f"dtype={str(shape.dtype).removeprefix('torch.')} context={args.context_len}"
    )
    print("| case | Triton µs | GB/s | of peak | × torch | × fla | max abs Δo vs torch |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batches:
        row = bench_attention([args.context_len] * batch, [1] * batch, f"decode B={batch} L={args.context_len}", shape)
        print(row.markdown(peak), flush=True)
    for num_seqs in args.prefill_batches:
        lengths = [args.prefill_len] * num_seqs
        row = bench_attention(lengths, lengths, f"prefill S={num_seqs} L={args.prefill_len}", shape)
        print(row.markdown(peak), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--prefill-batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--recurrence", choices=["kda", "gdn"], default="kda")
    parser.add_argument("--attention", choices=["gqa"], default=None, help="time paged attention instead")
    parser.add_argument("--context-len", type=int, default=2048, help="--attention: cached tokens per decode row")
    parser.add_argument(
        "--heads", type=int, default=None, help="heads (Gated DeltaNet: value heads; GQA: query heads, default 16)"
    )
    parser.add_argument(
        "--key-heads", type=int, default=None, help="Gated DeltaNet key heads (default heads / 2); GQA KV heads (4)"
    )
    parser.add_argument("--head-dim", type=int, default=None, help="default 128 (GQA: 256)")
    parser.add_argument("--peak-gbps", type=float, default=None, help="the device's peak memory bandwidth")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/kernels.py measures GPU kernels and needs a CUDA device; none is visible here.")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu runs Triton's interpreter: set TRITON_INTERPRET=1 in the environment.")
    if args.attention == "gqa":
        run_attention(args)
        return
    args.heads = args.heads or 32
    args.head_dim = args.head_dim or 128
    if args.recurrence == "kda" and args.key_heads is not None:
        sys.exit("--key-heads is for --recurrence gdn (KDA has one key head per head)")
    key_heads = args.heads if args.recurrence == "kda" else args.key_heads or max(1, args.heads // 2)
    if args.heads % key_heads:
        sys.exit(f"--heads ({args.heads}) must be a multiple of --key-heads ({key_heads})")
    shape = Shape(args.recurrence, args.heads, key_heads, args.head_dim, args.device)

    fla = load_fla(args.recurrence) if args.device == "cuda" else {}
    peak = peak_bandwidth_gbps(args.peak_gbps, args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    print(
        f"device={device} peak={peak or '?'} GB/s recurrence={args.recurrence} H={args.heads} "
        f"Hk={key_heads} K=V={args.head_dim} fla={'yes' if fla else 'not installed'}"
    )
    print("| case | Triton µs | GB/s | of peak | × torch | × fla | max abs Δo vs torch |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batches:
        print(bench_decode(batch, shape, fla).markdown(peak), flush=True)
    for num_seqs in args.prefill_batches:
        row = bench_prefill(num_seqs, args.prefill_len, shape, fla)
        print(row.markdown(peak), flush=True)


if __name__ == "__main__":
    main()
