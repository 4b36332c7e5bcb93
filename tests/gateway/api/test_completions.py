from __future__ import annotations

from typing import Any

import pytest

from metrale.text.builtin_tokenizer import BOS_ID
from tests.gateway.fake_worker import fake_alternatives, fake_logprob
from tests.gateway.harness import MODEL, REPLY_TEXT, announcement, encode, gateway_harness, sse_payloads, token_text

pytestmark = pytest.mark.anyio

PROMPT = "Numbers mattered in her work."


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, **extra}


@pytest.mark.parametrize(
    ("prompt", "expected_ids"),
    [
        pytest.param(PROMPT, [BOS_ID, *encode(PROMPT)], id="text-gets-bos"),
        pytest.param([PROMPT], [BOS_ID, *encode(PROMPT)], id="list-of-one-text"),
        pytest.param([5, 6, 7], [5, 6, 7], id="token-ids-as-given"),
    ],
)
async def test_prompts_as_text_or_token_ids(prompt: Any, expected_ids: list[int]) -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/completions", json=completion(prompt=prompt))
        (request,) = h.worker.requests
    assert response.status_code == 200
    assert request.prompt_token_ids == expected_ids
    assert request.max_tokens == 16  # OpenAI's default for completions


async def test_a_completion_is_answered_whole() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/completions", json=completion(max_tokens=50))
        (request,) = h.worker.requests
    body = response.json()
    assert body["id"] == request.request_id and body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": REPLY_TEXT, "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["prompt_tokens"] == len(request.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(encode(REPLY_TEXT)) + 1


async def test_a_streamed_completion_adds_up_to_the_text() -> None:
    async with gateway_harness() as h:
        response = await h.http.post(
            "/v1/completions", json=completion(max_tokens=50, stream=True, stream_options={"include_usage": True})
        )
    *chunks, usage_chunk = sse_payloads(response.text)
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == REPLY_TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(encode(REPLY_TEXT)) + 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_completion_logprobs_use_the_legacy_format(stream: bool) -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/completions", json=completion(logprobs=1, max_tokens=4, stream=stream))
        (request,) = h.worker.requests
    assert request.logprobs == 1
    reply = encode(REPLY_TEXT)[:4]
    tokens = [token_text(token) for token in reply]
    if stream:
        parts = [chunk["choices"][0]["logprobs"] for chunk in sse_payloads(response.text)]
        logprobs = {key: [value for part in parts if part for value in part[key]] for key in parts[0]}
    else:
        logprobs = response.json()["choices"][0]["logprobs"]
    vocab = announcement().vocab_size
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"] == [fake_logprob(position) for position in range(4)]
    assert logprobs["text_offset"] == [sum(len(token) for token in tokens[:i]) for i in range(4)]
    assert logprobs["top_logprobs"] == [
        {token_text(alt): lp for alt, lp in fake_alternatives(token, position, 1, vocab)}
        | {tokens[position]: fake_logprob(position)}
        for position, token in enumerate(reply)
    ]


async def test_a_stop_string_cuts_a_completion() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/completions", json=completion(max_tokens=50, stop="before"))
    (choice,) = response.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("The lighthouse keeper woke ", "stop")
