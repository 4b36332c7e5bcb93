"""Prefill and decode tokens/s of Metrale's forward vs transformers' forward, same model, same run.

python bench/forward.py [--model tiny|medium] [--batches 1 8 32] [--prompt-len 128] [--decode-steps 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import bench_model
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours(directory: Path, batch: int, prompt_len: int, steps: int) -> tuple[float, float]:
    block = 16
    blocks_per_seq = -(-(prompt_len + steps + 1) // block)
    executor = ModelExecutor(
        load_model(directory), num_slots=batch, num_blocks=batch * blocks_per_seq, block_size=block
    )
    prompts = torch.randint(0, executor.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]

    def prefill() -> object:
        return executor.forward([ForwardChunk(i, tables[i], 0, prompts[i].tolist()) for i in range(batch)])

    prefill_s = timed(prefill, 3)

    def decode() -> object:
        prefill()
        for step in range(steps):
            executor.forward([ForwardChunk(i, tables[i], prompt_len + step, [1]) for i in range(batch)])
        return None

    decode_s = timed(decode, 2) - prefill_s
    return batch * prompt_len / prefill_s, batch * steps / decode_s


def transformers_forward(directory: Path, batch: int, prompt_len: int, steps: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0))

    @torch.inference_mode()
    def prefill() -> object:
        return model(prompts, use_cache=True)

    prefill_s = timed(prefill, 3)

    @torch.inference_mode()
    def decode() -> object:
        out = model(prompts, use_cache=True)
        cache = out.past_key_values
        token = torch.ones(batch, 1, dtype=torch.long)
        for _ in range(steps):
            cache = model(token, past_key_values=cache, use_cache=True).past_key_values
        return None

    decode_s = timed(decode, 2) - prefill_s
    return batch * prompt_len / prefill_s, batch * steps / decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "medium"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    directory = bench_model(args.model, Path(tempfile.gettempdir()) / "metrale-bench")
    print(f"model={args.model} prompt_len={args.prompt_len} decode_steps={args.decode_steps} threads={args.threads}")
    print(
        "| batch | prefill tok/s (ours) | prefill tok/s (transformers) | × "
        "| decode tok/s (ours) | decode tok/s (transformers) | × |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batches:
        op, od = ours(directory, batch, args.prompt_len, args.decode_steps)
        tp, td = transformers_forward(directory, batch, args.prompt_len, args.decode_steps)
        print(
            f"| {batch} | {op:,.0f} | {tp:,.0f} | {op / tp:.1f} | {od:,.0f} | {td:,.0f} | {od / td:.1f} |", flush=True
        )


if __name__ == "__main__":
    main()
