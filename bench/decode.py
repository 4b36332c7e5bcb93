"""One stream: time to first token of one prompt and decode tokens/s at batch 1, through the real engine.

    python bench/decode.py [--model medium] [--prompt-len 128] [--new-tokens 128] [--repeats 5]
                           [--dtypes float32 bfloat16] [--threads 2 1] [--variants eager layers compiled]
    python bench/decode.py --model medium --profile [--dtypes float32] [--threads 2] [--variants compiled]

Each run adds one prompt to an ``Engine`` and steps it (``scheduler.schedule`` → ``runner.run`` →
postprocess) until its ``--new-tokens`` greedy tokens are out. TTFT is the wall time of the steps up to
the first token (the prefill); decode is the rest, reported per wall second and per CPU second of this
process (``time.process_time``, all threads). Variants (dtype × threads) run interleaved, ``--repeats``
times each; medians are reported. The machine is shared, so the per-CPU-second rate and ratios measured
in one run are the numbers to compare.

Variants: ``eager`` runs the model's forward as shipped (a Kimi-Linear fp32 model's decode forward: its
decoder layers as one C call, ``families.kimi_linear_decode``); ``layers`` is eager with the layers run
one by one (that call off: every other forward's path, and a decode step's before session 20);
``compiled`` runs decode steps through the compiled graph (``ModelExecutor(decode_buckets=(1,))``, what
``--compile`` turns on), compiled before the timed runs (its compile time per dtype and thread count is
printed).

``--profile`` instead times where a batch-1 decode step goes: the engine step's three parts, the
model forward by module (forward hooks), eagerly the torch operators each module dispatches in one step
(each 1-3 µs of dispatch whatever its size), and the torch profiler's top operators.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import active_weight_shapes
from bench.models import MODEL_NAMES, bench_model
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Request
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.kimi_linear import KimiLinearModel
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig


def one_stream_engine(
    directory: Path, dtype: str, context: int, block_size: int = 16, compiled: bool = False
) -> Engine:
    """An engine as a worker builds it, sized for a few sequences of ``context`` tokens; ``compiled``: its
    one-row decode steps through a compiled graph (compiled on first use, or by ``executor.warm_up``)."""
    model = load_model(directory, dtype=dtype)
    seqs = 4
    blocks = seqs * -(-context // block_size)
    executor = ModelExecutor(
        model, num_slots=seqs, num_blocks=blocks, block_size=block_size, decode_buckets=(1,) if compiled else None
    )
    config = SchedulerConfig(
        max_batch_tokens=2048,
        max_seqs=seqs,
        num_slots=seqs,
        num_blocks=blocks,
        block_size=block_size,
        max_model_len=context,
    )
    return Engine(executor, config, seed=0)


@dataclass(frozen=True)
class StreamRun:
    ttft_s: float
    ttft_cpu_s: float  # CPU seconds of the steps up to the first token
    decode_tokens_per_s: float  # tokens after the first over the wall time of their steps
    decode_tokens_per_cpu_s: float  # the same over this process's CPU seconds
    tokens: tuple[int, ...]


_ids = iter(range(10**9))


def stream_run(engine: Engine, prompt: list[int], new_tokens: int) -> StreamRun:
    """One prompt through ``engine``, greedy, ``new_tokens`` tokens; the engine is idle again after."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(Request(f"stream-{next(_ids)}", tuple(prompt), params))
    tokens: list[int] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    while not tokens:
        for output in engine.step():
            tokens += output.token_ids
    first, cpu_first = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        for output in engine.step():
            tokens += output.token_ids
    end, cpu_end = time.perf_counter(), time.process_time()
    decoded = len(tokens) - 1
    return StreamRun(
        first - start, cpu_first - cpu_start, decoded / (end - first), decoded / (cpu_end - cpu_first), tuple(tokens)
    )


