"""Tools and a response format in one request, as OpenAI serves them (instructor's RESPONSES_TOOLS,
pydantic-ai's tools with ``NativeOutput``): the grammar the gateway sends the worker for each
``tool_choice``, on chat completions and Responses, streamed and not, in the Kimi, Hermes and
qwen3_coder formats, and how the reply reads back.

- ``required`` / a named function: the forced call's grammar (a forced turn gives no text answer for
  the format to shape);
- ``auto`` (or absent), strict tools or not: the format's answer, or calls opened at once and
  constrained as strict ``auto`` constrains them;
- ``none``: the format's grammar alone.

Whether a text is a sentence of the grammar sent is checked with llguidance on the same tokenizer,
as the worker masks with it."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from metrale.shared.messages import GenerateRequest, ModelAnnouncement
from metrale.text.grammars import json_schema_grammar
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.hermes import call_text as hermes_call
from metrale.text.tool_calls.qwen3_coder import call_text as qwen3_coder_call
from metrale.worker.model.builtin import builtin_model_dir
from tests.gateway.api.test_reasoning import qwen  # noqa: F401 (fixture)
from tests.gateway.api.test_reasoning import script as qwen_script
from tests.gateway.api.test_responses_tools import IM_END
from tests.gateway.api.test_strict_tools import STRICT_WEATHER, follows, kimi_reply
from tests.gateway.api.test_tools import BUILTIN, PING, TOOLS, WEATHER, calls_of, chat, hermes_script, kimi_script
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MODEL, encode, gateway_harness, sse_payloads

pytestmark = pytest.mark.anyio

VERDICT = {
    "type": "object",
    "properties": {"verdict": {"enum": ["sunny", "rainy"]}},
    "required": ["verdict"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}
ANSWER = '{"verdict":"sunny"}'
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HERMES_CALL = hermes_call("get_weather", {"city": "Paris"})
HERMES_TEXT_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
"""A call as the grammar writes it (compact arguments)."""


@pytest.fixture(scope="module")
def builtin_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(builtin_model_dir())


# (tools, tool_choice, the reply scripted, what the grammar takes, what it refuses)
CHOICES: dict[str, tuple[list[Any], Any, str, list[str], list[str]]] = {
    "required": (TOOLS, "required", HERMES_CALL, [HERMES_TEXT_CALL], [ANSWER]),
    "named": (TOOLS, NAMED, HERMES_CALL, [HERMES_TEXT_CALL], [ANSWER]),
    "auto-strict": ([STRICT_WEATHER, PING], "auto", ANSWER, [ANSWER, HERMES_TEXT_CALL], ["It is sunny."]),
    "absent-strict": ([STRICT_WEATHER, PING], None, ANSWER, [ANSWER, HERMES_TEXT_CALL], ['{"verdict":"foggy"}']),
    "auto-not-strict": (TOOLS, "auto", ANSWER, [ANSWER, HERMES_TEXT_CALL], ["Let me check. " + HERMES_TEXT_CALL]),
    "none": (TOOLS, "none", ANSWER, [ANSWER], [HERMES_TEXT_CALL]),
}


@pytest.mark.parametrize("name", CHOICES)
async def test_chat_sends_the_grammar_each_tool_choice_plans_with_a_response_format(
    name: str, builtin_tokenizer: Tokenizer
) -> None:
    tools, tool_choice, reply, takes, refuses = CHOICES[name]
    choice_field = {} if tool_choice is None else {"tool_choice": tool_choice}
    body = chat(tools=tools, response_format=FORMAT, **choice_field)
    async with gateway_harness(hermes_script(reply), model=BUILTIN) as h:
        whole = await h.http.post("/v1/chat/completions", json=body)
        streamed = await h.http.post("/v1/chat/completions", json={**body, "stream": True})
        grammars = {request.grammar for request in h.worker.requests}
    assert whole.status_code == 200, whole.text
    (grammar,) = grammars
    assert grammar is not None
    for text in takes:
        assert follows(grammar, builtin_tokenizer, text), text
    for text in refuses:
        assert not follows(grammar, builtin_tokenizer, text), text
    if name == "none":
        assert grammar == json_schema_grammar(VERDICT)
    (choice,) = whole.json()["choices"]
    pieces = [chunk["choices"][0] for chunk in sse_payloads(streamed.text) if chunk["choices"]]
    if reply == ANSWER:
        assert choice["message"]["content"] == ANSWER and not choice["message"].get("tool_calls")
        assert choice["finish_reason"] == "stop"
        assert "".join(p["delta"].get("content") or "" for p in pieces) == ANSWER
    else:
        assert calls_of(choice["message"]) == [("get_weather", {"city": "Paris"})]
        assert choice["finish_reason"] == "tool_calls"
        arguments = "".join(e["function"]["arguments"] for p in pieces for e in p["delta"].get("tool_calls", []))
        assert json.loads(arguments) == {"city": "Paris"}


async def test_a_non_strict_tool_beside_a_format_takes_any_json_object(builtin_tokenizer: Tokenizer) -> None:
    async with gateway_harness(hermes_script(ANSWER), model=BUILTIN) as h:
        await h.http.post("/v1/chat/completions", json=chat(tools=TOOLS, response_format=FORMAT))
        (request,) = h.worker.requests
    assert request.grammar is not None
    loose = '<tool_call>\n{"name": "get_weather", "arguments": {"town":[1,2]}}\n</tool_call>'
    assert follows(request.grammar, builtin_tokenizer, loose)


async def test_kimi_answers_in_the_format_or_opens_a_section(kimi: tuple[ModelAnnouncement, Tokenizer]) -> None:
    announced, tokenizer = kimi
    section = kimi_reply('{"city":"Paris"}').removeprefix("Sure.")
    async with gateway_harness(kimi_script(tokenizer, section), model=announced) as h:
        body = chat(tools=[STRICT_WEATHER, PING], response_format=FORMAT)
        whole = await h.http.post("/v1/chat/completions", json=body)
        streamed = await h.http.post("/v1/chat/completions", json={**body, "stream": True})
        forced = await h.http.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
        auto_grammar, _, forced_grammar = (request.grammar for request in h.worker.requests)
    assert whole.status_code == streamed.status_code == forced.status_code == 200, whole.text
    assert auto_grammar is not None and forced_grammar is not None
    assert follows(auto_grammar, tokenizer, ANSWER) and follows(auto_grammar, tokenizer, section)
    assert not follows(auto_grammar, tokenizer, "Sure." + section)
    assert not follows(auto_grammar, tokenizer, kimi_reply('{"town":"Paris"}').removeprefix("Sure."))
    assert follows(forced_grammar, tokenizer, section) and not follows(forced_grammar, tokenizer, ANSWER)
    (choice,) = whole.json()["choices"]
    assert calls_of(choice["message"]) == [("get_weather", {"city": "Paris"})]
    pieces = [chunk["choices"][0] for chunk in sse_payloads(streamed.text) if chunk["choices"]]
    assert [p["finish_reason"] for p in pieces if p["finish_reason"]] == ["tool_calls"]


async def test_qwen3_coder_answers_in_the_format_or_calls_in_xml(qwen: Any) -> None:  # noqa: F811
    announced, tokenizer = qwen
    call = qwen3_coder_call("get_weather", {"city": "Paris"})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": [STRICT_WEATHER]}
    async with gateway_harness(qwen_script(tokenizer, ANSWER), model=announced) as h:
        answered = await h.http.post("/v1/chat/completions", json={**body, "response_format": FORMAT})
        (request,) = h.worker.requests
    assert answered.status_code == 200, answered.text
    assert request.grammar is not None
    assert follows(request.grammar, tokenizer, ANSWER) and follows(request.grammar, tokenizer, call)
    assert not follows(request.grammar, tokenizer, "It is sunny.")
    assert answered.json()["choices"][0]["message"]["content"] == ANSWER


RESPONSES_TOOL: dict[str, Any] = {"type": "function", **cast(dict[str, Any], WEATHER["function"])}
"""``get_weather`` as the Responses API writes a function tool (flat)."""
TEXT_FORMAT: dict[str, Any] = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_plan_text_format_beside_tools_as_chat_does(stream: bool, builtin_tokenizer: Tokenizer) -> None:
    """instructor's RESPONSES_TOOLS: a named tool and the same schema as ``text.format``; pydantic-ai's
    Responses model: tools in ``auto`` with a ``text.format``."""

    def reply(request: GenerateRequest, index: int) -> list[int]:
        """A call where the grammar forces one, else the answer."""
        answers = request.grammar is not None and follows(request.grammar, builtin_tokenizer, ANSWER)
        return [*encode(ANSWER if answers else HERMES_CALL), IM_END]

    bodies: dict[str, dict[str, Any]] = {
        "named": {"tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "get_weather"}},
        "auto": {"tools": [RESPONSES_TOOL]},
        "strict": {"tools": [{**RESPONSES_TOOL, "strict": True}], "tool_choice": "auto"},
        "none": {"tools": [RESPONSES_TOOL], "tool_choice": "none"},
    }
    outputs = {}
    async with gateway_harness(FakeWorkerScript(reply), model=BUILTIN) as h:
        for name, extra in bodies.items():
            body = {"model": MODEL, "input": "Weather in Paris?", "text": TEXT_FORMAT, "stream": stream, **extra}
            body["store"] = False  # one worker request per response
            response = await h.http.post("/v1/responses", json=body)
            assert response.status_code == 200, response.text
            if stream:
                events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
                (done,) = [event for event in events if event["type"] == "response.completed"]
                outputs[name] = done["response"]["output"]
            else:
                outputs[name] = response.json()["output"]
        grammars = dict(zip(bodies, (request.grammar or "" for request in h.worker.requests), strict=True))
    assert all(grammars.values()), grammars
    assert follows(grammars["named"], builtin_tokenizer, HERMES_TEXT_CALL)
    assert not follows(grammars["named"], builtin_tokenizer, ANSWER)
    for name in ("auto", "strict"):
        assert follows(grammars[name], builtin_tokenizer, ANSWER), name
        assert follows(grammars[name], builtin_tokenizer, HERMES_TEXT_CALL), name
        assert not follows(grammars[name], builtin_tokenizer, "It is sunny."), name
    assert grammars["none"] == json_schema_grammar(VERDICT)
    (call,) = outputs["named"]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Paris"}
    for name in ("auto", "strict", "none"):
        (message,) = outputs[name]
        assert message["type"] == "message" and message["content"][0]["text"] == ANSWER, name
