"""instructor, unchanged: a validated pydantic answer in its TOOLS (a forced chat tool call),
JSON_SCHEMA (chat ``response_format`` json_schema) and RESPONSES_TOOLS (a forced Responses function
call) modes. ``max_retries=0``: an answer that does not validate fails the test rather than being
asked for again."""

from __future__ import annotations

from typing import Any

import instructor
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.clients.conftest import Server
from tests.clients.forecast import MAX_TOKENS, Weather

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Describe the weather in Lima."}]
RESPONSES_TOOLS = pytest.param(instructor.Mode.RESPONSES_TOOLS, id="RESPONSES_TOOLS")
"""A named ``tool_choice`` with the same schema as ``text.format``: the forced call governs the turn."""
MODES = [
    pytest.param(instructor.Mode.TOOLS, id="TOOLS"),
    pytest.param(instructor.Mode.JSON_SCHEMA, id="JSON_SCHEMA"),
    RESPONSES_TOOLS,
]


@pytest.mark.parametrize("mode", MODES)
def test_mode_returns_a_validated_model(server: Server, mode: instructor.Mode) -> None:
    client = instructor.from_openai(
        openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120), mode=mode
    )
    limit: dict[str, Any] = (
        {"max_output_tokens": MAX_TOKENS} if mode is instructor.Mode.RESPONSES_TOOLS else {"max_tokens": MAX_TOKENS}
    )
    weather = client.create(
        model=server.model,
        messages=MESSAGES,
        response_model=Weather,
        max_retries=0,
        temperature=0.0,
        **limit,
    )
    assert isinstance(weather, Weather)
