"""Metrale's engine against llama.cpp on the same model, fp32 and bf16, both in one run, interleaved.

    python bench/vs_llamacpp.py [--model medium-4-heads [qwen3_5-medium ...]] [--repeats 3] [--threads 2]
                                [--json] [--compile] [--one-stream] [--no-token-check]

llama.cpp comes from the pinned ``llama-cpp-python`` sdist (``bench/llamacpp.py``: built once under
``<MET_CACHE_DIR>/llamacpp/<version>/``, the model converted by its ``convert_hf_to_gguf.py``). Each
repeat runs, per weight type, llama.cpp then met on each workload, so both see the same machine:

- one stream: ``llama-bench -p 128 -n 128 -t T`` (prompt pass and 128 generated tokens, separately)
  against one engine request of a 128-token prompt and 128 new tokens — its time to first token and its
  decode rate (127 tokens after the first over the time they took);
- 64 × (128 + 128): ``llama-batched-bench -npp 128 -ntg 128 -npl 64 -t T`` against 64 prompts through
  one engine at once (``bench/engine.py``'s run), both as generated tokens over the whole run's time.

Several ``--model``s run in the same repeats, interleaved (per repeat and weight type, each model in turn),
and a last table sets their ratios side by side with met's speed on each over its speed on the first.
Before timing, each converted model is checked: llama.cpp's greedy continuation of a few text prompts
(``llama-completion``) against met's, byte for byte up to the first special token either makes — a
wrong conversion would make the ratios meaningless. A mismatch is reported, not fatal (bf16 may differ
at a near-tie); ``--no-token-check`` leaves it out.

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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import engine_run, prompts_for, stream_timing, timed_engine
from bench.llamacpp import (
    LlamaCpp,
    batched_bench,
    converted,
    describe,
    ensure_built,
    greedy_bytes,
    llama_bench,
)
from bench.models import MODEL_NAMES, bench_config, bench_model
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.families.qwen3_5_config import Qwen35Config

DTYPES = {"fp32": ("float32", "f32"), "bf16": ("bfloat16", "bf16")}
"""Our name → (met's load dtype, the converter's ``--outtype``)."""


CHECK_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a land far away,",
    "def add(a, b):\n    return a + b\n",
)
CHECK_TOKENS = 32


@dataclass(frozen=True)
class TokenCheck:
    """met's and llama.cpp's greedy continuations of one prompt, compared byte for byte."""

    model: str
    dtype: str
    prompt: str
    prompt_ids_equal: bool  # llama.cpp tokenized the prompt as the folder's tokenizer does
    tokens_compared: int  # met's tokens before the first special one (llama.cpp prints those as nothing)
    equal: bool  # llama.cpp's bytes are met's up to there
    met_bytes: bytes
    llama_bytes: bytes


def token_bytes(tokenizer: Tokenizer) -> dict[int, bytes | None]:
    """Each id's bytes as a byte-level BPE prints it; None for a special token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    char_byte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}
    added = tokenizer.get_added_tokens_decoder()
    out: dict[int, bytes | None] = {}
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i in added:
            out[i] = None if added[i].special else token.encode()
        else:
            out[i] = bytes(char_byte[c] for c in token)
    return out


def check_tokens(llama: LlamaCpp, gguf: Path, directory: Path, model: str, name: str, threads: int) -> list[TokenCheck]:
    """llama.cpp's greedy ``CHECK_TOKENS`` tokens after each of ``CHECK_PROMPTS`` against met's."""
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    pieces = token_bytes(tokenizer)
    engine, _ = timed_engine(directory, 1, 64 + CHECK_TOKENS, DTYPES[name][0])
    params = SamplingParams(max_tokens=CHECK_TOKENS, temperature=0.0, ignore_eos=True)
    checks = []
    for prompt in CHECK_PROMPTS:
        ids = tokenizer.encode(prompt).ids  # with the folder's BOS, as llama.cpp adds it
        [result] = engine.generate([ids], params)
        made = list(result.completions[0].token_ids)
        kept = [pieces[t] for t in made]
        compared = kept.index(None) if None in kept else len(kept)
        mine = b"".join(p for p in kept[:compared] if p is not None)
        llama_ids, theirs = greedy_bytes(llama, gguf, prompt, CHECK_TOKENS, threads)
        equal = theirs == mine if compared == len(made) else theirs.startswith(mine)
        checks.append(TokenCheck(model, name, prompt, llama_ids == ids, compared, equal, mine, theirs))
    return checks


