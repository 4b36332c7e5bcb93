"""A batch of decode rows with a Kimi-Linear model's layers as one C call and one by one, alternating in one
engine: the whole-stack call (``families.kimi_linear_decode``) against the layer-by-layer path.

    python bench/decode_layers_ab.py [--model medium-4-heads] [--streams 32] [--threads 2] [--rounds 8]
                                     [--steps 10]

``--streams`` greedy requests of 128-token prompts are added and prefilled; then, ``--rounds`` times, ``--steps``
decode steps run with the call on and ``--steps`` with it off (the order alternating by round). Reported:
the median CPU and wall milliseconds a step of each. The machine is shared: read the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import MODEL_NAMES, bench_model
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.engine.request import Request
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.families.kimi_linear import KimiLinearModel

PROMPT_TOKENS = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="medium-4-heads", choices=MODEL_NAMES)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    max_len = PROMPT_TOKENS + 2 * args.rounds * args.steps + 16
    limits = EngineLimits(
        max_seqs=args.streams,
        max_batch_tokens=4096,
        num_blocks=args.streams * -(-max_len // 16),
        max_model_len=max_len,
    )
    directory = bench_model(args.model, Path(tempfile.gettempdir()) / "metrale-bench")
    loaded = build_engine(directory, limits, dtype="float32", seed=0)
    engine, model = loaded.engine, loaded.executor.model
    if not isinstance(model, KimiLinearModel):
        raise SystemExit("only a Kimi-Linear model runs its decode layers as one C call")
    params = SamplingParams(max_tokens=max_len - PROMPT_TOKENS, temperature=0.0, ignore_eos=True)
    for i in range(args.streams):
        prompt = tuple((j * 31 + i) % 200 + 10 for j in range(PROMPT_TOKENS))
        engine.add_request(Request(f"stream-{i}", prompt, params))
    for _ in range(6):  # the prefills, then a few decode steps
        engine.step()
    fused = model._fused_layers()
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for on in (True, False) if round_ % 2 else (False, True):
            fused.fits = on
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[on].append(((time.process_time() - cpu) / args.steps, (time.perf_counter() - wall) / args.steps))
    fused.fits = True
    for on, name in ((True, "one C call"), (False, "layer by layer")):
        cpu_ms = statistics.median(t[0] for t in times[on]) * 1e3
        wall_ms = statistics.median(t[1] for t in times[on]) * 1e3
        label = f"{args.streams} streams, {args.threads} threads, {name:>14}"
        print(f"{label}: {cpu_ms:.2f} CPU ms, {wall_ms:.2f} wall ms a step")


if __name__ == "__main__":
    main()
