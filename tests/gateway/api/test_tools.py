"""Tool calling at the gateway: the tool fields checked (400s), tools into the prompt, the forced-call
grammar sent to the worker, the worker's tokens parsed into ``message.tool_calls`` and streamed as
``delta.tool_calls`` (which the official client's stream helper joins into the same calls), for Kimi's
format (special tokens) and the built-in model's ``<tool_call>`` format."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from metrale.shared.messages import ModelAnnouncement
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.hermes import call_text
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MODEL, Harness, announcement, encode, gateway_harness, sse_payloads

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, PING]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]

B, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_REPLY = f'Sure.{B}{CB}functions.get_weather:0{AB}{{"city": "Paris"}}{CE}{CB}functions.ping:1{AB}{{}}{CE}{E}'
HERMES_REPLY = "Sure.\n" + call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("ping", {})


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **extra}


def kimi_script(tokenizer: Tokenizer, text: str = KIMI_REPLY) -> FakeWorkerScript:
    (eos,) = tokenizer.eos_token_ids
    return FakeWorkerScript(lambda request, index: [*tokenizer.encode(text), eos])


BUILTIN = dataclasses.replace(announcement(), max_model_len=4096)
"""The built-in tokenizer (``<tool_call>`` format) with room for the tools' system turn."""


def hermes_script(text: str = HERMES_REPLY) -> FakeWorkerScript:
    return FakeWorkerScript(lambda request, index: [*encode(text), 516])  # <|im_end|>


EXPECTED_CALLS = [("get_weather", {"city": "Paris"}), ("ping", {})]


def calls_of(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in message["tool_calls"]]


async def test_a_kimi_section_becomes_tool_calls_with_kimis_ids_and_finish_reason_tool_calls(
    kimi: tuple[ModelAnnouncement, Tokenizer],
) -> None:
    announced, tokenizer = kimi
    async with gateway_harness(kimi_script(tokenizer), model=announced) as h:
        response = await h.http.post("/v1/chat/completions", json=chat())
        (request,) = h.worker.requests
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    assert [call["id"] for call in choice["message"]["tool_calls"]] == ["functions.get_weather:0", "functions.ping:1"]
    assert {call["type"] for call in choice["message"]["tool_calls"]} == {"function"}
    assert calls_of(choice["message"]) == EXPECTED_CALLS
    prompt = tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|>[") and '"name":"get_weather"' in prompt
    assert request.grammar is None  # auto: the model is free


async def test_hermes_blocks_become_tool_calls_with_call_ids() -> None:
    async with gateway_harness(hermes_script(), model=BUILTIN) as h:
        response = await h.http.post("/v1/chat/completions", json=chat())
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure.\n"
    assert calls_of(choice["message"]) == EXPECTED_CALLS
    ids = [call["id"] for call in choice["message"]["tool_calls"]]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids) and len(set(ids)) == 2


async def test_a_stream_sends_each_call_name_first_then_its_arguments(
    kimi: tuple[ModelAnnouncement, Tokenizer],
) -> None:
    announced, tokenizer = kimi
    async with gateway_harness(kimi_script(tokenizer), model=announced) as h:
        response = await h.http.post("/v1/chat/completions", json=chat(stream=True))
    pieces = [c["choices"][0] for c in sse_payloads(response.text)]
    tool_pieces = [entry for piece in pieces for entry in piece["delta"].get("tool_calls", [])]
    firsts = [entry for entry in tool_pieces if "id" in entry]
    assert [(f["index"], f["id"], f["type"], f["function"]["name"]) for f in firsts] == [
        (0, "functions.get_weather:0", "function", "get_weather"),
        (1, "functions.ping:1", "function", "ping"),
    ]
    for index, (_, arguments) in enumerate(EXPECTED_CALLS):
        text = "".join(e["function"]["arguments"] for e in tool_pieces if e["index"] == index)
        assert json.loads(text) == arguments
    assert "".join(p["delta"].get("content") or "" for p in pieces) == "Sure."
    assert [p["finish_reason"] for p in pieces if p["finish_reason"]] == ["tool_calls"]
    assert all("<|" not in (p["delta"].get("content") or "") for p in pieces)


@pytest.fixture
async def kimi_client(kimi: tuple[ModelAnnouncement, Tokenizer]) -> AsyncIterator[tuple[Harness, openai.AsyncOpenAI]]:
    announced, tokenizer = kimi
    async with gateway_harness(kimi_script(tokenizer), model=announced) as h:
        http = httpx.AsyncClient(transport=h.transport)
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="none", http_client=http, max_retries=0)
        yield h, client
        await client.close()


