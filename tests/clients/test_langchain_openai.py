"""langchain-openai, unchanged: ``bind_tools`` with a strict tool, ``with_structured_output`` by JSON
schema, and the same through ``use_responses_api=True``."""

from __future__ import annotations

import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.clients.conftest import Server
from tests.clients.forecast import (
    FORECAST_PARAMETERS,
    MAX_TOKENS,
    QUESTION,
    TOOL_NAME,
    City,
    Unit,
    Weather,
    forecast_text,
)

API_KINDS = ["chat", "responses"]


@tool
def get_forecast(city: City, unit: Unit) -> str:
    """The weather forecast for a city."""
    return forecast_text(city, unit)


def chat_model(server: Server, kind: str) -> ChatOpenAI:
    return ChatOpenAI(
        model=server.model,
        base_url=server.v1,
        api_key=server.api_key,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
        temperature=0.0,
        max_retries=0,
        timeout=120,
        use_responses_api=kind == "responses",
    )


@pytest.mark.parametrize("kind", API_KINDS)
def test_bind_tools_strict_calls_the_tool_and_continues(server: Server, kind: str) -> None:
    llm = chat_model(server, kind)
    forced = llm.bind_tools([get_forecast], strict=True, tool_choice="required", parallel_tool_calls=False)
    question = HumanMessage(QUESTION)
    call_message = forced.invoke([question])
    assert isinstance(call_message, AIMessage)
    assert [call["name"] for call in call_message.tool_calls] == [TOOL_NAME]
    call = call_message.tool_calls[0]
    jsonschema.validate(call["args"], FORECAST_PARAMETERS)
    result = get_forecast.invoke(call)
    assert isinstance(result, ToolMessage) and result.content == forecast_text(**call["args"])
    answer = llm.bind_tools([get_forecast], strict=True, parallel_tool_calls=False).invoke(
        [question, call_message, result]
    )
    assert isinstance(answer, AIMessage)
    assert "<tool_call>" not in answer.text, "tool-call markup leaked into the answer's text"
    for later_call in answer.tool_calls:  # the strict tool in auto mode: a call, if any, validates
        assert later_call["name"] == TOOL_NAME
        jsonschema.validate(later_call["args"], FORECAST_PARAMETERS)


@pytest.mark.parametrize("kind", API_KINDS)
def test_with_structured_output_json_schema(server: Server, kind: str) -> None:
    structured = chat_model(server, kind).with_structured_output(Weather, method="json_schema", strict=True)
    weather = structured.invoke("Describe the weather in Lima.")
    assert isinstance(weather, Weather)


@pytest.mark.parametrize("kind", API_KINDS)
def test_streamed_text(server: Server, kind: str) -> None:
    chunks = list(chat_model(server, kind).stream("def parse(text):"))
    assert chunks
    text = "".join(chunk.text for chunk in chunks)
    assert isinstance(text, str)