@dataclass(frozen=True)
class Run:
    """One engine's numbers on one model and weight type in one repeat."""

    engine: str
    model: str
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
    return stream_timing(engine, prompt, new_tokens, "one-stream")


def met_run(
    directory: Path,
    prompts: list[list[int]],
    new_tokens: int,
    dtype: str,
    model: str,
    name: str,
    args: argparse.Namespace,
) -> Run:
    ttft_s, decode = met_one_stream(directory, prompts[0], prompts[-1], new_tokens, dtype, args.compile)
    if args.one_stream:
        return Run("met", model, name, 1000 * ttft_s, decode, float("nan"))
    batch = engine_run(directory, prompts, new_tokens, max_seqs=len(prompts), dtype=dtype)
    return Run("met", model, name, 1000 * ttft_s, decode, batch.tokens_per_s)


def llama_run(
    llama: LlamaCpp,
    gguf: Path,
    sequences: int,
    prompt: int,
    new: int,
    threads: int,
    model: str,
    name: str,
    one_stream: bool,
) -> Run:
    single = llama_bench(llama, gguf, prompt, new, threads, repetitions=2)
    ttft_ms = 1000 * prompt / single.pp_tokens_per_s
    if one_stream:
        return Run("llama.cpp", model, name, ttft_ms, single.tg_tokens_per_s, float("nan"))
    batched = batched_bench(llama, gguf, sequences, prompt, new, threads)
    return Run(
        "llama.cpp",
        model,
        name,
        ttft_ms,
        single.tg_tokens_per_s,
        batched.generated_tokens_per_s,
    )


WORKLOADS = ("batch_tokens_per_s", "decode_tokens_per_s", "ttft_ms")


def best(runs: list[Run], engine: str, model: str, dtype: str) -> Run:
    """The best value of each column over the repeats (lowest TTFT, highest rates)."""
    mine = [r for r in runs if r.engine == engine and r.model == model and r.dtype == dtype]
    return Run(
        engine,
        model,
        dtype,
        min(r.ttft_ms for r in mine),
        max(r.decode_tokens_per_s for r in mine),
        max(r.batch_tokens_per_s for r in mine),
    )


def workload_name(field: str, sequences: int, prompt: int, new: int) -> str:
    return {
        "batch_tokens_per_s": f"{sequences} × ({prompt} + {new}), generated tok/s",
        "decode_tokens_per_s": f"one stream, decode tok/s (tg{new})",
        "ttft_ms": f"time to first token, {prompt}-token prompt, ms (pp{prompt})",
    }[field]


def table(
    runs: list[Run], model: str, dtypes: list[str], sequences: int, prompt: int, new: int
) -> list[tuple[str, str, float, float, float]]:
    """Rows for ``model``: (workload, dtype, met, llama.cpp, met ÷ llama.cpp)."""
    rows = []
    for dtype in dtypes:
        met, llama = best(runs, "met", model, dtype), best(runs, "llama.cpp", model, dtype)
        for field in WORKLOADS:
            mine, theirs = getattr(met, field), getattr(llama, field)
            rows.append((workload_name(field, sequences, prompt, new), dtype, mine, theirs, mine / theirs))
    return rows


def side_by_side(
    runs: list[Run], models: list[str], dtypes: list[str], sequences: int, prompt: int, new: int
) -> list[tuple[str, str, list[float], list[float]]]:
    """Rows: (workload, dtype, each model's met ÷ llama.cpp, each model's met over met on ``models[0]``) —
    every ratio ≥ 1 is met faster, but for TTFT (lower is better) whose ratios are as measured."""
    rows = []
    for dtype in dtypes:
        mets = [best(runs, "met", m, dtype) for m in models]
        llamas = [best(runs, "llama.cpp", m, dtype) for m in models]
        for field in WORKLOADS:
            vs_llama = [getattr(m, field) / getattr(ll, field) for m, ll in zip(mets, llamas, strict=True)]
            vs_first = [getattr(m, field) / getattr(mets[0], field) for m in mets]
            rows.append((workload_name(field, sequences, prompt, new), dtype, vs_llama, vs_first))
    return rows


