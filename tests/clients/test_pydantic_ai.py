"""pydantic-ai, unchanged: an agent with a strict ``@agent.tool_plain`` run to a text answer, and an
agent whose output is ``NativeOutput`` (the server's JSON-schema structured output), each over the
chat model and the Responses model.

pydantic-ai refuses a ``tool_choice`` of ``required`` set for the whole run (it could never end), so a
small capability forces the tool on the first step only, as its documentation advises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from openai import AsyncOpenAI
from pydantic_ai import Agent, NativeOutput, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.models import Model
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from tests.clients.conftest import Server
from tests.clients.forecast import MAX_TOKENS, QUESTION, TOOL_NAME, City, Unit, Weather, forecast_text

MODEL_KINDS = ["chat", "responses"]
SETTINGS = ModelSettings(max_tokens=MAX_TOKENS, temperature=0.0, parallel_tool_calls=False)


@dataclass
class ToolOnFirstStep(AbstractCapability[None]):
    """``tool_choice="required"`` on the run's first model request, the default after it."""

    def get_model_settings(self) -> Callable[[RunContext[None]], ModelSettings]:
        def settings(ctx: RunContext[None]) -> ModelSettings:
            return ModelSettings(tool_choice="required") if ctx.run_step <= 1 else ModelSettings()

        return settings


@dataclass
class ToolThenAnswer(AbstractCapability[None]):
    """``tool_choice="required"`` on the first model request, ``"auto"`` on the second, ``"none"``
    after: a real model answers once it has what it needs; the tiny model talks nonsense and, free
    to call, may call on every step, so the run is brought to its answer. Every request still
    carries the tool and the output's schema: forced, free to call or answer, then answer only."""

    def get_model_settings(self) -> Callable[[RunContext[None]], ModelSettings]:
        def settings(ctx: RunContext[None]) -> ModelSettings:
            if ctx.run_step <= 1:
                return ModelSettings(tool_choice="required")
            return ModelSettings() if ctx.run_step == 2 else ModelSettings(tool_choice="none")

        return settings


def openai_client(server: Server) -> AsyncOpenAI:
    """A client for one test, closed by it (``async with``) on the test's own event loop: pydantic-ai's
    default client is shared between event loops."""
    return AsyncOpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120)


def agent_model(server: Server, kind: str, client: AsyncOpenAI) -> Model:
    provider = OpenAIProvider(openai_client=client)
    if kind == "responses":
        return OpenAIResponsesModel(server.model, provider=provider)
    return OpenAIChatModel(server.model, provider=provider)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", MODEL_KINDS)
async def test_agent_calls_a_strict_tool_then_answers(server: Server, kind: str) -> None:
    calls: list[tuple[str, str]] = []
    client = openai_client(server)
    agent: Agent[None, str] = Agent(
        agent_model(server, kind, client), model_settings=SETTINGS, capabilities=[ToolOnFirstStep()]
    )

    @agent.tool_plain(strict=True)
    def get_forecast(city: City, unit: Unit) -> str:
        """The weather forecast for a city."""
        calls.append((city, unit))
        return forecast_text(city, unit)

    async with client:
        result = await agent.run(QUESTION)
    parts = [part for message in result.all_messages() for part in message.parts]
    assert [part.tool_name for part in parts if isinstance(part, ToolCallPart)] == [TOOL_NAME] * len(calls)
    assert calls, "the tool never ran"
    returns = [part.content for part in parts if isinstance(part, ToolReturnPart)]
    assert returns == [forecast_text(*call) for call in calls]
    assert isinstance(result.output, str)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", MODEL_KINDS)
async def test_native_output_parses(server: Server, kind: str) -> None:
    async with openai_client(server) as client:
        agent = Agent(agent_model(server, kind, client), output_type=NativeOutput(Weather), model_settings=SETTINGS)
        result = await agent.run("Describe the weather in Tokyo.")
    assert isinstance(result.output, Weather)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", MODEL_KINDS)
async def test_agent_with_a_tool_and_native_output(server: Server, kind: str) -> None:
    """The usual pydantic-ai agent: tools to gather, then a structured answer. Each request carries the
    strict tool and the output's JSON schema together (``tool_choice`` required, auto, then none)."""
    calls: list[tuple[str, str]] = []
    async with openai_client(server) as client:
        agent = Agent(
            agent_model(server, kind, client),
            output_type=NativeOutput(Weather),
            model_settings=SETTINGS,
            capabilities=[ToolThenAnswer()],
        )

        @agent.tool_plain(strict=True)
        def get_forecast(city: City, unit: Unit) -> str:
            """The weather forecast for a city."""
            calls.append((city, unit))
            return forecast_text(city, unit)

        result = await agent.run(QUESTION)
    assert calls, "the tool never ran"
    assert isinstance(result.output, Weather)
    assert len(calls) <= 2  # one forced call, perhaps one more the second step chose
