"""Long context: prefill and decode of one stream at 1k, 8k and 32k tokens (128k with ``--long``), met
against llama.cpp on the same model in the same run.

    python bench/long_context.py [--lengths 1024 8192 32768] [--long] [--new-tokens 32] [--threads 2]
                                 [--dtype float32] [--chunk 2048] [--variants tiled reference]
                                 [--no-llamacpp] [--json]
    python bench/long_context.py --kernel [--lengths 2048 8192 32768] [--threads 1]

The model is ``medium-4-heads`` (``bench/models.py``: Kimi Linear's shape, 6 KDA and 2 MLA layers, which
llama.cpp can load). For each length N, interleaved:

- met: one greedy request of an N-token prompt and ``--new-tokens`` tokens through a real ``Engine``
  (chunked prefill, ``--chunk`` tokens per step); TTFT is the wall time of the steps up to the first
  token, prefill tok/s = N / TTFT, decode tok/s the tokens after the first over their steps' time. Its
  per-token prefill cost at N is (TTFT / N) over the same at the shortest length.
- llama.cpp: ``llama-bench -p N -n 0`` (prefill tok/s; TTFT = N / that) and ``llama-bench -p 0 -n
  <new> -d N`` (decode tok/s at depth N), one repetition each, built by ``bench/llamacpp.py``.

``--kernel`` times the prefill attention alone instead: one ``--chunk``-row chunk (the last rows of a
context of each length) of the model's MLA shape, the tiled kernel against the whole-context reference,
wall and CPU seconds (``time.process_time``, all threads).

``--variants`` runs met's prefill chunks through the tiled attention (``kernels.tiled_prefill``, what
ships) and/or the whole-context reference (``_attend_sequence_rows``); the first is the one compared
with llama.cpp. Every engine first runs a short warm-up request. The machine is shared: compare ratios
measured in one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import stream_timing
from bench.llamacpp import LlamaCpp, converted, describe, ensure_built
from bench.models import bench_model
from metrale.worker.engine.engine import Engine
from metrale.worker.kernels import mla, ops, tiled_prefill
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig

MODEL = "medium-4-heads"
OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}
BLOCK = 16


@dataclass(frozen=True)
class Row:
    """One engine's numbers at one prompt length."""

    engine: str  # "met (tiled)", "met (reference)", "llama.cpp"
    prompt_tokens: int
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def _engine(directory: Path, dtype: str, context: int, chunk: int) -> Engine:
    """One stream's engine for ``context`` tokens, ``chunk`` prompt tokens per step."""
    model = load_model(directory, dtype=dtype)
    blocks = 2 * -(-context // BLOCK)
    executor = ModelExecutor(model, num_slots=2, num_blocks=blocks, block_size=BLOCK)
    config = SchedulerConfig(
        max_batch_tokens=chunk, max_seqs=2, num_slots=2, num_blocks=blocks, block_size=BLOCK, max_model_len=context
    )
    return Engine(executor, config, seed=0)


def _use_attention(variant: str) -> None:
    """Route met's prefill chunks through the tiled attention (``tiled``) or the whole-context reference."""
    ops._mla_sequence_rows = _tiled_mla if variant == "tiled" else (lambda: None)


_tiled_mla = ops._mla_sequence_rows


def met_row(directory: Path, args: argparse.Namespace, length: int, variant: str) -> Row:
    _use_attention(variant)
    engine = _engine(directory, args.dtype, length + args.new_tokens, args.chunk)
    generator = torch.Generator().manual_seed(length)
    warm_up = torch.randint(0, 512, (64,), generator=generator).tolist()
    stream_timing(engine, warm_up, 4, f"warm-{length}-{variant}")
    prompt = torch.randint(0, 512, (length,), generator=generator).tolist()
    ttft, decode = stream_timing(engine, prompt, args.new_tokens, f"long-{length}-{variant}")
    return Row(f"met ({variant})", length, ttft, length / ttft, decode)


def _llama_bench(llama: LlamaCpp, model: Path, threads: int, *flags: str) -> float:
    """``avg_ts`` of one ``llama-bench`` test given by ``flags``."""
    command = [str(llama.tool("llama-bench")), "-m", str(model), "-t", str(threads), "-r", "1", "-o", "json", *flags]
    rows = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    return float(rows[-1]["avg_ts"])


def llama_row(llama: LlamaCpp, model: Path, args: argparse.Namespace, length: int) -> Row:
    prefill = _llama_bench(llama, model, args.threads, "-p", str(length), "-n", "0")
    decode = _llama_bench(llama, model, args.threads, "-p", "0", "-n", str(args.new_tokens), "-d", str(length))
    return Row("llama.cpp", length, length / prefill, prefill, decode)


def table(rows: list[Row], lengths: list[int]) -> str:
    shortest = min(lengths)
    per_token = {(r.engine, r.prompt_tokens): r.ttft_s / r.prompt_tokens for r in rows}
    lines = [
        "| engine | prompt tokens | TTFT s | prefill tok/s | per-token prefill cost vs "
        f"{shortest} | decode tok/s at depth | met ÷ llama.cpp prefill | met ÷ llama.cpp decode |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    llama = {r.prompt_tokens: r for r in rows if r.engine == "llama.cpp"}
    for r in sorted(rows, key=lambda r: (r.prompt_tokens, r.engine)):
        base = per_token.get((r.engine, shortest))
        cost = per_token[r.engine, r.prompt_tokens] / base if base else float("nan")
        other = llama.get(r.prompt_tokens) if r.engine != "llama.cpp" else None
        vs_prefill = f"{r.prefill_tokens_per_s / other.prefill_tokens_per_s:.2f}" if other else ""
        vs_decode = f"{r.decode_tokens_per_s / other.decode_tokens_per_s:.2f}" if other else ""
        lines.append(
            f"| {r.engine} | {r.prompt_tokens} | {r.ttft_s:.2f} | {r.prefill_tokens_per_s:.0f} | {cost:.2f} | "
            f"{r.decode_tokens_per_s:.1f} | {vs_prefill} | {vs_decode} |"
        )
    return "\n".join(lines)


def kernel_table(args: argparse.Namespace) -> str:
    """The tiled prefill attention against the reference on one ``args.chunk``-row chunk per length."""
    config = json.loads(
        (bench_model(MODEL, Path(tempfile.gettempdir()) / "metrale-bench-models") / "config.json").read_text()
    )
    heads, kv_rank, rope = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    lines = [
        "| context | tiled wall s | tiled CPU s | reference wall s | reference CPU s | reference ÷ tiled CPU |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    generator = torch.Generator().manual_seed(0)
    for length in sorted(args.lengths):
        rows = min(args.chunk, length)
        blocks = -(-length // BLOCK)
        cache = torch.randn(blocks, BLOCK, kv_rank + rope, generator=generator)
        table_ = torch.arange(blocks)
        q_latent = torch.randn(rows, heads, kv_rank, generator=generator)
        q_rope = torch.randn(rows, heads, rope, generator=generator)
        times = []
        for attend in (tiled_prefill.mla_sequence_rows, mla._attend_sequence_rows):
            wall, cpu = time.perf_counter(), time.process_time()
            attend(q_latent, q_rope, cache, table_, length, 0.1)
            times += [time.perf_counter() - wall, time.process_time() - cpu]
        cells = " | ".join(f"{t:.2f}" for t in times)
        lines.append(f"| {length} | {cells} | {times[3] / times[1]:.1f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--long", action="store_true", help="also 131072 tokens (takes long)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(OUTTYPES), default="float32")
    parser.add_argument("--chunk", type=int, default=2048, help="met's prompt tokens per step (max_batch_tokens)")
    parser.add_argument("--variants", nargs="+", choices=["tiled", "reference"], default=["tiled"])
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--kernel", action="store_true", help="time the prefill attention alone")
    args = parser.parse_args()
    if args.kernel:
        torch.set_num_threads(args.threads)
        print(f"{MODEL} MLA, one {args.chunk}-row chunk, {args.threads} threads")
        print(kernel_table(args))
        return
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode is timed after the first token)")
    lengths = sorted(set(args.lengths + ([131072] if args.long else [])))
    torch.set_num_threads(args.threads)
    root = Path(tempfile.gettempdir()) / "metrale-bench-models"
    directory = bench_model(MODEL, root, dtype=args.dtype)
    llama = None if args.no_llamacpp else ensure_built()
    gguf = converted(llama, directory, OUTTYPES[args.dtype]) if llama else None
    if llama:
        print(describe(llama), flush=True)
    print(f"{MODEL} {args.dtype}, {args.threads} threads, chunk {args.chunk}, {args.new_tokens} new tokens", flush=True)
    rows: list[Row] = []
    for length in lengths:
        if llama and gguf:
            rows.append(llama_row(llama, gguf, args, length))
            print(rows[-1], flush=True)
        for variant in args.variants:
            rows.append(met_row(directory, args, length, variant))
            print(rows[-1], flush=True)
    print(table(rows, lengths))
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))


if __name__ == "__main__":
    main()
