"""KDA kernels on a GPU at Kimi-Linear-48B layer shapes (H=32, K=V=128): Triton vs torch reference vs fla.

    python bench/kernels.py [--batches 1 8 32 128 256] [--prefill-batches 1 4 16] [--prefill-len 1024]
                            [--heads 32] [--head-dim 128] [--peak-gbps 4800]

Decode: B sequences advance one token each, their states scattered over a pool of 2B slots (every
other slot, so the gather is real) and updated in place. Prefill: S sequences of L tokens in one
varlen batch, half of them continuing a pooled state. Inputs are bf16 (log-decays fp32, states fp32),
as the model feeds them.

Each row reports the median time, the bandwidth achieved over the bytes the kernel must move (inputs,
outputs, and each touched state read and written once) against the device's peak, the speed-up over
the torch reference and over fla's ``fused_recurrent_kda`` / ``chunk_kda`` when fla is importable
(fla is timed on pre-gathered states: it has no pool), and the largest output difference from the
torch reference. Exits with a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from metrale.worker.kernels.kda import chunked, decode

HBM_PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "A100-SXM4-80GB": 2039.0}
"""Fallback peaks (GB/s) by device-name fragment, for torch builds that do not report memory clocks."""


@dataclass(frozen=True)
class KdaBatch:
    """One batch of KDA inputs on the GPU: q, k, g ``[N, H, K]``, v ``[N, H, V]``, beta ``[N, H]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def random(cls, rows: int, heads: int, dim: int, seed: int) -> KdaBatch:
        generator = torch.Generator(device="cuda").manual_seed(seed)

        def normal(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, device="cuda")

        g = F.logsigmoid(2.0 * normal(rows, heads, dim) + 2.0)
        beta = torch.sigmoid(normal(rows, heads)).bfloat16()
        q, k, v = (normal(rows, heads, dim).bfloat16() for _ in range(3))
        return cls(q, k, v, g, beta)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.k, self.v, self.g, self.beta

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


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` on the GPU (Triton's ``do_bench``: warm-up, L2 flushed)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def peak_bandwidth_gbps(override: float | None) -> float | None:
    """The device's peak memory bandwidth: ``override``, else from its memory clock, else by name."""
    if override:
        return override
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    return next((peak for fragment, peak in HBM_PEAK_GBPS.items() if fragment in props.name), None)


def load_fla() -> dict[str, Any]:
    """fla's KDA entry points by name, empty when fla is not installed."""
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except ImportError:
        return {}
    return {"decode": fused_recurrent_kda, "prefill": chunk_kda}


def bench_decode(batch: int, heads: int, dim: int, fla: dict[str, Any]) -> Row:
    from metrale.worker.kernels.triton import kda_decode as triton_decode

    inputs = KdaBatch.random(batch, heads, dim, seed=batch)
    pool = 0.1 * torch.randn(2 * batch, heads, dim, dim, device="cuda")
    slots = torch.arange(0, 2 * batch, 2, device="cuda")
    scale = dim**-0.5

    def run_triton() -> torch.Tensor:
        return triton_decode.kda_decode(*inputs.tensors(), pool, slots, scale)

    def run_torch() -> torch.Tensor:
        return decode.kda_decode(*inputs.tensors(), pool, slots, scale)

    snapshot = pool.clone()
    o_triton = run_triton()
    pool.copy_(snapshot)  # the reference advances the same states
    max_error = (o_triton - run_torch()).abs().max().item()
    fla_ms = None
    if "decode" in fla:
        states = pool[slots].clone()
        as_sequences = [t.unsqueeze(1) for t in inputs.tensors()]  # [B, T=1, H, *]
        fla_ms = time_ms(
            lambda: fla["decode"](
                *as_sequences, scale=scale, initial_state=states, output_final_state=True, use_qk_l2norm_in_kernel=True
            )
        )
    state_bytes = 2 * batch * heads * dim * dim * 4
    return Row(
        f"decode B={batch}", time_ms(run_triton), time_ms(run_torch), fla_ms, inputs.nbytes() + state_bytes, max_error
    )


def bench_prefill(num_seqs: int, length: int, heads: int, dim: int, fla: dict[str, Any]) -> Row:
    from metrale.worker.kernels.triton import kda_chunked as triton_chunked

    inputs = KdaBatch.random(num_seqs * length, heads, dim, seed=num_seqs)
    cu_seqlens = torch.arange(0, num_seqs * length + 1, length, device="cuda")
    pool = 0.1 * torch.randn(num_seqs, heads, dim, dim, device="cuda")
    slots = torch.arange(num_seqs, device="cuda")
    carried = slots % 2 == 1
    scale = dim**-0.5
    snapshot = pool.clone()

    def run(kernel: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            pool.copy_(snapshot)  # every call starts from the same states (one extra state copy, timed)
            return kernel(*inputs.tensors(), cu_seqlens, pool, slots, carried, scale)

        return call

    run_triton, run_torch = run(triton_chunked.kda_chunked_prefill), run(chunked.kda_chunked_prefill)
    max_error = (run_triton() - run_torch()).abs().max().item()
    fla_ms = None
    if "prefill" in fla:
        as_batch = [t.unsqueeze(0) for t in inputs.tensors()]  # [1, N, H, *]
        fla_ms = time_ms(
            lambda: fla["prefill"](
                *as_batch,
                scale=scale,
                initial_state=snapshot,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu_seqlens,
            )
        )
    state_bytes = 2 * num_seqs * heads * dim * dim * 4
    return Row(
        f"prefill S={num_seqs} L={length}",
        time_ms(run_triton),
        time_ms(run_torch),
        fla_ms,
        inputs.nbytes() + state_bytes,
        max_error,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--prefill-batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--peak-gbps", type=float, default=None, help="the device's peak memory bandwidth")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py measures GPU kernels and needs a CUDA device; none is visible here.")

    fla, peak = load_fla(), peak_bandwidth_gbps(args.peak_gbps)
    print(
        f"device={torch.cuda.get_device_name()} peak={peak or '?'} GB/s H={args.heads} K=V={args.head_dim} "
        f"fla={'yes' if fla else 'not installed'}"
    )
    print("| case | Triton µs | GB/s | of peak | × torch | × fla | max abs Δo vs torch |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batches:
        print(bench_decode(batch, args.heads, args.head_dim, fla).markdown(peak), flush=True)
    for num_seqs in args.prefill_batches:
        row = bench_prefill(num_seqs, args.prefill_len, args.heads, args.head_dim, fla)
        print(row.markdown(peak), flush=True)


if __name__ == "__main__":
    main()
