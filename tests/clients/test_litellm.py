"""litellm, unchanged: ``completion`` (whole, streamed, with a strict tool) and ``text_completion``
with a list of prompts, through its OpenAI-compatible provider."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import litellm
import pytest

from tests.clients.conftest import Server
from tests.clients.forecast import FORECAST_PARAMETERS, FORECAST_TOOL, MAX_TOKENS, QUESTION, TOOL_NAME

MESSAGES = [{"role": "user", "content": "def parse(text):"}]


def endpoint(server: Server) -> dict[str, Any]:
    """The arguments that point litellm at the server."""
    return {"api_base": server.v1, "api_key": server.api_key, "max_tokens": MAX_TOKENS, "temperature": 0.0}


def test_completion(server: Server) -> None:
    response = litellm.completion(model=f"openai/{server.model}", messages=MESSAGES, **endpoint(server))
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str)
    assert response.usage.completion_tokens > 0


def test_streamed_completion(server: Server) -> None:
    stream = litellm.completion(model=f"openai/{server.model}", messages=MESSAGES, stream=True, **endpoint(server))
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text


def test_tool_call(server: Server) -> None:
    response = litellm.completion(
        model=f"openai/{server.model}",
        messages=[{"role": "user", "content": QUESTION}],
        tools=[FORECAST_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        **endpoint(server),
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == TOOL_NAME
    jsonschema.validate(json.loads(call.function.arguments), FORECAST_PARAMETERS)


@pytest.mark.parametrize("provider", ["text-completion-openai", "openai"])
def test_text_completion_with_a_list_of_prompts(server: Server, provider: str) -> None:
    prompts = ["def add(a, b):", "import os\n", "class Point:"]
    response = litellm.text_completion(model=f"{provider}/{server.model}", prompt=prompts, **endpoint(server))
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert all(isinstance(choice.text, str) for choice in response.choices)
