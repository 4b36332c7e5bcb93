"""Function tools on ``/v1/responses`` through the official ``openai`` client (gateway over ASGI, a fake
worker answering in the built-in model's ``<tool_call>`` format): ``function_call`` items, streamed in
the Responses API's event order and equal to the whole answer; a ``function_call_output`` continues the
conversation by ``previous_response_id`` (from the exact tokens of the call) or with the whole input
replayed, rendered by the chat template as a tool result."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import (
    FunctionTool,
    Response,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
)

from metrale.shared.messages import GenerateRequest
from metrale.text.tool_calls.hermes import call_text
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MODEL, Harness, announcement, encode, gateway_harness, token_text

pytestmark = pytest.mark.anyio

TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": False,
}
CALL_REPLY = "Let me look.\n" + call_text("get_weather", {"city": "Paris"})
FINAL_REPLY = "Sunny in Paris."
NONSENSE = {"type": "object", "properties": {"x": {"type": "string", "format": "nonsense"}}}
"""A schema llguidance cannot follow."""
IM_END = 516


def prompt_text(request: GenerateRequest) -> str:
    return "".join(token_text(token) for token in request.prompt_token_ids)


def weather_agent(request: GenerateRequest, index: int) -> list[int]:
    """Calls the tool, or answers once the prompt holds a tool result."""
    answered = "<|im_start|>tool\n" in prompt_text(request)
    return [*encode(FINAL_REPLY if answered else CALL_REPLY), IM_END]


@pytest.fixture
async def harness_and_client() -> AsyncIterator[tuple[Harness, openai.AsyncOpenAI]]:
    model = dataclasses.replace(announcement(), max_model_len=4096)  # room for the tools' system turn
    async with gateway_harness(FakeWorkerScript(weather_agent), model=model) as h:
        http = httpx.AsyncClient(transport=h.transport, timeout=30)
        yield h, openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="k", http_client=http, max_retries=0)


def without_ids(response: Response) -> list[dict[str, Any]]:
    return [item.model_dump(exclude={"id", "call_id"}, exclude_none=True) for item in response.output]


def asked(h: Harness, response_id: str) -> GenerateRequest:
    """The request the worker was sent for a response."""
    return next(request for request in h.worker.requests if request.request_id == response_id)


async def test_a_tool_round_trip_streamed_and_whole(harness_and_client: tuple[Harness, openai.AsyncOpenAI]) -> None:
    h, client = harness_and_client
    whole = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL])
    stream = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL], stream=True)
    events = [event async for event in stream]
    streamed = events[-1].response  # type: ignore[union-attr]

    message, call = whole.output
    assert isinstance(message, ResponseOutputMessage) and isinstance(call, ResponseFunctionToolCall)
    assert message.content[0].text == "Let me look.\n"  # type: ignore[union-attr]
    assert call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    (tool,) = whole.tools
    assert isinstance(tool, FunctionTool) and tool.name == "get_weather"
    assert whole.tool_choice == "auto" and whole.parallel_tool_calls
    assert without_ids(streamed) == without_ids(whole)
    assert [event.type for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * sum(event.type == "response.output_text.delta" for event in events),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = (
        next(e.item for e in events if isinstance(e, kind) and e.output_index == 1)
        for kind in (ResponseOutputItemAddedEvent, ResponseOutputItemDoneEvent)
    )
    assert isinstance(added, ResponseFunctionToolCall) and isinstance(done, ResponseFunctionToolCall)
    assert added.status == "in_progress" and added.arguments == "" and done.arguments == call.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))

    result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}
    continued = await client.responses.create(model=MODEL, previous_response_id=whole.id, input=[result], tools=[TOOL])
    replayed_input: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        *[i.model_dump(exclude_none=True) for i in whole.output],
        result,
    ]
    replayed = await client.responses.create(model=MODEL, input=replayed_input, tools=[TOOL])
    assert continued.output_text == replayed.output_text == FINAL_REPLY
    assert continued.status == "completed" and continued.previous_response_id == whole.id

    by_previous, by_replay = (asked(h, r.id) for r in (continued, replayed))
    first = asked(h, whole.id)
    reply_ids = [*encode(CALL_REPLY), IM_END]
    # The continuation is fed the exact tokens of the call it answers, then the tool result.
    assert by_previous.prompt_token_ids[: len(first.prompt_token_ids) + len(reply_ids)] == [
        *first.prompt_token_ids,
        *reply_ids,
    ]
    tool_turn = "<|im_start|>tool\nsunny, 24 C<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_text(by_previous).endswith(tool_turn) and prompt_text(by_replay).endswith(tool_turn)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>' in prompt_text(by_replay)

    items = await client.responses.input_items.list(continued.id)
    assert [item.type for item in items.data] == ["function_call_output"]


async def test_forced_and_named_choices_send_a_grammar_and_bad_tools_are_400s(
    harness_and_client: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    h, client = harness_and_client
    named = await client.responses.create(
        model=MODEL, input="Weather?", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}
    )
    assert asked(h, named.id).grammar is not None
    assert named.tool_choice.name == "get_weather"  # type: ignore[union-attr]
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**TOOL, "name": "bad name"}]}, "tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [TOOL], "text": {"format": {"type": "json_schema", "name": "x", "schema": NONSENSE}}},
            "text.format",
        ),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ]
    for extra, param in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(**{"model": MODEL, "input": "Hi", **extra})
        assert refused.value.body["param"] == param, extra  # type: ignore[index]
