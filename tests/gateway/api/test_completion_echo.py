"""``/v1/completions`` for evaluation: ``echo`` (``max_tokens`` 0 too), the prompt's logprobs leading
``logprobs`` (the first ``null``), lists of prompts (choice ``i * n + j``), vLLM's ``prompt_logprobs``,
and the work bound counting all of them."""

from __future__ import annotations

from typing import Any

import pytest

from metrale.shared.settings import RequestLimits
from metrale.text.builtin_tokenizer import BOS_ID
from tests.gateway.fake_worker import fake_alternatives, fake_logprob, fake_prompt_logprob
from tests.gateway.harness import (
    MODEL,
    REPLY_TEXT,
    announcement,
    choice_text,
    encode,
    gateway_harness,
    sse_payloads,
    token_text,
)

pytestmark = pytest.mark.anyio

PROMPT = "Numbers mattered in her work."
LM_EVAL = {"prompt": [[313, 244, 7, 64]], "echo": True, "logprobs": 1, "max_tokens": 0}
"""What lm-evaluation-harness sends for a loglikelihood request over token ids (ids of this vocabulary)."""


def offsets(tokens: list[str]) -> list[int]:
    return [sum(len(token) for token in tokens[:i]) for i in range(len(tokens))]


def prompt_top(ids: list[int], count: int) -> list[dict[str, float] | None]:
    """The ``top_logprobs`` the fake worker's prompt logprobs render to (``null`` first)."""
    vocab = announcement().vocab_size
    return [None] + [
        {token_text(alt): lp for alt, lp in fake_alternatives(ids[p], p, count, vocab)}
        | {token_text(ids[p]): fake_prompt_logprob(p)}
        for p in range(1, len(ids))
    ]


async def test_the_lm_eval_loglikelihood_request_gets_the_prompt_and_its_logprobs() -> None:
    async with gateway_harness() as h:
        response = await h.http.post("/v1/completions", json={"model": MODEL, **LM_EVAL})
        (request,) = h.worker.requests
    assert response.status_code == 200, response.text
    ids = [313, 244, 7, 64]
    assert (request.prompt_token_ids, request.max_tokens, request.prompt_logprobs) == (ids, 1, 1)
    (choice,) = response.json()["choices"]
    tokens = [token_text(token) for token in ids]
    assert choice["text"] == "".join(tokens)
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": tokens,
        "token_logprobs": [None, *(fake_prompt_logprob(p) for p in range(1, 4))],
        "top_logprobs": prompt_top(ids, 1),
        "text_offset": offsets(tokens),
    }
    assert "prompt_logprobs" not in choice
    assert response.json()["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_echo_with_logprobs_puts_the_prompt_before_the_generated_tokens(stream: bool) -> None:
    async with gateway_harness() as h:
        body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "stream": stream}
        response = await h.http.post("/v1/completions", json=body)
    ids = [BOS_ID, *encode(PROMPT)]
    reply = encode(REPLY_TEXT)[:3]
    if stream:
        choices = [chunk["choices"][0] for chunk in sse_payloads(response.text)]
        text = "".join(choice["text"] for choice in choices)
        parts = [choice["logprobs"] for choice in choices if choice["logprobs"]]
        logprobs = {key: [value for part in parts for value in part[key]] for key in parts[0]}
        assert choices[0]["text"].startswith(PROMPT)  # the echo comes with the first chunk
    else:
        (choice,) = response.json()["choices"]
        text, logprobs = choice["text"], choice["logprobs"]
    tokens = [token_text(token) for token in [*ids, *reply]]
    assert text == PROMPT + "".join(token_text(token) for token in reply)
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"] == [
        None,
        *(fake_prompt_logprob(p) for p in range(1, len(ids))),
        *(fake_logprob(p) for p in range(3)),
    ]
    assert logprobs["top_logprobs"][: len(ids)] == prompt_top(ids, 2)
    assert logprobs["text_offset"] == offsets(tokens)


async def test_echo_without_logprobs_asks_the_worker_for_nothing_more() -> None:
    async with gateway_harness() as h:
        body = {"model": MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 50}
        response = await h.http.post("/v1/completions", json=body)
        (request,) = h.worker.requests
    assert request.prompt_logprobs is None
    (choice,) = response.json()["choices"]
    assert (choice["text"], choice["logprobs"]) == (PROMPT + REPLY_TEXT, None)