def vocab_size(directory: Path) -> int:
    """The vocabulary of a model folder's ``config.json`` (flat or, for Qwen3.5, under ``text_config``)."""
    data = json.loads((directory / "config.json").read_text())
    return int(data.get("text_config", data)["vocab_size"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        nargs="+",
        default=["medium-4-heads"],
        choices=MODEL_NAMES,
        help="bench models, all in the same run (the side-by-side table's ratios are over the first)",
    )
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp's -t")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--json", action="store_true", help="print the result as JSON, every run included")
    parser.add_argument("--compile", action="store_true", help="met's one stream through the compiled decode step")
    parser.add_argument("--one-stream", action="store_true", help="leave out the 64-stream workload")
    parser.add_argument("--no-token-check", action="store_true", help="leave out the greedy token check")
    args = parser.parse_args(argv)
    if len(set(args.model)) != len(args.model):
        parser.error(f"--model names a model twice: {args.model}")
    uncompiled = [m for m in args.model if isinstance(bench_config(m), Qwen35Config)]
    if args.compile and uncompiled:
        parser.error(f"--compile: met compiles the decode step of Kimi-Linear models only, not {uncompiled}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    llama = ensure_built()
    root = Path(tempfile.gettempdir()) / "metrale-bench"
    directories = {model: bench_model(model, root) for model in args.model}
    ggufs = {(m, name): converted(llama, d, DTYPES[name][1]) for m, d in directories.items() for name in args.dtypes}
    checks: list[TokenCheck] = []
    if not args.no_token_check:
        for (model, name), gguf in ggufs.items():
            checks += check_tokens(llama, gguf, directories[model], model, name, args.threads)
            if not args.json:
                for c in checks[-len(CHECK_PROMPTS) :]:
                    verdict = "same" if c.equal and c.prompt_ids_equal else "DIFFERENT"
                    print(f"token check {model} {name}: {verdict} over {c.tokens_compared} tokens", flush=True)
                    if verdict != "same":
                        print(f"  prompt ids equal: {c.prompt_ids_equal}\n  met:   {c.met_bytes!r}")
                        print(f"  llama: {c.llama_bytes!r}", flush=True)
    prompts = {m: prompts_for(args.sequences, args.prompt_len, vocab_size(d)) for m, d in directories.items()}
    shape = (args.sequences, args.prompt_len, args.new_tokens)
    runs: list[Run] = []
    for repeat in range(args.repeats):
        for name in args.dtypes:
            for model, directory in directories.items():
                runs.append(llama_run(llama, ggufs[model, name], *shape, args.threads, model, name, args.one_stream))
                runs.append(met_run(directory, prompts[model], args.new_tokens, DTYPES[name][0], model, name, args))
                if not args.json:
                    print(f"repeat {repeat + 1} {model} {name}:", *runs[-2:], sep="\n  ", flush=True)
    header = f"threads={args.threads} repeats={args.repeats} compile={args.compile}; {describe(llama)}"
    tables = {model: table(runs, model, args.dtypes, *shape) for model in args.model}
    compared = side_by_side(runs, args.model, args.dtypes, *shape)
    if args.json:
        result = {
            "setup": header,
            "models": args.model,
            "rows": tables,
            "side_by_side": compared,
            "token_checks": [
                {**asdict(c), "met_bytes": repr(c.met_bytes), "llama_bytes": repr(c.llama_bytes)} for c in checks
            ],
            "runs": [asdict(r) for r in runs],
        }
        print(json.dumps(result, indent=2))
        return
    print(header)
    for model, rows in tables.items():
        print(f"\nmodel={model}\n| workload | weights | met | llama.cpp | met ÷ llama.cpp |\n|---|---|---:|---:|---:|")
        for workload, dtype, met, other, ratio in rows:
            if math.isnan(met):  # a workload left out
                continue
            print(f"| {workload} | {dtype} | {met:,.1f} | {other:,.1f} | {ratio:.2f} |")
    if len(args.model) > 1:
        names = " | ".join(f"{m}: met ÷ llama.cpp" for m in args.model)
        firsts = " | ".join(f"met {m} ÷ met {args.model[0]}" for m in args.model[1:])
        print(f"\n| workload | weights | {names} | {firsts} |\n|---|---|" + "---:|" * (2 * len(args.model) - 1))
        for workload, dtype, vs_llama, vs_first in compared:
            if any(math.isnan(r) for r in vs_llama):
                continue
            cells = " | ".join(f"{r:.2f}" for r in [*vs_llama, *vs_first[1:]])
            print(f"| {workload} | {dtype} | {cells} |")


if __name__ == "__main__":
    main()
