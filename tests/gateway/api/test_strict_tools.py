"""Strict tools with ``tool_choice`` "auto" (or absent), as the Agents SDK, pydantic-ai and langchain
send them: the gateway sends the worker the format's triggered grammar (text, or a call to one of the
tools with valid arguments once the model opens one), the reply is parsed as in any auto request, and
what cannot be constrained is a 400 naming the field. Whether a reply is a sentence of the grammar
that was sent is checked with llguidance on the same tokenizer, as the worker masks with it."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from metrale.shared.messages import ModelAnnouncement
from metrale.text.grammars import llguidance_tokenizer
from metrale.text.tokenizer import Tokenizer
from metrale.worker.model.builtin import builtin_model_dir
from tests.gateway.api.test_tools import (
    BUILTIN,
    ENDLESS,
    PING,
    WEATHER,
    calls_of,
    chat,
    hermes_script,
    kimi_script,
)
from tests.gateway.harness import gateway_harness, sse_payloads

pytestmark = pytest.mark.anyio

STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
STRICT_TOOLS = [STRICT_WEATHER, PING]  # ping is not strict: any JSON object

B, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def kimi_reply(arguments: str, name: str = "get_weather") -> str:
    return f"Sure.{B}{CB}functions.{name}:0{AB}{arguments}{CE}{E}"


def hermes_reply(arguments: str, name: str = "get_weather") -> str:
    return f'Sure.\n<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def follows(grammar: str, tokenizer: Tokenizer, text: str) -> bool:
    """Whether ``text`` is a whole sentence of ``grammar`` (the worker would let the model write it)."""
    matcher = llguidance.LLMatcher(llguidance_tokenizer(tokenizer), grammar, log_level=0)
    return bool(matcher.consume_tokens(tokenizer.encode(text))) and bool(matcher.is_accepting())


async def test_a_strict_tool_with_auto_sends_kimis_triggered_grammar(
    kimi: tuple[ModelAnnouncement, Tokenizer],
) -> None:
    announced, tokenizer = kimi
    valid = kimi_reply('{"city":"Paris"}')
    async with gateway_harness(kimi_script(tokenizer, valid), model=announced) as h:
        response = await h.http.post("/v1/chat/completions", json=chat(tools=STRICT_TOOLS))
        (request,) = h.worker.requests
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    assert calls_of(choice["message"]) == [("get_weather", {"city": "Paris"})]
    grammar = request.grammar
    assert grammar is not None
    assert follows(grammar, tokenizer, "No tool needed: it is sunny.")
    assert follows(grammar, tokenizer, valid)
    assert follows(grammar, tokenizer, kimi_reply('{"anything":[1,2]}', name="ping"))  # ping is not strict
    assert not follows(grammar, tokenizer, kimi_reply('{"town":"Paris"}'))
    assert not follows(grammar, tokenizer, kimi_reply('{"city":"Paris"}', name="get_time"))


async def test_a_strict_tool_with_auto_sends_the_hermes_triggered_grammar_streamed_and_not() -> None:
    tokenizer = Tokenizer.from_dir(builtin_model_dir())
    valid = hermes_reply('{"city":"Paris"}')
    async with gateway_harness(hermes_script(valid), model=BUILTIN) as h:
        body = chat(tools=STRICT_TOOLS, tool_choice="auto")
        whole = (await h.http.post("/v1/chat/completions", json=body)).json()
        streamed = sse_payloads((await h.http.post("/v1/chat/completions", json={**body, "stream": True})).text)
        grammars = {request.grammar for request in h.worker.requests}
    (choice,) = whole["choices"]
    assert calls_of(choice["message"]) == [("get_weather", {"city": "Paris"})]
    assert choice["finish_reason"] == "tool_calls"
    pieces = [chunk["choices"][0] for chunk in streamed if chunk["choices"]]
    arguments = "".join(e["function"]["arguments"] for p in pieces for e in p["delta"].get("tool_calls", []))
    assert json.loads(arguments) == {"city": "Paris"}
    assert "".join(p["delta"].get("content") or "" for p in pieces) == choice["message"]["content"] == "Sure.\n"
    (grammar,) = grammars
    assert grammar is not None
    assert follows(grammar, tokenizer, valid) and follows(grammar, tokenizer, "Just text, <b>bold</b>.")
    assert not follows(grammar, tokenizer, hermes_reply('{"city":"Paris","extra":1}'))
    assert not follows(grammar, tokenizer, hermes_reply('{"city": "Paris"}'))  # compact JSON, as forced calls


async def test_without_a_strict_tool_auto_stays_free(kimi: tuple[ModelAnnouncement, Tokenizer]) -> None:
    announced, tokenizer = kimi
    async with gateway_harness(kimi_script(tokenizer), model=announced) as h:
        response = await h.http.post("/v1/chat/completions", json=chat())
        (request,) = h.worker.requests
    assert response.status_code == 200 and request.grammar is None


def _strict(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "strict": True, "parameters": parameters}}


BAD_BODIES = {
    "unsupported-response-format": (
        chat(
            tools=STRICT_TOOLS,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "format": "nonsense"}},
            },
        ),
        "response_format",
        "nonsense",
    ),
    "endless-schema": (chat(tools=[_strict("endless", ENDLESS), PING]), "tools", "'endless' admits no finite"),
    "unsupported-schema": (
        chat(tools=[_strict("f", {"type": "object", "properties": {"x": {"type": "string", "format": "nonsense"}}})]),
        "tools",
        "nonsense",
    ),
}


@pytest.mark.parametrize("name", BAD_BODIES)
async def test_strict_tools_that_cannot_be_enforced_are_a_400_naming_the_field(name: str) -> None:
    body, param, message = BAD_BODIES[name]
    async with gateway_harness(model=BUILTIN) as h:
        response = await h.http.post("/v1/chat/completions", json=body)
        assert h.worker.requests == []
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


async def test_an_endless_function_that_is_not_strict_is_not_refused_with_auto() -> None:
    endless = {"type": "function", "function": {"name": "endless", "parameters": ENDLESS}}
    async with gateway_harness(hermes_script(), model=BUILTIN) as h:
        response = await h.http.post("/v1/chat/completions", json=chat(tools=[STRICT_WEATHER, endless]))
    assert response.status_code == 200, response.text
