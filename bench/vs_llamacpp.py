"""Metrale's engine against llama.cpp on the same model, fp32 and bf16, both in one run, interleaved.

    python bench/vs_llamacpp.py [--model medium] [--repeats 3] [--threads 2] [--json] [--compile] [--one-stream]

llama.cpp comes from the pinned ``llama-cpp-python`` sdist (``bench/llamacpp.py``: built once under
``<MET_CACHE_DIR>/llamacpp/<version>/``, the model converted by its ``convert_hf_to_gguf.py``). Each
repeat runs, per weight type, llama.cpp then met on each workload, so both see the same machine:

- one stream: ``llama-bench -p 128 -n 128 -t T`` (prompt pass and 128 generated tokens, separately)
  against one engine request of a 128-token prompt and 128 new tokens — its time to first token and its
  decode rate (127 tokens after the first over the time they took);
- 64 × (128 + 128): ``llama-batched-bench -npp 128 -ntg 128 -npl 64 -t T`` against 64 prompts through
  one engine at once (``bench/engine.py``'s run), both as generated tokens over the whole run's time.

``--compile`` runs met's one stream through the compiled decode step (``--compile`` of the CLI; compiled
before it is timed); ``--one-stream`` leaves out the 64-stream workload (both engines).

met is greedy with ``ignore_eos``, so every request makes all its tokens, as llama.cpp's do. Each cell is
the best of ``--repeats`` (slow runs are other people's load on a shared machine); ``--json`` also lists
every run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import engine_run, prompts_for, timed_engine
from bench.llamacpp import LlamaCpp, batched_bench, converted, describe, ensure_built, llama_bench
from bench.models import bench_model
from metrale.worker.engine.request import Request
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.config import ModelConfig

DTYPES = {"fp32": ("float32", "f32"), "bf16": ("bfloat16", "bf16")}
"""Our name → (met's load dtype, the converter's ``--outtype``)."""


@dataclass(frozen=True)
class Run:
    """One engine's numbers on one weight type in one repeat."""

    engine: str
    dtype: str
    ttft_ms: float  # 128-token prompt to its first token (llama.cpp: the pp128 pass)
    decode_tokens_per_s: float  # one stream
    batch_tokens_per_s: float  # 64 × (128 + 128), generated tokens over the whole run


