"""The price of one summation order per product row (issue #30): model forwards with the C one-order
product (``kernels/native/product.c``) against torch's products, interleaved in one run.

    python bench/lone_rows.py [--models medium-4-heads qwen3_5-medium] [--dtypes float32 bfloat16]
                              [--threads 1] [--repeats 7] [--rows 1 64] [--prefill 512]

For each model and dtype it prefills ``max(--rows)`` sequences of 32 tokens, then times forwards of one
decode row each of ``N`` sequences for each ``N`` in ``--rows`` (``1``: one stream's decode step;
``64``: a 64-row batch step) and one prefill chunk of ``--prefill`` rows, each with the products as they are
(``one order``) and with the C product turned off (``torch``: MKL's matrix-vector product for a lone
row, its padded sgemm, or oneDNN's bf16, for more), alternating. Reported: the median CPU time of this
process per forward (``time.process_time``, all threads: the machine is shared, so CPU time and ratios
measured side by side are the numbers to compare) and the ratio one order / torch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import bench_model
from metrale.worker.kernels.native import product as native_product
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model

BLOCK = 16
PROMPT = 32


def _without_one_order() -> Callable[[], None]:
    available = native_product.available
    native_product.available = lambda: False

    def restore() -> None:
        native_product.available = available

    return restore


def _cpu_seconds(forward: Callable[[], object]) -> float:
    start = time.process_time()
    forward()
    return time.process_time() - start


def _forwards(
    executor: ModelExecutor, rows: list[int], prefill: int, blocks_each: int, vocab: int
) -> dict[str, Callable[[], object]]:
    """Prefill ``max(rows)`` sequences; return the forwards to time by label: each ``N`` in ``rows`` decode
    rows (position ``PROMPT``, again and again: the same cache length for every variant and repeat; the
    recurrent states advance regardless, which a timing does not mind) and a ``prefill``-row chunk."""
    sequences = max(rows)
    tables = {s: list(range(s * blocks_each, (s + 1) * blocks_each)) for s in range(sequences)}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (sequences, PROMPT + 1), generator=g).tolist()
    executor.forward([ForwardChunk(s, tables[s], 0, tokens[s][:PROMPT]) for s in range(sequences)])
    forwards: dict[str, Callable[[], object]] = {}
    for count in rows:
        chunks = [ForwardChunk(s, tables[s], PROMPT, [tokens[s][PROMPT]]) for s in range(count)]
        forwards[f"decode x{count}"] = partial(executor.forward, chunks)
    prefill_blocks = list(range(sequences * blocks_each, sequences * blocks_each + -(-prefill // BLOCK)))
    prefill_tokens = torch.randint(0, vocab, (prefill,), generator=g).tolist()
    forwards[f"prefill {prefill}"] = partial(
        executor.forward, [ForwardChunk(sequences, prefill_blocks, 0, prefill_tokens)]
    )
    return forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["medium-4-heads", "qwen3_5-medium"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--prefill", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sequences = max(args.rows)
    blocks_each = -(-(PROMPT + 1) // BLOCK)
    print(f"threads={args.threads} repeats={args.repeats} (median CPU ms per forward)")
    print("| model | dtype | forward | one order | torch | one order / torch |\n|---|---|---|---:|---:|---:|")
    for name in args.models:
        directory = bench_model(name, Path(tempfile.gettempdir()) / "metrale-bench")
        for dtype in args.dtypes:
            model = load_model(directory, dtype=dtype)
            vocab = min(model.config.vocab_size, 500)
            blocks = sequences * blocks_each + -(-args.prefill // BLOCK)
            executor = ModelExecutor(model, num_slots=sequences + 1, num_blocks=blocks, block_size=BLOCK)
            forwards = _forwards(executor, args.rows, args.prefill, blocks_each, vocab)
            for label, forward in forwards.items():
                times: dict[str, list[float]] = {"one order": [], "torch": []}
                for _ in range(args.repeats):
                    for variant in times:
                        restore = _without_one_order() if variant == "torch" else None
                        try:
                            times[variant].append(_cpu_seconds(forward))
                        finally:
                            if restore is not None:
                                restore()
                ours, theirs = (statistics.median(times[v]) * 1e3 for v in ("one order", "torch"))
                print(f"| {name} | {dtype} | {label} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