async def test_the_official_clients_stream_joins_to_the_calls_of_the_whole_answer(
    kimi_client: tuple[Harness, openai.AsyncOpenAI],
) -> None:
    _, client = kimi_client
    whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)  # type: ignore[arg-type]
    # The client's ``.stream()`` helper (openai 3.3, pinned) parses only strict tools: its chunks are joined
    # here as that helper joins them, by each call's index.
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True)  # type: ignore[arg-type]
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for call in delta.tool_calls or []:
            joined = calls.setdefault(call.index, ["", "", ""])
            joined[0] += call.id or ""
            joined[1] += call.function.name or "" if call.function else ""
            joined[2] += call.function.arguments or "" if call.function else ""
    assert whole.choices[0].message.tool_calls is not None
    whole_calls = [(c.id, c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [tuple(calls[index]) for index in sorted(calls)] == whole_calls
    assert [(name, json.loads(arguments)) for _, name, arguments in whole_calls] == EXPECTED_CALLS
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    assert content == whole.choices[0].message.content == "Sure."


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "names", "most"),
    [
        ("required", None, ["get_weather", "ping"], 16),
        ("required", False, ["get_weather", "ping"], 1),
        ({"type": "function", "function": {"name": "ping"}}, None, ["ping"], 1),
    ],
    ids=["required", "required-one", "named"],
)
async def test_a_forced_choice_sends_a_grammar_for_its_functions(
    kimi: tuple[ModelAnnouncement, Tokenizer], tool_choice: Any, parallel: bool | None, names: list[str], most: int
) -> None:
    announced, tokenizer = kimi
    body = chat(tool_choice=tool_choice, **({} if parallel is None else {"parallel_tool_calls": parallel}))
    history = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "ping", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "x", "content": "pong"},
        {"role": "user", "content": "Once more."},
    ]
    body["messages"] = MESSAGES + history
    async with gateway_harness(kimi_script(tokenizer), model=announced) as h:
        response = await h.http.post("/v1/chat/completions", json=body)
        (request,) = h.worker.requests
    assert response.status_code == 200, response.text
    grammar = request.grammar
    assert grammar is not None
    for name in ("get_weather", "ping"):
        assert (f'"functions.{name}:1"' in grammar) == (name in names)  # the chat holds one call already
    assert f"call_{most - 1}:" in grammar and f"call_{most}:" not in grammar


async def test_tool_choice_none_keeps_tools_in_the_prompt_but_the_answer_is_text(
    kimi: tuple[ModelAnnouncement, Tokenizer],
) -> None:
    announced, tokenizer = kimi
    async with gateway_harness(kimi_script(tokenizer), model=announced) as h:
        response = await h.http.post("/v1/chat/completions", json=chat(tool_choice="none"))
        (request,) = h.worker.requests
    (choice,) = response.json()["choices"]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert choice["message"]["content"].startswith("Sure.functions.get_weather:0")  # special tokens hidden as always
    assert "tool_declare" in tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
    assert request.grammar is None


async def test_parallel_tool_calls_false_keeps_the_first_call(kimi: tuple[ModelAnnouncement, Tokenizer]) -> None:
    announced, tokenizer = kimi
    async with gateway_harness(kimi_script(tokenizer), model=announced) as h:
        response = await h.http.post("/v1/chat/completions", json=chat(parallel_tool_calls=False))
    (choice,) = response.json()["choices"]
    assert calls_of(choice["message"]) == EXPECTED_CALLS[:1]


async def test_without_tools_special_tokens_stay_hidden_and_nothing_is_parsed(
    kimi: tuple[ModelAnnouncement, Tokenizer],
) -> None:
    announced, tokenizer = kimi
    async with gateway_harness(kimi_script(tokenizer), model=announced) as h:
        response = await h.http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    (choice,) = response.json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode(tokenizer.encode(KIMI_REPLY))}


async def test_the_server_can_name_the_parser(kimi: tuple[ModelAnnouncement, Tokenizer]) -> None:
    async with gateway_harness(hermes_script(), model=BUILTIN, tool_call_parser="kimi_k2") as h:
        response = await h.http.post("/v1/chat/completions", json=chat())
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == HERMES_REPLY


