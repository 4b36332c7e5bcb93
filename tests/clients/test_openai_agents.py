"""The OpenAI Agents SDK, unchanged: an agent with a strict ``@function_tool`` run to a final answer
over both of the SDK's models (Responses and Chat Completions), streamed and not.

The first turn forces a call (``tool_choice="required"``: the tiny model would rarely choose one); the
SDK then resets the choice, so the second turn offers the strict tool in ``auto`` mode and the model
answers in text, which is the run's final output.
"""

from __future__ import annotations

from typing import Any

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from agents.models.interface import Model
from openai import AsyncOpenAI

from tests.clients.conftest import Server
from tests.clients.forecast import MAX_TOKENS, QUESTION, TOOL_NAME, City, Unit, forecast_text

set_tracing_disabled(True)
MAX_TURNS = 4
"""A forced call, its result, and an answer take two turns; the bound ends a run that loops."""


def openai_client(server: Server) -> AsyncOpenAI:
    """A client for one test, closed by it (``async with``) on the test's own event loop."""
    return AsyncOpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120)


def agent_model(server: Server, kind: str, client: AsyncOpenAI) -> Model:
    if kind == "responses":
        return OpenAIResponsesModel(model=server.model, openai_client=client)
    return OpenAIChatCompletionsModel(model=server.model, openai_client=client)


def forecast_agent(server: Server, kind: str, client: AsyncOpenAI, calls: list[tuple[str, str]]) -> Agent[Any]:
    @function_tool(strict_mode=True)
    def get_forecast(city: City, unit: Unit) -> str:
        """The weather forecast for a city."""
        calls.append((city, unit))
        return forecast_text(city, unit)

    assert get_forecast.name == TOOL_NAME and get_forecast.strict_json_schema
    return Agent(
        name="forecaster",
        instructions="Answer with the forecast tool's help.",
        model=agent_model(server, kind, client),
        tools=[get_forecast],
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0.0
        ),
    )


def assert_ran_to_an_answer(items: list[Any], calls: list[tuple[str, str]], final_output: object) -> None:
    """The tool was called and ran with valid arguments, its output went back, and a message ended it."""
    assert calls, "the tool never ran"
    assert any(isinstance(item, ToolCallItem) for item in items)
    outputs = [item for item in items if isinstance(item, ToolCallOutputItem)]
    assert [output.output for output in outputs[: len(calls)]] == [forecast_text(*call) for call in calls]
    assert isinstance(items[-1], MessageOutputItem)
    assert isinstance(final_output, str)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["responses", "chat_completions"])
async def test_agent_runs_a_strict_tool_to_a_final_answer(server: Server, kind: str) -> None:
    calls: list[tuple[str, str]] = []
    async with openai_client(server) as client:
        result = await Runner.run(forecast_agent(server, kind, client, calls), QUESTION, max_turns=MAX_TURNS)
    assert_ran_to_an_answer(result.new_items, calls, result.final_output)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["responses", "chat_completions"])
async def test_streamed_agent_runs_a_strict_tool_to_a_final_answer(server: Server, kind: str) -> None:
    calls: list[tuple[str, str]] = []
    item_events: list[str] = []
    raw_events: list[str] = []
    async with openai_client(server) as client:
        result = Runner.run_streamed(forecast_agent(server, kind, client, calls), QUESTION, max_turns=MAX_TURNS)
        async for event in result.stream_events():
            if event.type == "run_item_stream_event":
                item_events.append(event.name)
            elif event.type == "raw_response_event":
                raw_events.append(event.data.type)
    assert result.is_complete
    assert_ran_to_an_answer(result.new_items, calls, result.final_output)
    assert {"tool_called", "tool_output", "message_output_created"} <= set(item_events)
    assert "response.function_call_arguments.delta" in raw_events
    assert raw_events[-1] == "response.completed"