def compare(args: argparse.Namespace, directory: Path, prompt: list[int]) -> None:
    context = args.prompt_len + args.new_tokens
    engines = {
        (dtype, variant): one_stream_engine(directory, dtype, context, compiled=variant == "compiled")
        for dtype in args.dtypes
        for variant in args.variants
    }
    for (_dtype, variant), engine in engines.items():
        if variant == "layers":
            _layer_by_layer(engine)
    for threads in args.threads:  # warm-up: graphs compiled (per thread count), kernels built, caches primed
        torch.set_num_threads(threads)
        for (dtype, _variant), engine in engines.items():
            executor = engine._runner.model
            assert isinstance(executor, ModelExecutor)
            start = time.perf_counter()
            if executor.warm_up():
                print(f"compiled {dtype}, {threads} threads: {time.perf_counter() - start:.1f} s")
            stream_run(engine, prompt, 8)
    runs: dict[tuple[str, int, str], list[StreamRun]] = defaultdict(list)
    for _ in range(args.repeats):
        for threads in args.threads:
            torch.set_num_threads(threads)
            for (dtype, variant), engine in engines.items():
                runs[dtype, threads, variant].append(stream_run(engine, prompt, args.new_tokens))
    print(
        f"{'dtype':9} {'threads':>7} {'variant':>8} {'TTFT ms':>8} {'TTFT CPU ms':>11} {'decode tok/s':>12} "
        f"{'tok/CPU s':>9}"
    )
    for (dtype, threads, variant), done in runs.items():
        if len({r.tokens for r in done}) != 1:
            raise SystemExit(f"{dtype}/{threads}/{variant}: repeats generated different tokens")
        ttft = statistics.median(r.ttft_s for r in done)
        ttft_cpu = statistics.median(r.ttft_cpu_s for r in done)
        rate = statistics.median(r.decode_tokens_per_s for r in done)
        cpu = statistics.median(r.decode_tokens_per_cpu_s for r in done)
        print(
            f"{dtype:9} {threads:>7} {variant:>8} {ttft * 1e3:>8.1f} {ttft_cpu * 1e3:>11.1f} {rate:>12.1f} {cpu:>9.1f}"
        )
    _ratios(args, runs)


def _layer_by_layer(engine: Engine) -> None:
    """``engine``'s model runs its decoder layers one by one in every forward (the ``layers`` variant)."""
    executor = engine._runner.model
    assert isinstance(executor, ModelExecutor)
    if not isinstance(executor.model, KimiLinearModel):
        raise SystemExit("--variants layers: only a Kimi-Linear model runs its decode layers as one C call")
    executor.model._fused_layers().fits = False


def _ratios(args: argparse.Namespace, runs: dict[tuple[str, int, str], list[StreamRun]]) -> None:
    """Each variant's decode rate over the ``layers`` (else ``eager``) variant's, per CPU second and per wall
    second, and whether the tokens agree."""
    base = "layers" if "layers" in args.variants else "eager"
    for variant in args.variants:
        if variant != base:
            _ratio(args, runs, variant, base)


def _ratio(args: argparse.Namespace, runs: dict[tuple[str, int, str], list[StreamRun]], name: str, base: str) -> None:
    for dtype in args.dtypes:
        for threads in args.threads:
            eager, compiled = runs[dtype, threads, base], runs[dtype, threads, name]
            cpu = statistics.median(r.decode_tokens_per_cpu_s for r in compiled) / statistics.median(
                r.decode_tokens_per_cpu_s for r in eager
            )
            wall = statistics.median(r.decode_tokens_per_s for r in compiled) / statistics.median(
                r.decode_tokens_per_s for r in eager
            )
            agree = sum(a == b for a, b in zip(eager[0].tokens, compiled[0].tokens, strict=True))
            print(
                f"{name} / {base}, {dtype}, {threads} threads: {cpu:.2f}x per CPU second, {wall:.2f}x wall; "
                f"same greedy tokens for the first {_common_prefix(eager[0].tokens, compiled[0].tokens)} "
                f"({agree} of {len(eager[0].tokens)} equal)"
            )


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


