"""Decode step cost at depth, one stream: the model's forward of one token on top of a cache of D tokens,
eager (as shipped now), eager with the MLA attention forced to torch's one-row path (the eager path before
issue #32), the compiled step (``--compile``: MLA through the split C kernel's graph op) and the compiled
step with MLA in torch (the whole block table scored, masked: the graph before session 17), side by side
in one run.

    python bench/decode_depth.py [--model medium-4-heads] [--depths 128 8192 32768] [--dtypes bfloat16]
                                 [--threads 1 2] [--steps 30]
                                 [--variants eager torch-mla compiled compiled-torch-mla]
    python bench/decode_depth.py --startup [--dtypes bfloat16] [--threads 1]

``--startup`` instead times what a compiled default would add to a worker's start: compiling the bucket-1
graph in a fresh process with an empty inductor cache (a machine's first start), then again in another
fresh process over the cache the first one filled (every later start), wall and CPU seconds of each, and
the eager start (loading the model) beside them.

The cache is filled with random latents instead of a prefill (the attention reads every cached position
whatever they hold, and the KDA state is one fixed size), so a depth costs seconds to set up, not a
prefill; each step feeds the same position again (what a step costs, not what it makes). Reported: CPU
milliseconds per step (``time.process_time``: this process, all threads) and wall milliseconds, medians
of ``--repeats`` rounds; on a shared machine the CPU time and the ratios in one run are the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import bench_model
from metrale.worker.kernels.native import graph_ops as native_graph_ops
from metrale.worker.kernels.native import mla as native_mla
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model

BLOCK_SIZE = 16


@contextmanager
def torch_mla() -> Iterator[None]:
    """The one-row MLA attention as before issue #32: torch's products over the stream's latents."""
    supports = native_mla.supports
    native_mla.supports = lambda *args: False
    try:
        yield
    finally:
        native_mla.supports = supports


@contextmanager
def compiled_torch_mla() -> Iterator[None]:
    """A graph traced while open attends in torch (``mla.paged_mla_decode``'s masked form), as before
    session 17 put the split C kernel in the graph (``metrale_native::mla_decode_latent``)."""
    supports = native_graph_ops.supports_mla
    native_graph_ops.supports_mla = lambda *args: False
    try:
        yield
    finally:
        native_graph_ops.supports_mla = supports


VARIANT_PATCHES = {"torch-mla": torch_mla, "compiled-torch-mla": compiled_torch_mla}
"""The variants that run the shipped code with one kernel switched back to what it was."""


def executor_at(directory: Path, dtype: str, depth: int, compiled: bool) -> ModelExecutor:
    model = load_model(directory, dtype=dtype)
    blocks = -(-(depth + 1) // BLOCK_SIZE)
    executor = ModelExecutor(
        model, num_slots=1, num_blocks=blocks, block_size=BLOCK_SIZE, decode_buckets=(1,) if compiled else None
    )
    generator = torch.Generator().manual_seed(0)
    for cache in executor.pool.kv.values():
        cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
    return executor


def step_ms(executor: ModelExecutor, depth: int, steps: int) -> tuple[float, float]:
    chunk = ForwardChunk(slot=0, block_ids=list(range(executor.num_blocks)), start=depth, token_ids=[7])
    executor.forward([chunk])  # warm (and, compiled, the graph's first call)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        executor.forward([chunk])
    return (time.process_time() - cpu) / steps * 1e3, (time.perf_counter() - wall) / steps * 1e3


def start_seconds(directory: Path, dtype: str, threads: int) -> dict[str, float | int]:
    """In this (fresh) process: wall seconds to load the model (an eager start), then wall and CPU seconds
    to compile the bucket-1 decode graph (what a compiled default adds; CPU: this process's threads, not
    the compiler subprocesses inductor starts), and how many graphs inductor's cache served."""
    torch.set_num_threads(threads)
    wall = time.perf_counter()
    executor = ModelExecutor(load_model(directory, dtype=dtype), num_slots=4, num_blocks=64, decode_buckets=(1,))
    loaded, cpu = time.perf_counter(), time.process_time()
    assert executor.decode_graph is not None
    executor.decode_graph.warm_up()
    return {
        "load_wall": loaded - wall,
        "compile_wall": time.perf_counter() - loaded,
        "compile_cpu": time.process_time() - cpu,
        "graph_cache_hits": torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"],
    }


def startup(args: argparse.Namespace) -> None:
    """Each dtype and thread count: a start over an empty inductor cache, then one over what it cached."""
    print(f"model={args.model}; each start a fresh process; seconds (start CPU: the whole process and the")
    print("compiler processes it waited for; compile CPU: the compiling process's own threads)")
    header = f"{'dtype':9} {'threads':>7} {'cache':>6} {'load wall':>9} {'compile wall':>12} {'compile CPU':>11}"
    print(f"{header} {'start CPU':>9} {'cache hits':>10}")
    for dtype in args.dtypes:
        for threads in args.threads:
            with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
                for cache_state in ("cold", "warm"):
                    command = [sys.executable, __file__, "--startup-child", "--model", args.model]
                    command += ["--dtypes", dtype, "--threads", str(threads)]
                    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                    before = resource.getrusage(resource.RUSAGE_CHILDREN)
                    done = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    start_cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                    seconds = json.loads(done.stdout.strip().splitlines()[-1])
                    print(
                        f"{dtype:9} {threads:>7} {cache_state:>6} {seconds['load_wall']:>9.1f} "
                        f"{seconds['compile_wall']:>12.1f} {seconds['compile_cpu']:>11.1f} {start_cpu:>9.1f} "
                        f"{seconds['graph_cache_hits']:>10}",
                        flush=True,
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="medium-4-heads")
    parser.add_argument("--depths", type=int, nargs="+", default=[128, 8192, 32768])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["eager", "torch-mla", "compiled", "compiled-torch-mla"])
    parser.add_argument("--startup", action="store_true", help="time a compiled start, cold and warm cache")
    parser.add_argument("--startup-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    directory = bench_model(args.model, Path(tempfile.gettempdir()) / "metrale-bench")
    if args.startup_child:
        print(json.dumps(start_seconds(directory, args.dtypes[0], args.threads[0])))
        return
    if args.startup:
        startup(args)
        return
    print(f"model={args.model} steps={args.steps} repeats={args.repeats}")
    print(f"{'dtype':9} {'threads':>7} {'depth':>6} {'variant':>10} {'CPU ms':>8} {'wall ms':>8} {'tok/CPU s':>9}")
    for dtype in args.dtypes:
        for depth in args.depths:
            executors = {v: executor_at(directory, dtype, depth, v.startswith("compiled")) for v in args.variants}
            for threads in args.threads:
                torch.set_num_threads(threads)
                runs: dict[str, list[tuple[float, float]]] = {v: [] for v in args.variants}
                for _ in range(args.repeats):
                    for variant, executor in executors.items():
                        with VARIANT_PATCHES.get(variant, nullcontext)():  # the first step compiles
                            runs[variant].append(step_ms(executor, depth, args.steps))
                for variant, done in runs.items():
                    cpu = statistics.median(c for c, _ in done)
                    wall = statistics.median(w for _, w in done)
                    print(
                        f"{dtype:9} {threads:>7} {depth:>6} {variant:>10} {cpu:>8.2f} {wall:>8.2f} {1e3 / cpu:>9.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
