"""What grammar-constrained decoding costs the engine: tok/s at batch 32 with and without a
``json_schema`` constraint, runs interleaved in one process.

    python bench/grammar.py [--model tiny|medium|builtin] [--batch 32] [--prompt-len 64] [--new-tokens 128]
                            [--repeats 3] [--threads N]

Both runs sample (temperature 0.8, seeded) the same prompts for exactly ``--new-tokens`` tokens: the
schema (an object holding a long array of records) has no sentence shorter than that, so every
constrained sequence runs as long as its free twin and the batch stays full. Reports each run's tok/s
over wall time and per CPU second (all threads, llguidance's included), the best of the repeats, the
constrained ÷ free ratios of the best runs and the median ratio of the interleaved pairs, and the
share of the constrained run spent computing masks (``constraints.allowed_tokens``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import prompts_for
from bench.models import bench_model
from metrale.text.grammars import json_schema_grammar
from metrale.text.tokenizer import Tokenizer
from metrale.worker.engine import runner as runner_module
from metrale.worker.engine.constraints import GrammarCompiler
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.builtin import builtin_model_dir
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "score", "ok"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "records": {"type": "array", "items": RECORD, "minItems": 200}},
    "required": ["title", "records"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Run:
    tokens_per_s: float
    tokens_per_cpu_s: float
    mask_share: float  # of wall time, computing grammar masks (0 for a free run)


class _TimedMasks:
    """Wraps ``constraints.allowed_tokens`` as the runner calls it, summing its seconds."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inner = runner_module.allowed_tokens

    def __call__(self, *args: object) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return self._inner(*args)  # type: ignore[arg-type]
        finally:
            self.seconds += time.perf_counter() - start


def run_once(
    executor: ModelExecutor,
    compiler: GrammarCompiler,
    eos: frozenset[int],
    prompts: list[list[int]],
    new_tokens: int,
    grammar: str | None,
) -> Run:
    block = 16
    total = len(prompts[0]) + new_tokens
    config = SchedulerConfig(
        max_batch_tokens=2048,
        max_seqs=len(prompts),
        num_slots=len(prompts),
        num_blocks=executor.num_blocks,
        block_size=block,
        max_model_len=total,
    )
    engine = Engine(executor, config, eos_token_ids=eos, seed=0, grammars=compiler)
    params = [
        # A free run ignores EOS; a constrained one cannot reach it: its grammar is longer than the run.
        SamplingParams(max_tokens=new_tokens, temperature=0.8, seed=i, grammar=grammar, ignore_eos=grammar is None)
        for i in range(len(prompts))
    ]
    timer = _TimedMasks()
    runner_module.allowed_tokens = timer  # type: ignore[assignment]
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        results = engine.generate(prompts, params)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        runner_module.allowed_tokens = timer._inner  # type: ignore[assignment]
    produced = [len(c.token_ids) for r in results for c in r.completions]
    assert all(n == new_tokens for n in produced), f"a sequence ended early: {sorted(set(produced))}"
    return Run(sum(produced) / wall, sum(produced) / cpu, timer.seconds / wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="medium",
        choices=["tiny", "medium", "builtin"],
        help="builtin: the trained built-in model, whose 4,101-token vocabulary makes masks 8x wider",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model == "builtin":
        directory = builtin_model_dir()
    else:
        directory = bench_model(args.model, Path(tempfile.gettempdir()) / "metrale-bench")
    tokenizer = Tokenizer.from_dir(directory)
    model = load_model(directory)
    blocks = args.batch * -(-(args.prompt_len + args.new_tokens) // 16)
    executor = ModelExecutor(model, num_slots=args.batch, num_blocks=blocks, block_size=16)
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size)
    eos = frozenset(model.config.eos_token_ids) | tokenizer.eos_token_ids
    prompts = prompts_for(args.batch, args.prompt_len, model.config.vocab_size)
    grammar = json_schema_grammar(SCHEMA)
    print(
        f"model={args.model} vocab={model.config.vocab_size} batch={args.batch} prompt_len={args.prompt_len} "
        f"new_tokens={args.new_tokens} threads={torch.get_num_threads()}"
    )
    run_once(executor, compiler, eos, prompts[:2], 8, grammar)  # warm-up, and the grammar compiled
    runs: dict[str, list[Run]] = {"free": [], "json_schema": []}
    for _ in range(args.repeats):  # interleaved, so both see the same machine
        runs["free"].append(run_once(executor, compiler, eos, prompts, args.new_tokens, None))
        runs["json_schema"].append(run_once(executor, compiler, eos, prompts, args.new_tokens, grammar))
    for name, done in runs.items():
        print(
            f"{name}: runs {', '.join(f'{r.tokens_per_s:,.0f}' for r in done)} tok/s; best "
            f"{max(r.tokens_per_s for r in done):,.0f} tok/s, {max(r.tokens_per_cpu_s for r in done):,.0f} tok per "
            f"CPU second; masks {min(r.mask_share for r in done):.1%} of wall time"
        )
    free, constrained = runs["free"], runs["json_schema"]
    wall = max(r.tokens_per_s for r in constrained) / max(r.tokens_per_s for r in free)
    cpu = max(r.tokens_per_cpu_s for r in constrained) / max(r.tokens_per_cpu_s for r in free)
    print(
        f"json_schema / free, best runs: {wall:.3f}x wall clock (costs {1 - wall:.1%}), "
        f"{cpu:.3f}x per CPU second (costs {1 - cpu:.1%})"
    )
    pairs_wall = statistics.median(c.tokens_per_s / f.tokens_per_s for f, c in zip(free, constrained, strict=True))
    pairs_cpu = statistics.median(
        c.tokens_per_cpu_s / f.tokens_per_cpu_s for f, c in zip(free, constrained, strict=True)
    )
    print(
        f"json_schema / free, median of the interleaved pairs: {pairs_wall:.3f}x wall clock, "
        f"{pairs_cpu:.3f}x per CPU second"
    )


if __name__ == "__main__":
    main()