def met_one_stream(
    directory: Path, prompt: list[int], warm_up: list[int], new_tokens: int, dtype: str, compiled: bool = False
) -> tuple[float, float]:
    """One request alone in an engine: (seconds to its first token, decode tokens/s after it). First the
    ``warm_up`` prompt (other tokens, the same length) makes 8 tokens, as llama-bench's warm-up run does,
    so the timed prefill is not the process's first of that size."""
    engine, _ = timed_engine(directory, 1, len(prompt) + new_tokens, dtype, (1,) if compiled else None)
    engine.generate([warm_up], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(Request("one-stream", tuple(prompt), params))
    first: float | None = None
    produced = 0
    while engine.has_unfinished():
        for output in engine.step():
            produced += len(output.token_ids)
            if output.token_ids and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    if first is None or produced != new_tokens:
        raise RuntimeError(f"one stream made {produced} tokens, expected {new_tokens}")
    return first - start, (produced - 1) / (end - first)


def met_run(
    directory: Path, prompts: list[list[int]], new_tokens: int, dtype: str, name: str, args: argparse.Namespace
) -> Run:
    ttft_s, decode = met_one_stream(directory, prompts[0], prompts[-1], new_tokens, dtype, args.compile)
    if args.one_stream:
        return Run("met", name, 1000 * ttft_s, decode, float("nan"))
    batch = engine_run(directory, prompts, new_tokens, max_seqs=len(prompts), dtype=dtype)
    return Run("met", name, 1000 * ttft_s, decode, batch.tokens_per_s)


def llama_run(
    llama: LlamaCpp, model: Path, sequences: int, prompt: int, new: int, threads: int, name: str, one_stream: bool
) -> Run:
    single = llama_bench(llama, model, prompt, new, threads, repetitions=2)
    if one_stream:
        return Run("llama.cpp", name, 1000 * prompt / single.pp_tokens_per_s, single.tg_tokens_per_s, float("nan"))
    batched = batched_bench(llama, model, sequences, prompt, new, threads)
    return Run(
        "llama.cpp",
        name,
        1000 * prompt / single.pp_tokens_per_s,
        single.tg_tokens_per_s,
        batched.generated_tokens_per_s,
    )


def best(runs: list[Run], engine: str, dtype: str) -> Run:
    """The best value of each column over the repeats (lowest TTFT, highest rates)."""
    mine = [r for r in runs if r.engine == engine and r.dtype == dtype]
    return Run(
        engine,
        dtype,
        min(r.ttft_ms for r in mine),
        max(r.decode_tokens_per_s for r in mine),
        max(r.batch_tokens_per_s for r in mine),
    )


def table(
    runs: list[Run], dtypes: list[str], sequences: int, prompt: int, new: int
) -> list[tuple[str, str, float, float, float]]:
    """Rows: (workload, dtype, met, llama.cpp, met ÷ llama.cpp)."""
    rows = []
    for dtype in dtypes:
        met, llama = best(runs, "met", dtype), best(runs, "llama.cpp", dtype)
        rows += [
            (
                f"{sequences} × ({prompt} + {new}), generated tok/s",
                dtype,
                met.batch_tokens_per_s,
                llama.batch_tokens_per_s,
                met.batch_tokens_per_s / llama.batch_tokens_per_s,
            ),
            (
                f"one stream, decode tok/s (tg{new})",
                dtype,
                met.decode_tokens_per_s,
                llama.decode_tokens_per_s,
                met.decode_tokens_per_s / llama.decode_tokens_per_s,
            ),
            (
                f"time to first token, {prompt}-token prompt, ms (pp{prompt})",
                dtype,
                met.ttft_ms,
                llama.ttft_ms,
                met.ttft_ms / llama.ttft_ms,
            ),
        ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="medium-4-heads", choices=["medium-4-heads", "tiny", "medium", "large"])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp's -t")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--json", action="store_true", help="print the result as JSON, every run included")
    parser.add_argument("--compile", action="store_true", help="met's one stream through the compiled decode step")
    parser.add_argument("--one-stream", action="store_true", help="leave out the 64-stream workload")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llama = ensure_built()
    directory = bench_model(args.model, Path(tempfile.gettempdir()) / "metrale-bench")
    ggufs = {name: converted(llama, directory, DTYPES[name][1]) for name in args.dtypes}
    prompts = prompts_for(args.sequences, args.prompt_len, ModelConfig.from_pretrained(directory).vocab_size)
    shape = (args.sequences, args.prompt_len, args.new_tokens)
    runs: list[Run] = []
    for repeat in range(args.repeats):
        for name in args.dtypes:
            runs.append(llama_run(llama, ggufs[name], *shape, args.threads, name, args.one_stream))
            runs.append(met_run(directory, prompts, args.new_tokens, DTYPES[name][0], name, args))
            if not args.json:
                print(f"repeat {repeat + 1} {name}:", *(f"{r.engine} {r}" for r in runs[-2:]), sep="\n  ", flush=True)
    rows = table(runs, args.dtypes, *shape)
    header = (
        f"model={args.model} threads={args.threads} repeats={args.repeats} compile={args.compile}; {describe(llama)}"
    )
    if args.json:
        print(json.dumps({"setup": header, "rows": rows, "runs": [asdict(r) for r in runs]}, indent=2))
        return
    print(header)
    print("| workload | weights | met | llama.cpp | met ÷ llama.cpp |\n|---|---|---:|---:|---:|")
    for workload, dtype, met, other, ratio in rows:
        if math.isnan(met):  # a workload left out
            continue
        print(f"| {workload} | {dtype} | {met:,.1f} | {other:,.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
