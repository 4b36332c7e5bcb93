"""Speculative decoding through the official ``openai`` client against a real ``met serve`` started with
``--speculative-config`` (the built-in model): 20 seeded chats answered with speculation equal the same
20 with ``"speculative": false``, token for token; ``/metrics`` shows no draft for the latter and the
drafts verified for the former; ``met bench`` reports the acceptance of the drafts its load caused."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.worker.model.builtin import builtin_model_dir
from tests.integration.deployments import Endpoint, serving_model

pytestmark = pytest.mark.slow

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
CHATS = 20
MAX_TOKENS = 32
TEMPERATURE = 0.8
HEARTBEAT_EVERY_S = 10 / 3
"""Workers add their counters to Redis with each heartbeat: every third of MET_HEARTBEAT_TTL_S (10 s)."""
COUNTERS_DEADLINE_S = 30.0

CODE = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef "
TOPICS = ("fibonacci", "parse a CSV line", "reverse a list", "read a file", "merge two dicts")


def _messages(i: int) -> list[ChatCompletionMessageParam]:
    """Chats whose answers repeat their prompt's text now and then, so that n-gram drafts get accepted."""
    return [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": f"{TOPICS[i % len(TOPICS)]}:\n{CODE * (1 + i % 3)}"},
    ]


@pytest.fixture(scope="module")
def endpoint(integration_dir: Path) -> Iterator[Endpoint]:
    options = ("--speculative-config", NGRAM)
    with serving_model(integration_dir, builtin_model_dir(), tenant="speculation", options=options) as served:
        yield served


def _chat(client: openai.OpenAI, endpoint: Endpoint, i: int, *, speculative: bool) -> ChatCompletion:
    extra = {} if speculative else {"speculative": False}
    return client.chat.completions.create(
        model=endpoint.model,
        messages=_messages(i),
        max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE,
        seed=i,
        logprobs=True,
        extra_body=extra,
    )


def _speculation_counters(endpoint: Endpoint) -> tuple[float, float]:
    """``metrale_spec_decode_num_draft_tokens_total`` and ``..._num_accepted_tokens_total`` now (the
    fleet's since it started: a test compares two reads)."""
    text = httpx.get(f"{endpoint.base_url}/metrics", timeout=10).text

    def value(name: str) -> float:
        found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        assert found is not None, f"{name} is not in /metrics"
        return float(found.group(1))

    return value("metrale_spec_decode_num_draft_tokens_total"), value("metrale_spec_decode_num_accepted_tokens_total")


def test_twenty_seeded_chats_are_the_same_with_speculation_and_without(endpoint: Endpoint) -> None:
    client = openai.OpenAI(base_url=f"{endpoint.base_url}/v1", api_key=endpoint.api_key, max_retries=0, timeout=120)
    with client:
        before = _speculation_counters(endpoint)
        plain = [_chat(client, endpoint, i, speculative=False).choices[0] for i in range(CHATS)]
        time.sleep(HEARTBEAT_EVERY_S + 1)  # had they been drafted for, the counters would show it by now
        assert _speculation_counters(endpoint) == before
        drafted = [_chat(client, endpoint, i, speculative=True).choices[0] for i in range(CHATS)]
    for i, (got, want) in enumerate(zip(drafted, plain, strict=True)):
        assert (got.message.content, got.finish_reason) == (want.message.content, want.finish_reason), f"chat {i}"
        assert got.logprobs is not None and got.logprobs.content is not None
        assert want.logprobs is not None and want.logprobs.content is not None
        assert [t.token for t in got.logprobs.content] == [t.token for t in want.logprobs.content], f"chat {i}"
        # bitwise: a verify row's logits are the bits of the same position decoded alone
        assert [t.logprob for t in got.logprobs.content] == [t.logprob for t in want.logprobs.content], f"chat {i}"
    deadline = time.monotonic() + COUNTERS_DEADLINE_S
    while (counts := _speculation_counters(endpoint))[0] == before[0] and time.monotonic() < deadline:
        time.sleep(0.5)
    draft_tokens, accepted_tokens = counts[0] - before[0], counts[1] - before[1]
    assert draft_tokens > 0
    assert 0 <= accepted_tokens <= draft_tokens


def test_met_bench_reports_the_acceptance_of_the_drafts_it_caused(endpoint: Endpoint) -> None:
    args = ["bench", "--url", endpoint.base_url, "--model", endpoint.model, "--api-key", endpoint.api_key]
    args += ["--num-prompts", "4", "--input-len", "32", "--output-len", "24", "--concurrency", "4", "--json"]
    before = _speculation_counters(endpoint)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    drafted = json.loads(result.output)["spec_decode"]
    after = _speculation_counters(endpoint)  # settled: bench waited for the workers' counters
    assert (drafted["draft_tokens"], drafted["accepted_tokens"]) == (after[0] - before[0], after[1] - before[1])
    assert drafted["draft_tokens"] > 0
    assert drafted["acceptance_rate"] == pytest.approx(drafted["accepted_tokens"] / drafted["draft_tokens"])
