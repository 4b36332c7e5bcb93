"""Engine throughput vs transformers ``generate`` and vs the plain-matmul bound, in one run.

    python bench/engine.py [--model tiny|medium] [--prompts 64] [--prompt-len 128] [--new-tokens 128]
    python bench/engine.py --model medium --compare-dtypes [--repeats 3] [--threads 1]

Reports: engine tokens/s (all prompts concurrently, greedy), over the whole run and in its decode phase;
transformers ``generate`` tokens/s at batch 1 (on a few prompts) and at its best batch size; two bounds
from the same active weights as plain fp32 matmuls — decode at the engine's batch, and the whole run
(prefill steps of the engine's token budget, then the decode steps); and the engine's overhead — time per
step outside the model forward — at batch 32.

``--compare-dtypes`` instead runs the engine with fp32 and with bf16 weights, interleaved, and reports
both (wall clock and CPU seconds) and their ratio, beside the plain-matmul decode bound in each dtype.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import bench_model
from metrale.shared.settings import KernelBackend
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Request
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.kernels.ops import set_kernel_backend
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig

CHUNK_ROWS = 2048  # the engine's token budget per step (max_batch_tokens)


class TimedExecutor(ModelExecutor):
    """Accumulates the seconds spent inside ``forward`` and notes when decode-only forwards begin."""

    forward_s = 0.0
    decode_started_at: float | None = None  # start of the first forward of decode rows only
    decode_rows = 0  # rows fed by decode-only forwards

    def forward(self, chunks: Sequence[ForwardChunk]) -> torch.Tensor:
        start = time.perf_counter()
        if all(len(chunk.token_ids) == 1 and chunk.start > 0 for chunk in chunks):
            self.decode_started_at = self.decode_started_at or start
            self.decode_rows += len(chunks)
        try:
            return super().forward(chunks)
        finally:
            self.forward_s += time.perf_counter() - start


def prompts_for(count: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab, 512), (count, length), generator=g).tolist()


@dataclass(frozen=True)
class EngineRun:
    tokens_per_s: float  # generated tokens over the whole run's wall time (prefill included)
    decode_tokens_per_s: float  # from the first decode-only step to the end: the decode phase
    overhead: float  # fraction of wall time outside the model forward
    tokens_per_cpu_s: float = 0.0  # generated tokens over the process's CPU seconds (all threads)


def timed_engine(
    directory: Path,
    max_seqs: int,
    total: int,
    dtype: str = "auto",
    decode_buckets: tuple[int, ...] | None = None,
) -> tuple[Engine, TimedExecutor]:
    """An engine over the model in ``directory`` (weights in ``dtype``) for ``max_seqs`` sequences of up to
    ``total`` tokens, ``CHUNK_ROWS`` tokens per step, and its executor (which times the forwards);
    ``decode_buckets``: decode steps of those batch sizes through compiled graphs (compiled here)."""
    block = 16
    blocks = max_seqs * -(-total // block)
    model = load_model(directory, dtype=dtype)
    executor = TimedExecutor(
        model, num_slots=max_seqs, num_blocks=blocks, block_size=block, decode_buckets=decode_buckets
    )
    executor.warm_up()
    config = SchedulerConfig(
        max_batch_tokens=max(CHUNK_ROWS, max_seqs),
        max_seqs=max_seqs,
        num_slots=max_seqs,
        num_blocks=blocks,
        block_size=block,
        max_model_len=total,
    )
    return Engine(executor, config, seed=0), executor


def engine_run(
    directory: Path, prompts: list[list[int]], new_tokens: int, max_seqs: int, dtype: str = "auto"
) -> EngineRun:
    """All prompts through one engine, concurrently, greedy, weights in ``dtype``."""
    engine, executor = timed_engine(directory, max_seqs, len(prompts[0]) + new_tokens, dtype)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    executor.forward_s, executor.decode_started_at, executor.decode_rows = 0.0, None, 0
    start, cpu_start = time.perf_counter(), time.process_time()
    results = engine.generate(prompts, params)
    end, cpu = time.perf_counter(), time.process_time() - cpu_start
    produced = sum(len(c.token_ids) for r in results for c in r.completions)
    decode_start = executor.decode_started_at or start
    return EngineRun(
        produced / (end - start),
        executor.decode_rows / (end - decode_start),
        1.0 - executor.forward_s / (end - start),
        produced / cpu,
    )


def stream_timing(engine: Engine, prompt: list[int], new_tokens: int, name: str) -> tuple[float, float]:
    """One greedy request of ``new_tokens`` stepped through ``engine`` (with ``ignore_eos``): (seconds to its
    first token, decode tokens/s after it)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(Request(name, tuple(prompt), params))
    produced, first = 0, None
    while engine.has_unfinished():
        for output in engine.step():
            produced += len(output.token_ids)
            if output.token_ids and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    if first is None or produced != new_tokens:
        raise RuntimeError(f"{name} made {produced} tokens, expected {new_tokens}")
    return first - start, (produced - 1) / (end - first)


