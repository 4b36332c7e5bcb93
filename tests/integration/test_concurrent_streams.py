"""64 streamed completions at once through the real gateway, Redis and worker: every stream carries
exactly its own prompt's greedy continuation, every token once, in order.

The gateway shows tokens as text only, so two checks cover the tokens themselves: each stream's chunks
carry per-token texts (``logprobs: 0``), compared in order with the texts of the offline engine's
token ids; and the request's durable record in Redis (keyed by the response id) holds the token ids,
compared exactly. A token's text alone could not tell apart ids that decode alike (every partial
UTF-8 byte shows as U+FFFD), hence the record.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import redis

from metrale.shared.messages import FinishReason
from metrale.shared.record import RunRecord, RunStatus, read_record
from metrale.worker.engine.factory import LoadedModel
from metrale.worker.engine.sampling_params import SamplingParams
from tests.integration.deployments import Fleet
from tests.integration.reference import offline_outputs, token_texts
from tests.integration.sse import StreamedCompletion, stream_completion

pytestmark = [pytest.mark.slow, pytest.mark.redis]

STREAMS = 64
PROMPT_VOCAB = 500
"""Prompt ids are drawn below this: ordinary tokens of the built-in vocabulary."""


def workload(seed: int) -> list[tuple[list[int], int]]:
    """``STREAMS`` distinct prompts of 4..40 token ids, each with its own max_tokens (8..24)."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(PROMPT_VOCAB) for _ in range(rng.randint(4, 40))], rng.randint(8, 24)) for _ in range(STREAMS)
    ]


async def stream_all(fleet: Fleet, jobs: list[tuple[list[int], int]]) -> list[StreamedCompletion]:
    """Every job as its own streamed, greedy completion, all in flight together."""
    limits = httpx.Limits(max_connections=STREAMS + 8)
    endpoint = fleet.endpoint
    async with httpx.AsyncClient(
        base_url=endpoint.base_url, headers=endpoint.headers, timeout=120, limits=limits
    ) as client:
        bodies = [
            {
                "model": endpoint.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                "stream_options": {"include_usage": True},
            }
            for prompt, max_tokens in jobs
        ]
        return await asyncio.gather(*(stream_completion(client, body) for body in bodies))


def finished_record(client: redis.Redis, fleet: Fleet, request_id: str) -> RunRecord:
    record = read_record(client, request_id, keys=fleet.keys)
    assert record is not None, f"no durable record for {request_id}"
    assert record.status is RunStatus.FINISHED
    return record


def test_64_concurrent_streams_each_carry_exactly_their_own_greedy_tokens(
    any_fleet: Fleet, any_fleet_redis: redis.Redis, reference_model: LoadedModel
) -> None:
    """On one Redis and on a Redis Cluster (``any_fleet``)."""
    fleet, fleet_redis = any_fleet, any_fleet_redis
    jobs = workload(seed=4)
    longest = max(max_tokens for _, max_tokens in jobs)
    greedy = SamplingParams(max_tokens=longest, temperature=0, ignore_eos=True)
    offline = offline_outputs(reference_model, [prompt for prompt, _ in jobs], greedy)
    # Greedy output of a shorter budget is a prefix of a longer one.
    expected = [choices[0].token_ids[:max_tokens] for choices, (_, max_tokens) in zip(offline, jobs, strict=True)]
    assert len({tuple(tokens) for tokens in expected}) == STREAMS, "the prompts must not share a continuation"

    streams = asyncio.run(stream_all(fleet, jobs))

    assert len({stream.request_id for stream in streams}) == STREAMS
    for stream, (prompt, max_tokens), want in zip(streams, jobs, expected, strict=True):
        record = finished_record(fleet_redis, fleet, stream.request_id)
        assert record.token_ids() == want
        assert record.finish_reason is FinishReason.LENGTH and record.is_contiguous
        # One chunk per recorded event, in seq order: nothing dropped, repeated or reordered on the way.
        assert stream.token_texts() == [token_texts(reference_model, event.token_ids) for event in record.events]
        assert [text for chunk in stream.token_texts() for text in chunk] == token_texts(reference_model, want)
        assert stream.done and stream.finish_reasons() == ["length"]
        assert stream.usage is not None
        assert (stream.usage["prompt_tokens"], stream.usage["completion_tokens"]) == (len(prompt), max_tokens)