# --- profile ---------------------------------------------------------------------------------------


class Timings:
    """CPU seconds of this process (all threads; run the profile with one thread so that waiting for a
    busy machine's cores is not counted) accumulated under names, nesting allowed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        start = time.process_time()
        try:
            yield
        finally:
            self.seconds[name] += time.process_time() - start


def _wrap(owner: Any, attribute: str, timings: Timings, name: str) -> None:
    original: Callable[..., Any] = getattr(owner, attribute)

    def timed(*args: Any, **kwargs: Any) -> Any:
        with timings.time(name):
            return original(*args, **kwargs)

    setattr(owner, attribute, timed)


def _hook_modules(model: torch.nn.Module, timings: Timings) -> None:
    """Time every layer's attention and MLP and the LM head by forward pre/post hooks."""
    starts: dict[int, float] = {}

    def named(module: torch.nn.Module, name: str) -> None:
        module.register_forward_pre_hook(lambda m, _: starts.__setitem__(id(m), time.process_time()))
        module.register_forward_hook(
            lambda m, _i, _o: timings.seconds.__setitem__(
                name, timings.seconds[name] + time.process_time() - starts[id(m)]
            )
        )

    for layer in model.layers:
        kind = type(layer.attn).__name__
        named(layer.attn, f"forward: {kind}")
        named(layer.mlp, f"forward: {type(layer.mlp).__name__}")
        named(layer.input_norm, "forward: RMSNorm (layers)")
        named(layer.post_attn_norm, "forward: RMSNorm (layers)")
    named(model.lm_head, "forward: lm_head")
    named(model.norm, "forward: final norm")


def matmul_cpu_seconds(config: ModelConfig, dtype: torch.dtype, repeats: int = 20) -> float:
    """CPU seconds of one token's pass through the active weights as plain matmuls (the floor of a step)."""
    shapes = active_weight_shapes(config)
    weights = [torch.randn(o, i).to(dtype) for o, i in shapes]
    inputs = [torch.randn(1, i).to(dtype) for _, i in shapes]
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for w, x in zip(weights, inputs, strict=True):
            torch.nn.functional.linear(x, w)
        best = min(best, time.process_time() - start)
    return best


def profile(args: argparse.Namespace, directory: Path, prompt: list[int]) -> None:
    torch.set_num_threads(args.threads[0])
    dtype, compiled = args.dtypes[0], args.variants[0] == "compiled"
    engine = one_stream_engine(directory, dtype, args.prompt_len + args.new_tokens, compiled=compiled)
    stream_run(engine, prompt, 8)
    timings = Timings()
    scheduler, runner = engine._scheduler, engine._runner
    _wrap(engine, "step", timings, "engine.step (all)")
    _wrap(scheduler, "schedule", timings, "scheduler.schedule")
    _wrap(runner, "run", timings, "runner.run")
    _wrap(runner, "_forward", timings, "runner._forward (ledger + model.forward)")
    _wrap(runner.model, "forward", timings, "model.forward (executor)")
    _wrap(runner, "_sample", timings, "runner._sample")
    _wrap(engine, "_postprocess", timings, "engine._postprocess")
    _wrap(scheduler, "postprocess", timings, "scheduler.postprocess")
    executor = runner.model
    assert isinstance(executor, ModelExecutor)
    _wrap(executor.model, "forward", timings, f"{type(executor.model).__name__}.forward")
    if executor.decode_graph is not None:  # the modules run inside the graph: no hooks fire there
        _wrap(executor.decode_graph, "forward", timings, "DecodeGraph.forward (compiled)")
    _hook_modules(executor.model, timings)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(Request("timed", tuple(prompt), params))
    engine.step()  # the prefill and first token, not counted
    timings.seconds.clear()
    steps, wall = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    wall = time.perf_counter() - wall
    total = timings.seconds["engine.step (all)"]
    print(
        f"{dtype}, {args.threads[0]} threads, {args.variants[0]}, {steps} decode steps: "
        f"{steps / total:.1f} tok per CPU second"
    )
    print(f"{'part (CPU ms per decode step)':48} {'ms':>7} {'share':>6}")
    for name, seconds in sorted(timings.seconds.items(), key=lambda kv: -kv[1]):
        print(f"{name:48} {seconds / steps * 1e3:>7.3f} {seconds / total:>6.1%}")
    print(f"(wall {wall / steps * 1e3:.3f} ms per step on this machine as loaded now)")
    if isinstance(executor.model, KimiLinearModel):  # (active_weight_shapes reads Kimi's config)
        floor = matmul_cpu_seconds(executor.model.config, executor.model.weight_dtype)
        print(f"the active weights as plain [1, in] x [in, out] matmuls: {floor * 1e3:.3f} CPU ms per token")
        if executor.decode_graph is None:
            _ops_per_call(engine, prompt, executor.model)
    _operator_table(engine, prompt, args)


