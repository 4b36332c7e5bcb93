"""The engine on the real tiny model of every family (and the Kimi one against transformers), with preemption
of both kinds forced."""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Completion, Request, RequestOutput
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.family import FamilyModel
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig

NUM_REQUESTS = 64
BLOCK = 16


def _engine(model_dir: Path, *, slots: int, blocks: int, swap_bytes: int, eos: tuple[int, ...]) -> Engine:
    config = SchedulerConfig(
        max_batch_tokens=96,
        max_seqs=slots,
        num_slots=slots,
        num_blocks=blocks,
        block_size=BLOCK,
        swap_space_bytes=swap_bytes,
        max_model_len=blocks * BLOCK,
    )
    executor = ModelExecutor(_loaded(model_dir), num_slots=slots, num_blocks=blocks, block_size=BLOCK)
    return Engine(executor, config, eos_token_ids=eos, seed=0)


@functools.cache
def _loaded(model_dir: Path) -> FamilyModel:
    """Each model loaded once: engines differ in their pools, never in the weights."""
    return load_model(model_dir)


def _run_arrivals(engine: Engine, requests: list[Request], arrival_step: list[int]) -> dict[str, Completion]:
    """Add each request at its arrival step, step until all finish; completions by request id."""
    results = {r.request_id: Completion() for r in requests}
    step = 0
    pending = sorted(zip(arrival_step, range(len(requests)), strict=True))
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            engine.add_request(requests[pending.pop(0)[1]])
        outputs: list[RequestOutput] = engine.step() if engine.has_unfinished() else []
        for output in outputs:
            results[output.request_id].extend(output)
        step += 1
        assert step < 20_000, "the engine stopped making progress"
    return results


@pytest.fixture(scope="module")
def workload(tiny_model_dir: Path) -> tuple[list[Request], list[int]]:
    rng = random.Random(3)
    vocab = 512  # byte-level tokens; never the special ids
    requests = [
        Request(
            f"r{i}",
            tuple(rng.randrange(vocab) for _ in range(rng.randint(3, 90))),
            SamplingParams(max_tokens=rng.randint(4, 40), temperature=0.0),
        )
        for i in range(NUM_REQUESTS)
    ]
    return requests, sorted(rng.randrange(60) for _ in range(NUM_REQUESTS))


@pytest.mark.slow
def test_greedy_under_preemption_matches_transformers_generate(
    tiny_model_dir: Path, workload: tuple[list[Request], list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    requests, arrivals = workload
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    eos = tuple(hf.config.eos_token_id)
    # 8 slots but only 24 blocks (384 tokens) for up to 8 sequences of up to 130 tokens: blocks run out.
    # Swap space for about two short states: some victims swap, the rest restart.
    engine = _engine(tiny_model_dir, slots=8, blocks=24, swap_bytes=2 * 40_000, eos=eos)
    got = _run_arrivals(engine, requests, arrivals)
    stats = engine.stats()
    assert stats.swap_outs > 0 and stats.restarts > 0, stats
    assert stats.free_slots == 8 and stats.free_blocks == 24 and stats.swap_bytes_used == 0
    for request in requests:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([request.prompt_ids]),
                max_new_tokens=request.params.max_tokens,
                do_sample=False,
                eos_token_id=list(eos),
                pad_token_id=hf.config.pad_token_id,
            )
        expected = out[0, len(request.prompt_ids) :].tolist()
        assert got[request.request_id].token_ids == expected, request.request_id


def test_seeded_sampling_is_the_same_alone_batched_and_preempted(family_model_dir: Path) -> None:
    """Over every family: chunked prefill in a crowd, swapped out, restarted: the tokens of a run alone."""
    tiny_model_dir = family_model_dir
    # The Kimi model's workload in full; the other families a smaller one (CI time), preempted all the same.
    count, new_tokens = (12, 24) if family_model_dir.name.startswith("tiny-model") else (8, 16)
    rng = random.Random(5)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    prompts = [tuple(rng.randrange(512) for _ in range(rng.randint(10, 60))) for _ in range(count)]
    requests = [Request(f"s{i}", p, params) for i, p in enumerate(prompts)]

    alone = {}
    for request in requests:
        engine = _engine(tiny_model_dir, slots=2, blocks=64, swap_bytes=0, eos=())
        alone.update(_run_arrivals(engine, [request], [0]))
    batched = _run_arrivals(_engine(tiny_model_dir, slots=12, blocks=128, swap_bytes=0, eos=()), requests, [0] * count)
    swapping = _engine(tiny_model_dir, slots=6, blocks=14, swap_bytes=10**7, eos=())
    swapped = _run_arrivals(swapping, requests, list(range(count)))
    restarting = _engine(tiny_model_dir, slots=6, blocks=14, swap_bytes=0, eos=())
    restarted = _run_arrivals(restarting, requests, list(range(count)))
    assert swapping.stats().swap_outs > 0 and restarting.stats().restarts > 0
    for request in requests:
        expected = alone[request.request_id].token_ids
        assert len(expected) == new_tokens
        for name, run in (("batched", batched), ("swapped", swapped), ("restarted", restarted)):
            assert run[request.request_id].token_ids == expected, (name, request.request_id)


class CountingExecutor(ModelExecutor):
    """Counts the rows every forward feeds."""

    fed: list[int]

    def forward(self, chunks: Sequence[ForwardChunk]) -> torch.Tensor:
        self.fed.extend(len(c.token_ids) for c in chunks)
        return super().forward(chunks)


def test_n4_forks_state_after_one_prefill(family_model_dir: Path) -> None:
    executor = CountingExecutor(load_model(family_model_dir), num_slots=8, num_blocks=64, block_size=BLOCK)
    fed: list[int] = []
    executor.fed = fed
    config = SchedulerConfig(max_seqs=8, num_slots=8, num_blocks=64, block_size=BLOCK, max_model_len=1024)
    engine = Engine(executor, config, seed=0)
    prompt = tuple(range(40, 90))
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=4, ignore_eos=True)
    [result] = engine.generate([prompt], params)
    outputs = [c.token_ids for c in result.completions]
    assert len(outputs) == 4 and all(len(o) == 16 for o in outputs)
    assert len({tuple(o) for o in outputs}) == 4, "choices must be independent"
    # One prefill of the prompt, then one decode row per choice per later token.
    assert sum(fed) == len(prompt) + 4 * 15