def _forced(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


BAD_BODIES = {
    "choice-unknown-function": (chat(tool_choice=_forced("nope")), "tool_choice", "not in tools"),
    "choice-bad-string": (chat(tool_choice="always"), "tool_choice", "must be one of"),
    "choice-bad-shape": (chat(tool_choice={"type": "function"}), "tool_choice", "must look like"),
    "choice-without-tools": (
        {"model": MODEL, "messages": MESSAGES, "tool_choice": "required"},
        "tool_choice",
        "only allowed",
    ),
    "parallel-without-tools": (
        {"model": MODEL, "messages": MESSAGES, "parallel_tool_calls": False},
        "parallel_tool_calls",
        "only allowed",
    ),
    "not-a-function": (chat(tools=[{"type": "code_interpreter"}]), "tools", "only function tools"),
    "no-tools": (chat(tools=[]), "tools", "at least one"),
    "bad-name": (chat(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools", "must match"),
    "twice": (chat(tools=[PING, PING]), "tools", "declared twice"),
    "parameters-not-object": (
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
        "tools",
        "object schema",
    ),
    "unsupported-schema": (
        chat(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": "string", "format": "nonsense"}}},
                    },
                }
            ],
            tool_choice="required",
        ),
        "tool_choice",
        "nonsense",
    ),
    "unsupported-response-format-with-a-forced-call": (
        chat(
            tool_choice="required",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "format": "nonsense"}},
            },
        ),
        "response_format",
        "nonsense",
    ),
}


@pytest.mark.parametrize("name", BAD_BODIES)
async def test_bad_tool_fields_are_a_400_naming_the_field(name: str) -> None:
    body, param, message = BAD_BODIES[name]
    async with gateway_harness(model=BUILTIN) as h:
        response = await h.http.post("/v1/chat/completions", json=body)
        assert h.worker.requests == []
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


async def test_a_model_whose_template_declares_no_tools_refuses_them() -> None:
    plain = json.loads(announcement().tokenizer_config_json)
    plain["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    announced = dataclasses.replace(announcement(), tokenizer_config_json=json.dumps(plain), fingerprint="ef" * 32)
    async with gateway_harness(model=announced) as h:
        response = await h.http.post("/v1/chat/completions", json=chat())
    assert response.status_code == 400
    assert "does not declare tools" in response.json()["error"]["message"]


async def test_each_of_n_choices_is_parsed_on_its_own(kimi: tuple[ModelAnnouncement, Tokenizer]) -> None:
    announced, tokenizer = kimi
    (eos,) = tokenizer.eos_token_ids
    replies = [KIMI_REPLY, "No tools needed."]
    script = FakeWorkerScript(lambda request, index: [*tokenizer.encode(replies[index]), eos])
    async with gateway_harness(script, model=announced) as h:
        whole = (await h.http.post("/v1/chat/completions", json=chat(n=2))).json()
        streamed = sse_payloads((await h.http.post("/v1/chat/completions", json=chat(n=2, stream=True))).text)
    first, second = whole["choices"]
    assert calls_of(first["message"]) == EXPECTED_CALLS and first["finish_reason"] == "tool_calls"
    assert second["message"] == {"role": "assistant", "content": "No tools needed."}
    assert second["finish_reason"] == "stop"
    reasons = {
        c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in streamed if c["choices"][0]["finish_reason"]
    }
    assert reasons == {0: "tool_calls", 1: "stop"}
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in streamed if c["choices"][0]["index"] == 1)


ENDLESS = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
ENDLESS_TOOL = {"type": "function", "function": {"name": "endless", "parameters": ENDLESS}}


@pytest.mark.parametrize(
    "tool_choice",
    [pytest.param("required", id="required"), pytest.param(_forced("endless"), id="named")],
)
async def test_a_forced_function_whose_parameters_admit_no_finite_value_is_a_400_naming_it(tool_choice: Any) -> None:
    async with gateway_harness(hermes_script(), model=BUILTIN) as h:
        response = await h.http.post(
            "/v1/chat/completions", json=chat(tools=[PING, ENDLESS_TOOL], tool_choice=tool_choice)
        )
        assert h.worker.requests == []
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools"
    assert error["message"].startswith("the parameters schema of function 'endless' admits no finite JSON value")


async def test_an_endless_function_not_forced_does_not_stop_the_others() -> None:
    async with gateway_harness(hermes_script(), model=BUILTIN) as h:
        named = await h.http.post(
            "/v1/chat/completions", json=chat(tools=[PING, ENDLESS_TOOL], tool_choice=_forced("ping"))
        )
        auto = await h.http.post("/v1/chat/completions", json=chat(tools=[PING, ENDLESS_TOOL]))
    assert named.status_code == auto.status_code == 200, (named.text, auto.text)
