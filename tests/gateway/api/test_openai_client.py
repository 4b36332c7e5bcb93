"""The official ``openai`` client against the gateway app (in process, through httpx's ASGI transport)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from tests.gateway.harness import MODEL, REPLY_TEXT, Harness, encode, gateway_harness

pytestmark = pytest.mark.anyio

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Who keeps the light?"}]


@pytest.fixture
async def harness_and_client() -> AsyncIterator[tuple[Harness, openai.AsyncOpenAI]]:
    async with gateway_harness(api_keys={"sk-test": "acme"}) as h:
        http = httpx.AsyncClient(transport=h.transport)
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="sk-test", http_client=http, max_retries=0)
        yield h, client
        await client.close()


async def test_chat_completion(harness_and_client: tuple[Harness, openai.AsyncOpenAI]) -> None:
    h, client = harness_and_client
    completion = await client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=3)
    assert completion.choices[0].message.content == REPLY_TEXT
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens == len(encode(REPLY_TEXT)) + 1
    assert [(r.tenant, r.seed) for r in h.worker.requests] == [("acme", 3)]


async def test_streamed_chat_completion_with_usage(harness_and_client: tuple[Harness, openai.AsyncOpenAI]) -> None:
    _, client = harness_and_client
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == REPLY_TEXT
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0


async def test_text_completion_with_logprobs(harness_and_client: tuple[Harness, openai.AsyncOpenAI]) -> None:
    _, client = harness_and_client
    completion = await client.completions.create(model=MODEL, prompt="Once", max_tokens=3, logprobs=2)
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert "".join(choice.logprobs.tokens) == choice.text


async def test_models_list(harness_and_client: tuple[Harness, openai.AsyncOpenAI]) -> None:
    _, client = harness_and_client
    models = await client.models.list()
    assert [model.id for model in models.data] == [MODEL]


async def test_errors_become_the_clients_exceptions(harness_and_client: tuple[Harness, openai.AsyncOpenAI]) -> None:
    _, client = harness_and_client
    with pytest.raises(openai.NotFoundError) as not_found:
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    assert bad.value.param == "temperature"
