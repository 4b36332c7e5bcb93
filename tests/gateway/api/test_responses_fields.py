"""Every field of the official client's ``ResponseCreateParams`` is honoured or refused with an error
naming it, never ignored: each is sent through the ``openai`` client to a gateway (fake worker) with a
value that asks for something, and what the worker was asked or what came back shows it honoured."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, response_create_params

from metrale.shared.messages import GenerateRequest
from metrale.text.tool_calls.hermes import call_text
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MODEL, REPLY_TEXT, Harness, announcement, encode, gateway_harness, token_text

pytestmark = pytest.mark.anyio

TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TWO_CALLS = call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("get_weather", {"city": "Rome"})


def prompt_text(request: GenerateRequest) -> str:
    return "".join(token_text(token) for token in request.prompt_token_ids)


def two_calls_with_tools(request: GenerateRequest, index: int) -> list[int]:
    """Two calls when the prompt declares tools, else the usual reply."""
    return [*encode(TWO_CALLS if "<tools>" in prompt_text(request) else REPLY_TEXT), 516]


Check = Callable[[GenerateRequest, Response], bool]
Refused = tuple[int, str]
"""The status and the ``param`` of the error a value is refused with."""


def calls_in(response: Response) -> int:
    return sum(item.type == "function_call" for item in response.output)


CASES: dict[str, list[tuple[dict[str, Any], Check | Refused]]] = {
    "model": [({}, lambda request, response: request.model == MODEL == response.model)],
    "input": [
        ({"input": [{"role": "developer", "content": "Hush."}]}, lambda r, _: "Hush.<|im_end|>" in prompt_text(r))
    ],
    "instructions": [({"instructions": "Be brief."}, lambda r, _: "system\nBe brief." in prompt_text(r))],
    "max_output_tokens": [({"max_output_tokens": 3}, lambda r, _: r.max_tokens == 3)],
    "temperature": [({"temperature": 0.25}, lambda r, _: r.temperature == 0.25)],
    "top_p": [({"top_p": 0.5}, lambda r, _: r.top_p == 0.5)],
    "metadata": [({"metadata": {"k": "v"}}, lambda _, response: response.metadata == {"k": "v"})],
    "user": [({"user": "end-user-1"}, lambda _, response: response.user == "end-user-1")],
    "safety_identifier": [({"safety_identifier": "s-1"}, lambda _, response: response.safety_identifier == "s-1")],
    "store": [({"store": False}, lambda _, response: response.model_extra == {"store": False})],
    "stream": [({"stream": True}, lambda _, response: response.output_text == REPLY_TEXT)],
    "tools": [
        ({"tools": [TOOL]}, lambda r, response: "get_weather" in prompt_text(r) and calls_in(response) == 2),
        ({"tools": [{**TOOL, "strict": True}]}, lambda r, _: r.grammar is not None),  # auto: calls constrained
    ],
    "tool_choice": [
        ({"tools": [TOOL], "tool_choice": "required"}, lambda r, _: r.grammar is not None),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}},
            lambda r, _: r.grammar is not None,
        ),
        ({"tools": [TOOL], "tool_choice": "none"}, lambda r, response: r.grammar is None and calls_in(response) == 0),
        (
            {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
            (400, "tool_choice"),
        ),
    ],
    "parallel_tool_calls": [
        ({"tools": [TOOL], "parallel_tool_calls": False}, lambda _, response: calls_in(response) == 1)
    ],
    "max_tool_calls": [
        ({"tools": [TOOL], "max_tool_calls": 1}, lambda _, response: calls_in(response) == 1),
        ({"tools": [TOOL], "max_tool_calls": 0}, (400, "max_tool_calls")),
    ],
    "text": [
        ({"text": {"format": {"type": "json_object"}}}, lambda r, _: r.grammar is not None),
        ({"text": {"format": {"type": "text"}}}, lambda r, _: r.grammar is None),
        ({"text": {"verbosity": "low"}}, (400, "text.verbosity")),
    ],
    "include": [
        ({"include": []}, lambda _, response: response.status == "completed"),
        ({"include": ["file_search_call.results"]}, lambda _, response: response.status == "completed"),
        ({"include": ["reasoning.encrypted_content"]}, (400, "include")),
        ({"include": ["message.output_text.logprobs"]}, (400, "include")),
    ],
    "top_logprobs": [({"top_logprobs": 2}, (400, "top_logprobs"))],
    "truncation": [
        ({"truncation": "disabled"}, lambda _, response: response.truncation == "disabled"),
        ({"truncation": "auto"}, (400, "truncation")),
    ],
    "service_tier": [
        ({"service_tier": "default"}, lambda _, response: response.service_tier == "default"),
        ({"service_tier": "flex"}, (400, "service_tier")),
    ],
    "stream_options": [({"stream": True, "stream_options": {"include_obfuscation": True}}, (400, "stream_options"))],
    "previous_response_id": [({"previous_response_id": "resp-unknown"}, (404, "previous_response_id"))],
    # honoured with store (a batch runner's job: tests/gateway/responses/test_background.py)
    "background": [({"background": True, "store": False}, (400, "background"))],
    "background_options": [({"background_options": {"completion_window": "2h"}}, (400, "background_options"))],
    "reasoning": [
        ({"reasoning": {"effort": "high"}}, (400, "reasoning")),  # no effort setting (enable_thinking switches it)
        ({"reasoning": {"summary": "auto"}}, (400, "reasoning")),  # no summaries: the reasoning item is whole
    ],
    "conversation": [({"conversation": "conv_1"}, (400, "conversation"))],
    "prompt": [({"prompt": {"id": "pmpt_1"}}, (400, "prompt"))],
    "prompt_cache_key": [({"prompt_cache_key": "k"}, (400, "prompt_cache_key"))],
    "prompt_cache_retention": [({"prompt_cache_retention": "24h"}, (400, "prompt_cache_retention"))],
    "prompt_cache_options": [({"prompt_cache_options": {"mode": "explicit"}}, (400, "prompt_cache_options"))],
    "context_management": [({"context_management": [{"type": "compaction"}]}, (400, "context_management"))],
    "access_programs": [({"access_programs": {"cyber": "standard"}}, (400, "access_programs"))],
    "image": [({"image": {"context_compression": "enabled"}}, (400, "image"))],
    "moderation": [({"moderation": {"model": "omni-moderation-latest"}}, (400, "moderation"))],
}


@pytest.fixture
async def harness_and_client() -> AsyncIterator[tuple[Harness, openai.AsyncOpenAI]]:
    model = dataclasses.replace(announcement(), max_model_len=4096)  # room for the tools' system turn
    async with gateway_harness(FakeWorkerScript(two_calls_with_tools), model=model) as h:
        http = httpx.AsyncClient(transport=h.transport, timeout=30)
        yield h, openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="k", http_client=http, max_retries=0)


CLIENT_FIELDS = {*response_create_params.ResponseCreateParamsBase.__annotations__, "stream"}
NEWER_CLIENT_FIELDS = {"access_programs", "background_options", "image"}
"""Fields of newer ``openai`` clients (3.60) than the one the test extra pins (3.3: instructor 1.17 caps
``jiter`` below what openai 3.4 needs); sent as ``extra_body`` where the installed client lacks them."""


def test_every_field_of_the_clients_create_params_has_a_case() -> None:
    assert set(CASES) >= CLIENT_FIELDS, sorted(CLIENT_FIELDS - set(CASES))
    assert set(CASES) - CLIENT_FIELDS <= NEWER_CLIENT_FIELDS, sorted(set(CASES) - CLIENT_FIELDS)


async def test_each_field_is_honoured_or_refused_by_name(
    harness_and_client: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    h, client = harness_and_client
    for field, cases in CASES.items():
        for extra, expected in cases:
            body = _as_client_arguments({"model": MODEL, "input": "Hello there.", **extra})
            asked = len(h.worker.requests)
            if isinstance(expected, tuple):
                status, param = expected
                with pytest.raises(openai.APIStatusError) as refused:
                    await client.responses.create(**body)
                assert (refused.value.status_code, refused.value.body["param"]) == (status, param), field  # type: ignore[index]
                assert len(h.worker.requests) == asked, f"{field}: refused after it was sent to a worker"
                continue
            response = await _create(client, body)
            request = h.worker.requests[asked]
            assert expected(request, response), f"{field} {extra} not honoured"


def _as_client_arguments(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as keyword arguments of the installed client: fields it does not know go in ``extra_body``."""
    unknown = {name: value for name, value in body.items() if name not in CLIENT_FIELDS | {"model", "input"}}
    known = {name: value for name, value in body.items() if name not in unknown}
    return known | ({"extra_body": unknown} if unknown else {})


async def _create(client: openai.AsyncOpenAI, body: dict[str, Any]) -> Response:
    if not body.get("stream"):
        return await client.responses.create(**body)
    stream = await client.responses.create(**body)
    events = [event async for event in stream]
    assert events[-1].type == "response.completed"
    return events[-1].response
