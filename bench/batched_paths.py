"""64 streams through the engine with and without a CPU fast path, interleaved in one run.

    python bench/batched_paths.py [--model medium-4-heads] [--dtypes float32 bfloat16] [--repeats 2]
                                  [--threads 2] [--paths native-mla bf16-widening]

Each run is ``bench/engine.py``'s (``engine_run``: 64 prompts × 128 tokens, 128 new greedy tokens each,
all at once, a 2,048-token budget per step), reported as generated tokens per wall second and per CPU
second of this process. For each dtype and repeat it runs the code as it is, then once per path in
``--paths`` with that path turned off:

- ``native-mla``: the decode rows' latent attention as the torch twin (``kernels.mla``'s gather and
  einsums) instead of the C kernel (``kernels/native/mla_decode.c``);
- ``bf16-widening``: bf16 products in torch's bf16 matmul instead of widened to fp32
  (``kernels/products.py``; only a CPU without bf16 instructions widens them at all).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import engine_run, prompts_for
from bench.models import bench_model
from metrale.worker.kernels import products
from metrale.worker.kernels.native import mla as native_mla
from metrale.worker.model.config import ModelConfig


def _without_native_mla() -> Callable[[], None]:
    supports = native_mla.supports
    native_mla.supports = lambda *args: False

    def restore() -> None:
        native_mla.supports = supports

    return restore


def _without_bf16_widening() -> Callable[[], None]:
    widen = products.WIDEN_BF16
    products.WIDEN_BF16 = False

    def restore() -> None:
        products.WIDEN_BF16 = widen

    return restore


PATHS: dict[str, Callable[[], Callable[[], None]]] = {
    "native-mla": _without_native_mla,
    "bf16-widening": _without_bf16_widening,
}
"""Path name → a function that turns it off and returns the function that turns it back on."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="medium-4-heads", choices=["tiny", "medium", "medium-4-heads"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--prompts", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    directory = bench_model(args.model, Path(tempfile.gettempdir()) / "metrale-bench")
    prompts = prompts_for(args.prompts, 128, ModelConfig.from_pretrained(directory).vocab_size)
    print(f"model={args.model} streams={args.prompts} threads={args.threads} bf16 widened={products.WIDEN_BF16}")
    print("| repeat | dtype | variant | tok/s | tok per CPU s |\n|---|---|---|---:|---:|")
    for repeat in range(1, args.repeats + 1):
        for dtype in args.dtypes:
            for variant in ["as is", *(f"without {path}" for path in args.paths)]:
                restore = PATHS[variant.removeprefix("without ")]() if variant != "as is" else None
                try:
                    run = engine_run(directory, prompts, 128, max_seqs=len(prompts), dtype=dtype)
                finally:
                    if restore is not None:
                        restore()
                rates = f"{run.tokens_per_s:.1f} | {run.tokens_per_cpu_s:.1f}"
                print(f"| {repeat} | {dtype} | {variant} | {rates} |", flush=True)


if __name__ == "__main__":
    main()