TEXTS = ["First prompt.", "Second, longer prompt.", "Third one."]
ID_LISTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("prompts", [TEXTS, ID_LISTS], ids=["texts", "token-id-lists"])
async def test_a_list_of_prompts_gets_n_choices_each_in_order(stream: bool, prompts: list[Any]) -> None:
    async with gateway_harness() as h:
        body = {"model": MODEL, "prompt": prompts, "n": 2, "echo": True, "max_tokens": 40, "stream": stream}
        body |= {"stream_options": {"include_usage": True}} if stream else {}
        response = await h.http.post("/v1/completions", json=body)
        requests = sorted(h.worker.requests, key=lambda request: request.request_id)
    assert response.status_code == 200, response.text
    texts_sent = isinstance(prompts[0], str)
    assert [request.prompt_token_ids for request in requests] == [
        [BOS_ID, *encode(prompt)] if texts_sent else prompt for prompt in prompts
    ]
    echoed = prompts if texts_sent else ["".join(token_text(t) for t in prompt) for prompt in prompts]
    if stream:
        *chunks, usage_chunk = sse_payloads(response.text)
        texts = [""] * 6
        for chunk in chunks:
            (choice,) = chunk["choices"]
            texts[choice["index"]] += choice["text"]
        usage = usage_chunk["usage"]
    else:
        choices = response.json()["choices"]
        assert [choice["index"] for choice in choices] == list(range(6))
        texts = [choice["text"] for choice in choices]
        usage = response.json()["usage"]
    assert texts == [echoed[i // 2] + choice_text(i % 2) for i in range(6)]
    assert usage["prompt_tokens"] == sum(len(request.prompt_token_ids) for request in requests)
    assert usage["completion_tokens"] == sum(len(encode(choice_text(i % 2))) + 1 for i in range(6))


async def test_vllm_prompt_logprobs_ride_on_each_choice() -> None:
    async with gateway_harness() as h:
        body = {"model": MODEL, "prompt": [9, 10, 11], "prompt_logprobs": 2, "n": 2, "max_tokens": 2}
        response = await h.http.post("/v1/completions", json=body)
        (request,) = h.worker.requests
    assert request.prompt_logprobs == 2
    vocab = announcement().vocab_size
    ids = [9, 10, 11]
    expected: list[Any] = [None]
    for p in (1, 2):
        alternatives = fake_alternatives(ids[p], p, 2, vocab)  # the prompt token is the first: rank 1
        entry = {str(ids[p]): {"logprob": fake_prompt_logprob(p), "rank": 1, "decoded_token": token_text(ids[p])}}
        for rank, (alt, lp) in enumerate(alternatives, start=1):
            entry.setdefault(str(alt), {"logprob": lp, "rank": rank, "decoded_token": token_text(alt)})
        expected.append(entry)
    choices = response.json()["choices"]
    assert [choice["prompt_logprobs"] for choice in choices] == [expected, expected]
    assert all(choice["logprobs"] is None for choice in choices)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"prompt": [[1] * 40] * 4, "max_tokens": 1}, "prompt", id="prompts-x-max-tokens"),
        pytest.param(
            {"prompt": [1] * 40, "max_tokens": 1, "prompt_logprobs": 20}, "prompt_logprobs", id="prompt-logprobs"
        ),
        pytest.param(
            {"prompt": [1] * 40, "max_tokens": 0, "echo": True, "logprobs": 20}, "logprobs", id="echo-logprobs"
        ),
    ],
)
async def test_the_work_bound_counts_prompts_and_their_logprobs(body: dict[str, Any], param: str) -> None:
    async with gateway_harness(request_limits=RequestLimits(max_request_work=100)) as h:
        if param == "prompt":
            body = {**body, "max_tokens": 30}
        response = await h.http.post("/v1/completions", json={"model": MODEL, **body})
        assert h.worker.requests == []
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert "MET_MAX_REQUEST_WORK" in response.json()["error"]["message"]


async def test_a_list_of_prompts_is_admitted_as_that_many_requests() -> None:
    async with gateway_harness(max_queue=1, worker_running=False) as h:
        response = await h.http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b", "c"]})
    assert response.status_code == 429, response.text


async def test_chat_prompt_logprobs_ride_on_the_response_as_in_vllm() -> None:
    async with gateway_harness() as h:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0}
        response = await h.http.post("/v1/chat/completions", json=body)
        (request,) = h.worker.requests
        streamed = await h.http.post("/v1/chat/completions", json={**body, "stream": True})
    assert request.prompt_logprobs == 0
    ids = request.prompt_token_ids
    entries = response.json()["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert [entry[str(ids[p])]["logprob"] for p, entry in enumerate(entries) if entry] == [
        fake_prompt_logprob(p) for p in range(1, len(ids))
    ]
    assert "prompt_logprobs" not in response.json()["choices"][0]
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
