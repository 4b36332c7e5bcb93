"""Prompt logprobs from the prefill that fills the state: equal to the logits of each prompt prefix
scored on their own, through chunked prefill, preemption restarts and ``n > 1``, reported once each."""

from __future__ import annotations

import math

import pytest
import torch

from metrale.worker.engine.engine import Engine
from metrale.worker.engine.prompt_logprobs import score_rows
from metrale.worker.engine.request import Request, ResumePoint
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.scheduler.config import SchedulerConfig
from tests.worker.fakes import RecordingModel

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15, 16]]
AMPLE = SchedulerConfig(max_batch_tokens=64, max_seqs=4, num_slots=4, num_blocks=64, block_size=4, max_model_len=16)
CHUNKED = SchedulerConfig(max_batch_tokens=4, max_seqs=4, num_slots=4, num_blocks=64, block_size=4, max_model_len=16)
RESTARTING = SchedulerConfig(max_batch_tokens=4, max_seqs=4, num_slots=2, num_blocks=6, block_size=4, max_model_len=16)


def reference(model: RecordingModel, prompt: list[int], top: int) -> tuple[list[float], list[list[int]]]:
    """Each prompt token's logprob after the tokens before it, scored one prefix at a time, and the
    ids of that position's ``top`` best tokens."""
    logprobs, tops = [], []
    for position in range(1, len(prompt)):
        row = torch.log_softmax(model.clean_logits(prompt[:position]).float(), dim=-1)
        logprobs.append(float(row[prompt[position]]))
        tops.append(sorted(range(row.shape[0]), key=lambda token: (-float(row[token]), token))[:top])
    return logprobs, tops


@pytest.mark.parametrize("config", [AMPLE, CHUNKED, RESTARTING], ids=["whole", "chunked", "restarting"])
@pytest.mark.parametrize("n", [1, 2])
def test_prompt_logprobs_equal_each_prefix_scored_alone(config: SchedulerConfig, n: int) -> None:
    model = RecordingModel(config.num_slots, config.num_blocks, config.block_size)
    engine = Engine(model, config, eos_token_ids=[30])
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=3, n=n, prompt_logprobs=2)
    results = engine.generate(PROMPTS, params)
    if config is RESTARTING:
        assert engine.stats().restarts > 0  # the prefill of some prompt ran twice
    for prompt, result in zip(PROMPTS, results, strict=True):
        expected, expected_top = reference(model, prompt, 2)
        assert result.prompt_logprobs == pytest.approx(expected, abs=1e-6)
        assert [[token for token, _ in top] for top in result.prompt_top_logprobs] == expected_top
        assert all(len(completion.token_ids) == 6 for completion in result.completions)


def test_prompt_logprobs_come_before_the_first_token_and_only_for_choice_0() -> None:
    model = RecordingModel(CHUNKED.num_slots, CHUNKED.num_blocks, CHUNKED.block_size)
    engine = Engine(model, CHUNKED)
    engine.add_request(Request("r", tuple(PROMPTS[0]), SamplingParams(max_tokens=2, n=2, prompt_logprobs=0)))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    scored = [output for output in outputs if output.prompt_logprobs is not None]
    first_token = next(i for i, output in enumerate(outputs) if output.token_ids)
    assert all(outputs.index(output) < first_token for output in scored)
    assert all(output.choice == 0 and not output.token_ids and not output.finished for output in scored)
    starts = [output.prompt_logprobs.start for output in scored if output.prompt_logprobs is not None]
    assert starts == [1, 5, 9]  # chunks of 4: [0, 4) scores 1-4, [4, 8) 5-8, [8, 10) 9
    assert all(top == () for output in scored if output.prompt_logprobs for top in output.prompt_logprobs.top_logprobs)


def test_decode_rows_and_requests_without_prompt_logprobs_ask_for_one_row_per_chunk() -> None:
    asked: list[bool] = []

    class Watching(RecordingModel):
        def forward(self, chunks):  # type: ignore[no-untyped-def]
            asked.extend(chunk.every_row for chunk in chunks)
            return super().forward(chunks)

    model = Watching(AMPLE.num_slots, AMPLE.num_blocks, AMPLE.block_size)
    engine = Engine(model, AMPLE)
    engine.generate([PROMPTS[0]], SamplingParams(max_tokens=3, prompt_logprobs=1))
    assert asked == [True, False, False]  # the prefill; the two decode rows
    asked.clear()
    engine.generate([PROMPTS[0]], SamplingParams(max_tokens=3))
    assert asked == [False, False, False]


def test_a_request_resumed_from_a_checkpoint_cannot_report_its_prompt() -> None:
    engine = Engine(RecordingModel(4, 64, 4), AMPLE)
    resume = ResumePoint(4, {"tokens": torch.tensor([1, 2, 3, 4])})
    request = Request("r", tuple(PROMPTS[0]), SamplingParams(prompt_logprobs=1), resume=resume)
    with pytest.raises(ValueError, match="from position 0"):
        engine.add_request(request)


def test_score_rows_equals_a_row_at_a_time() -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0)) * 3
    logits[2, 4] = logits[2, 7] = 9.0  # a tie: the lower id first
    targets = [3, 0, 7, 10, 1]
    chosen, top = score_rows(logits, targets, 3)
    for row, target, logprob, alternatives in zip(logits, targets, chosen, top, strict=True):
        exact = row.double() - torch.logsumexp(row.double(), dim=0)
        assert math.isclose(logprob, float(exact[target]), abs_tol=1e-5)
        best = sorted(range(11), key=lambda token: (-float(exact[token]), token))[:3]
        assert [token for token, _ in alternatives] == best
    assert top[2][:2] == ((4, top[2][0][1]), (7, top[2][0][1]))