class _OpCounter(TorchDispatchMode):
    """Counts the torch operators dispatched under it into ``counts[owner()]``."""

    def __init__(self, counts: dict[str, int], owner: Callable[[], str]) -> None:
        super().__init__()
        self.counts, self.owner = counts, owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[self.owner()] += 1
        return func(*args, **(kwargs or {}))


def _ops_per_call(engine: Engine, prompt: list[int], model: KimiLinearModel) -> None:
    """Torch operators per module call in one eager decode step, each a dispatch (1-3 µs whatever its
    size: the eager step's fixed cost); the C kernels called through ctypes are not counted."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request(Request("counted", tuple(prompt), params))
    engine.step()  # the prefill and first token
    kinds = {id(m): type(m).__name__ for layer in model.layers for m in (layer.attn, layer.mlp, layer.input_norm)}
    kinds |= {id(layer.post_attn_norm): "RMSNorm" for layer in model.layers}
    running: list[str] = ["outside the layers' modules"]
    counts: dict[str, int] = defaultdict(int)
    calls: dict[str, int] = defaultdict(int)

    def enter(module: torch.nn.Module, _inputs: Any) -> None:
        running.append(kinds[id(module)])

    def leave(module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        calls[running.pop()] += 1

    modules = [m for layer in model.layers for m in (layer.attn, layer.mlp, layer.input_norm, layer.post_attn_norm)]
    handles = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    with _OpCounter(counts, lambda: running[-1]):
        engine.step()
    for handle in handles:
        handle.remove()
    while engine.has_unfinished():
        engine.step()
    print(f"\ntorch operators in one eager decode step: {sum(counts.values())}")
    for name, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        per_call = f", {count / calls[name]:.0f} per call ({calls[name]} calls)" if calls[name] else ""
        print(f"  {name:30} {count:>5}{per_call}")


def _operator_table(engine: Engine, prompt: list[int], args: argparse.Namespace) -> None:
    """The torch profiler's operators over decode steps only (the prefill step runs unprofiled)."""
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(Request("profiled", tuple(prompt), params))
    engine.step()  # the prefill and first token
    steps = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished():
            engine.step()
            steps += 1
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.op_rows)
    print(f"\ntorch profiler, {steps} decode steps (times include profiler overhead):\n{table}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="medium", choices=MODEL_NAMES)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--variants", nargs="+", default=["eager", "compiled"], choices=["eager", "layers", "compiled"])
    parser.add_argument("--profile", action="store_true", help="where a decode step goes (first dtype/threads/variant)")
    parser.add_argument("--op-rows", type=int, default=25)
    args = parser.parse_args()
    directory = bench_model(args.model, Path(tempfile.gettempdir()) / "metrale-bench")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 512, (args.prompt_len,), generator=g).tolist()
    print(f"model={args.model} prompt={args.prompt_len} new_tokens={args.new_tokens} repeats={args.repeats}")
    if args.profile:
        profile(args, directory, prompt)
    else:
        compare(args, directory, prompt)


if __name__ == "__main__":
    main()