def transformers_run(directory: Path, prompts: list[list[int]], new_tokens: int, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    produced, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return produced / (time.perf_counter() - start)


def active_weight_shapes(config: ModelConfig, lm_head: bool = True) -> list[tuple[int, int]]:
    """``(out, in)`` of every weight one token multiplies: its routed and shared experts, not all experts;
    without the LM head for prompt rows, which need no logits."""
    d = config.hidden_size
    shapes: list[tuple[int, int]] = [(config.vocab_size, d)] if lm_head else []
    for kind, mlp in zip(config.layer_types, config.mlp_layer_types, strict=True):
        if kind == "kda":
            w, k = config.linear_dim, config.linear_head_dim
            shapes += [(3 * w + 2 * k + config.linear_num_heads, d), (w, k), (w, k), (d, w)]
        else:
            q = config.num_attention_heads * config.qk_head_dim
            shapes += [(q + config.latent_dim, d), (d, config.num_attention_heads * config.v_head_dim)]
            shapes += [
                (config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank)
            ]
        if mlp == "moe":
            i = config.moe_intermediate_size
            experts = config.num_experts_per_token + config.num_shared_experts
            shapes += [(2 * i, d), (d, i)] * experts
        else:
            shapes += [(2 * config.intermediate_size, d), (d, config.intermediate_size)]
    return shapes


def matmul_seconds(
    config: ModelConfig,
    rows: int,
    repeats: int = 5,
    steps: int = 10,
    lm_head: bool = True,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Best-of-``repeats`` seconds for one pass of ``rows`` token rows through the active weights as plain
    matmuls in ``dtype`` (weights larger than the caches, as in the model, so they stream from memory)."""
    shapes = active_weight_shapes(config, lm_head)
    weights = [torch.randn(o, i, dtype=dtype) for o, i in shapes]
    inputs = [torch.randn(rows, i, dtype=dtype) for _, i in shapes]
    best = float("inf")
    for _ in range(repeats + 1):  # the first round warms up
        start = time.perf_counter()
        for _ in range(steps):
            for w, x in zip(weights, inputs, strict=True):
                x @ w.T
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def matmul_bound(config: ModelConfig, batch: int) -> float:
    """Decode tokens/s of the model's active weights as plain fp32 matmuls at ``batch`` rows."""
    return batch / matmul_seconds(config, batch)


def workload_bound(config: ModelConfig, prompts: int, prompt_len: int, new_tokens: int, chunk_rows: int) -> float:
    """Generated tokens/s if the whole run — every prompt token in ``chunk_rows``-row prefill steps, then
    ``new_tokens`` decode steps of ``prompts`` rows — cost only its plain matmuls."""
    prefill_steps = prompts * prompt_len / chunk_rows
    seconds = prefill_steps * matmul_seconds(config, chunk_rows, repeats=3, steps=2, lm_head=False)
    seconds += new_tokens * matmul_seconds(config, prompts)
    return prompts * new_tokens / seconds


def compare_dtypes(
    directory: Path, config: ModelConfig, prompts: list[list[int]], new_tokens: int, repeats: int
) -> None:
    """Engine tokens/s with fp32 weights and with bf16 weights, interleaved runs, best of ``repeats``."""
    runs: dict[str, list[EngineRun]] = {"float32": [], "bfloat16": []}
    for _ in range(repeats):
        for dtype, done in runs.items():
            done.append(engine_run(directory, prompts, new_tokens, max_seqs=len(prompts), dtype=dtype))
    best = {dtype: max(done, key=lambda r: r.tokens_per_s) for dtype, done in runs.items()}
    for dtype, done in runs.items():
        print(
            f"engine, {dtype} weights: runs {', '.join(f'{r.tokens_per_s:,.0f}' for r in done)} tok/s; best "
            f"{best[dtype].tokens_per_s:,.0f} tok/s whole run, {best[dtype].decode_tokens_per_s:,.0f} in its decode "
            f"phase, {max(r.tokens_per_cpu_s for r in done):,.0f} tok per CPU second"
        )
    fp32, bf16 = best["float32"], best["bfloat16"]
    cpu = max(r.tokens_per_cpu_s for r in runs["bfloat16"]) / max(r.tokens_per_cpu_s for r in runs["float32"])
    print(
        f"bf16 / fp32: {bf16.tokens_per_s / fp32.tokens_per_s:.2f}x whole run, "
        f"{bf16.decode_tokens_per_s / fp32.decode_tokens_per_s:.2f}x decode phase, {cpu:.2f}x per CPU second"
    )
    bounds = {d: len(prompts) / matmul_seconds(config, len(prompts), dtype=d) for d in (torch.float32, torch.bfloat16)}
    print(
        f"matmul bound, decode at batch {len(prompts)}: fp32 {bounds[torch.float32]:,.0f} tok/s, bf16 "
        f"{bounds[torch.bfloat16]:,.0f} tok/s ({bounds[torch.bfloat16] / bounds[torch.float32]:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "medium"])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hf-batch1-prompts", type=int, default=2)
    parser.add_argument("--hf-batches", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each measurement; the best is reported (the machine is shared: slow runs are others' load)",
    )
    parser.add_argument("--compare-dtypes", action="store_true", help="only the fp32 vs bf16 engine comparison")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    directory = bench_model(args.model, Path(tempfile.gettempdir()) / "metrale-bench")
    config = ModelConfig.from_pretrained(directory)
    prompts = prompts_for(args.prompts, args.prompt_len, config.vocab_size)
    print(
        f"model={args.model} prompts={args.prompts}x{args.prompt_len} new_tokens={args.new_tokens} "
        f"threads={torch.get_num_threads()}"
    )
    if args.compare_dtypes:
        compare_dtypes(directory, config, prompts, args.new_tokens, args.repeats)
        return
    runs, reference_runs = [], []
    for _ in range(args.repeats):  # interleaved, so both kernel sets see the same machine
        runs.append(engine_run(directory, prompts, args.new_tokens, max_seqs=args.prompts))
        set_kernel_backend(KernelBackend.TORCH)
        reference_runs.append(engine_run(directory, prompts, args.new_tokens, max_seqs=args.prompts))
        set_kernel_backend(KernelBackend.AUTO)
    run, reference = (max(r, key=lambda each: each.tokens_per_s) for r in (runs, reference_runs))
    print("engine runs (tok/s):", ", ".join(f"{r.tokens_per_s:,.0f}" for r in runs))
    print(
        f"engine with the torch reference kernels (MET_KERNELS=torch): {reference.tokens_per_s:,.0f} tok/s, "
        f"{reference.decode_tokens_per_s:,.0f} in its decode phase; the default kernels are "
        f"{run.tokens_per_s / reference.tokens_per_s:.2f}x that"
    )
    print(
        f"engine (batch {args.prompts}): {run.tokens_per_s:,.0f} tok/s over the whole run, "
        f"{run.decode_tokens_per_s:,.0f} tok/s in its decode phase",
        flush=True,
    )
    overhead = min(
        engine_run(directory, prompts[:32], args.new_tokens, max_seqs=32).overhead for _ in range(args.repeats)
    )
    print(f"engine overhead at batch 32: {overhead:.1%} of wall time outside the model forward", flush=True)
    bound = matmul_bound(config, args.prompts)
    whole = workload_bound(config, args.prompts, args.prompt_len, args.new_tokens, chunk_rows=CHUNK_ROWS)
    print(
        f"matmul bound, decode at batch {args.prompts}: {bound:,.0f} tok/s; engine decode phase = "
        f"{run.decode_tokens_per_s / bound:.0%} of it\n"
        f"matmul bound, whole run ({CHUNK_ROWS}-row prefill steps + decode): {whole:,.0f} tok/s; engine = "
        f"{run.tokens_per_s / whole:.0%} of it",
        flush=True,
    )
    hf1 = max(
        transformers_run(directory, prompts[: args.hf_batch1_prompts], args.new_tokens, batch=1)
        for _ in range(args.repeats)
    )
    print(f"transformers generate batch 1: {hf1:,.0f} tok/s", flush=True)
    rates = {
        b: max(transformers_run(directory, prompts, args.new_tokens, batch=b) for _ in range(args.repeats))
        for b in args.hf_batches
    }
    print("transformers generate by batch:", ", ".join(f"{b}: {r:,.0f} tok/s" for b, r in rates.items()))
    best = max((rate, batch) for batch, rate in rates.items())
    print(f"transformers generate best: {best[0]:,.0f} tok/s (batch {best[1]})")
    print(
        f"engine / transformers best = {run.tokens_per_s / best[0]:.1f}x; "
        f"engine / transformers batch 1 = {run.tokens_per_s / hf1:.1f}x; "
        f"whole-run matmul bound / transformers best = {whole / best[0]:.1f}x"
    )


if __name__ == "__main__":
    main()
