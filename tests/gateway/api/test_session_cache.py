"""A session is a pure cache: the same greedy chat gives the same text turn for turn with and without
one, on real workers and a real Redis (one, and a Redis Cluster) — also on a model whose replies
re-tokenize differently — and the ``retokenized`` count says how often the previous reply's checkpoint
could not be used."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis.asyncio
from transformers import AutoTokenizer

from metrale.gateway.app import create_app
from metrale.shared.record import read_record
from metrale.shared.redis_connect import connect_async
from metrale.worker.model.builtin import builtin_model_dir
from tests.gateway.api.test_sessions import MODEL, Fleet

pytestmark = pytest.mark.anyio

TURNS = 6
QUESTIONS = [
    "Tell me about the sea.",
    "And the lighthouse keeper?",
    "What does he eat for breakfast?",
    "Does he ever leave the island?",
    "Write him a short poem.",
    "Thank you, goodbye.",
]


@dataclasses.dataclass
class Turn:
    reply: str
    reply_ids: list[int]
    prompt_tokens: int
    cached_tokens: int


async def _chat(fleet: Fleet, session: str | None) -> tuple[list[Turn], dict[str, Any] | None]:
    """Six greedy turns, each on a freshly started worker (``a``, ``b``, ``a``, …); with ``session``,
    also the session as ``GET /v1/sessions/{id}`` shows it at the end."""
    client = cast(redis.asyncio.Redis, connect_async(fleet.redis_url))  # a cluster's answers the same calls
    app = create_app(fleet.gateway_settings(), client)
    turns: list[Turn] = []
    messages: list[dict[str, str]] = [{"role": "system", "content": "You keep a lighthouse log."}]
    headers = {"X-Session-Id": session} if session is not None else {}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=120) as http,
    ):
        with fleet.worker("worker-a"):
            for question in QUESTIONS[:TURNS]:
                messages.append({"role": "user", "content": question})
                body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0.0}
                response = await http.post("/v1/chat/completions", json=body, headers=headers)
                assert response.status_code == 200, response.text
                data = response.json()
                record = read_record(fleet.sync, data["id"], keys=fleet.keys)
                assert record is not None
                reply = data["choices"][0]["message"]["content"]
                usage = data["usage"]
                reply_ids = [t for event in record.events for t in event.token_ids]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                turns.append(Turn(reply, reply_ids, usage["prompt_tokens"], cached))
                messages.append({"role": "assistant", "content": reply})
            metrics = await _retokenized_metric(http) if session is not None else None
        shown = None
        if session is not None:
            answer = await http.get(f"/v1/sessions/{session}")
            assert answer.status_code == 200, answer.text
            shown = {**answer.json(), "metrics_retokenized": metrics}
    await client.aclose()
    return turns, shown


async def _retokenized_metric(http: httpx.AsyncClient) -> float:
    """``metrale_checkpoint_retokenized_total`` once the worker's counters reached Redis (with its
    next heartbeat) and are unchanged for a beat."""
    seen: list[float] = []
    for _ in range(60):
        text = (await http.get("/metrics")).text
        match = re.search(r"^metrale_checkpoint_retokenized_total (\S+)$", text, re.MULTILINE)
        lookups = re.search(r"^metrale_checkpoint_lookups_total (\S+)$", text, re.MULTILINE)
        if match and lookups and float(lookups.group(1)) >= TURNS:
            seen.append(float(match.group(1)))
            if len(seen) >= 2 and seen[-1] == seen[-2]:
                return seen[-1]
        await asyncio.sleep(0.5)
    raise AssertionError("the checkpoint counters did not reach /metrics")


def _reference(model_dir: Path, turns: list[Turn]) -> tuple[list[bool], list[int]]:
    """By transformers: for each turn after the first, whether its prompt does not begin with the
    previous prompt plus the previous reply as generated (but its last, never consumed, token); and for
    every turn, how many of its prompt's tokens lie up to its last special token (no later text can
    re-tokenize those)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    special = set(tokenizer.all_special_ids) | {
        int(i) for i, token in tokenizer.added_tokens_decoder.items() if token.special
    }
    messages: list[dict[str, str]] = [{"role": "system", "content": "You keep a lighthouse log."}]
    prompts: list[list[int]] = []
    for question, turn in zip(QUESTIONS, turns, strict=True):
        messages.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        messages.append({"role": "assistant", "content": turn.reply})
    retokenized = []
    for k in range(1, len(turns)):
        consumed = [*prompts[k - 1], *turns[k - 1].reply_ids[:-1]]
        retokenized.append(prompts[k][: len(consumed)] != consumed)
    settled = [max(at + 1 for at, token in enumerate(prompt) if token in special) for prompt in prompts]
    return retokenized, settled


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny-random", "builtin"])
async def test_a_session_never_changes_a_greedy_answer(any_redis_url: str, tiny_model_dir: Path, which: str) -> None:
    model_dir = tiny_model_dir if which == "tiny-random" else builtin_model_dir()
    fleet = Fleet(any_redis_url, model_dir, checkpoints=True)
    try:
        with_session, shown = await _chat(fleet, "cache-1")
        without, _ = await _chat(fleet, None)
    finally:
        fleet.close()
    assert [t.reply for t in with_session] == [t.reply for t in without]
    assert [t.prompt_tokens for t in with_session] == [t.prompt_tokens for t in without]
    assert all(t.cached_tokens > 0 for t in with_session[1:]), [t.cached_tokens for t in with_session]
    retokenized, settled = _reference(model_dir, with_session)
    assert shown is not None and shown["retokenized"] == shown["metrics_retokenized"] == sum(retokenized)
    for k in range(1, TURNS):
        previous = with_session[k - 1]
        # At least the previous prompt up to its last special token (always checkpointed); all of the
        # previous turn but its last token when the reply re-tokenized as generated.
        assert with_session[k].cached_tokens >= settled[k - 1]
        if not retokenized[k - 1]:
            assert with_session[k].cached_tokens == previous.prompt_tokens + len(previous.reply_ids) - 1
    if which == "tiny-random":
        assert sum(retokenized) > 0, "the random-weight model is here for its replies that re-tokenize differently"
    print(f"{which}: {sum(retokenized)} of {TURNS - 1} replies re-tokenized differently, cached", end=" ")
    print([t.cached_tokens for t in with_session], "of", [t.prompt_tokens for t in with_session])
