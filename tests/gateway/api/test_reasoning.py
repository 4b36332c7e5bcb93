"""Reasoning and Qwen3-Coder calls at the gateway, on a Qwen-shaped model (ChatML template that opens
``<think>``, ``<tool_call>`` / ``<think>`` as added tokens): ``<think>…</think>`` comes back as
``message.reasoning_content`` (``delta.reasoning_content`` streamed, joined equal) and never in
``content``; ``enable_thinking`` false closes the block in the prompt; calls parse to ``tool_calls``
with values typed by the schema; earlier calls reach the template with ``arguments`` as a mapping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from metrale.shared.messages import ModelAnnouncement
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.qwen3_coder import call_text
from metrale.worker.fleet.announcement import tokenizer_config_text
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MODEL, gateway_harness, sse_payloads
from tests.text.qwen_shaped import write_qwen_shaped_model

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "\nThe user wants the weather.\n</think>\n\n"
CALL = call_text("get_weather", {"city": "Paris", "days": 2})


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelAnnouncement, Tokenizer]:
    directory: Path = write_qwen_shaped_model(tmp_path_factory.mktemp("qwen") / "model")
    tokenizer = Tokenizer.from_dir(directory)
    announced = ModelAnnouncement(
        model=MODEL,
        tokenizer_json=(directory / "tokenizer.json").read_text(),
        tokenizer_config_json=tokenizer_config_text(directory),
        max_model_len=2048,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        fingerprint="cd" * 32,
    )
    return announced, tokenizer


def script(tokenizer: Tokenizer, text: str) -> FakeWorkerScript:
    end = tokenizer.encode("<|im_end|>")
    return FakeWorkerScript(lambda request, index: [*tokenizer.encode(text), *end])


async def ask(qwen: tuple[ModelAnnouncement, Tokenizer], reply: str, **body: Any) -> tuple[Any, Any, str]:
    """The answer whole, the stream's chunks, and the prompt the worker got."""
    announced, tokenizer = qwen
    async with gateway_harness(script(tokenizer, reply), model=announced) as h:
        whole = await h.http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body})
        streamed = await h.http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": True, **body}
        )
        prompt = tokenizer.decode(h.worker.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert whole.status_code == 200, whole.text
    return whole.json()["choices"][0], [c["choices"][0] for c in sse_payloads(streamed.text) if c["choices"]], prompt


def joined(chunks: list[Any], field: str) -> str:
    return "".join(chunk["delta"].get(field) or "" for chunk in chunks)


async def test_reasoning_comes_apart_from_content_whole_and_streamed(qwen: Any) -> None:
    choice, chunks, prompt = await ask(qwen, THOUGHT + "It is sunny.")
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert choice["message"]["reasoning_content"] == "The user wants the weather."
    assert choice["message"]["content"] == "It is sunny."
    assert joined(chunks, "reasoning_content") == "The user wants the weather."
    assert joined(chunks, "content") == "It is sunny."
    assert all("think>" not in (chunk["delta"].get("content") or "") for chunk in chunks)


async def test_without_thinking_the_prompt_closes_the_block_and_the_answer_is_content(qwen: Any) -> None:
    choice, chunks, prompt = await ask(qwen, "It is sunny.", chat_template_kwargs={"enable_thinking": False})
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}
    assert joined(chunks, "content") == "It is sunny." and joined(chunks, "reasoning_content") == ""


async def test_a_call_after_reasoning_is_a_tool_call_typed_by_the_schema(qwen: Any) -> None:
    choice, chunks, _ = await ask(qwen, THOUGHT + CALL, tools=[WEATHER])
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] is None and message["reasoning_content"] == "The user wants the weather."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    streamed = "".join(e["function"].get("arguments", "") for c in chunks for e in c["delta"].get("tool_calls", []))
    assert json.loads(streamed) == {"city": "Paris", "days": 2}


async def test_a_forced_call_is_constrained_in_the_xml_format_and_not_read_as_reasoning(qwen: Any) -> None:
    announced, tokenizer = qwen
    async with gateway_harness(script(tokenizer, CALL), model=announced) as h:
        body = {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"}
        response = await h.http.post("/v1/chat/completions", json=body)
        (request,) = h.worker.requests
    assert request.grammar is not None and "<tool_call>" in request.grammar and "<parameter=city>" in request.grammar
    (call,) = response.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


async def test_an_earlier_call_reaches_the_template_with_its_arguments_as_a_mapping(qwen: Any) -> None:
    earlier = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    chat = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [earlier]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    _, _, prompt = await ask(qwen, "Rain.", messages=chat, tools=[WEATHER])
    assert "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>" in prompt
    assert "<tool_response>\nrain\n</tool_response>" in prompt


async def test_arguments_that_are_not_a_json_object_are_a_400(qwen: Any) -> None:
    announced, tokenizer = qwen
    earlier = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}
    chat = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [earlier]}]
    async with gateway_harness(script(tokenizer, "x"), model=announced) as h:
        response = await h.http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


async def test_a_think_block_cut_off_is_reasoning_and_a_cut_off_call_is_a_call_never_content(qwen: Any) -> None:
    """Issue #31: markup cut off by ``max_tokens`` never reaches ``content``, whole or streamed."""
    _, tokenizer = qwen
    reply = tokenizer.encode(THOUGHT + CALL)
    inside_thought = next(n for n in range(1, len(reply)) if tokenizer.decode(reply[:n]).endswith("wants"))
    choice, chunks, _ = await ask(qwen, THOUGHT + CALL, max_tokens=inside_thought, tools=[WEATHER])
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"] == "The user wants"
    assert not choice["message"].get("content") and not choice["message"].get("tool_calls")
    assert joined(chunks, "reasoning_content") == "The user wants" and joined(chunks, "content") == ""
    inside_call = next(n for n in range(1, len(reply)) if tokenizer.decode(reply[:n]).endswith("Paris"))
    choice, chunks, _ = await ask(qwen, THOUGHT + CALL, max_tokens=inside_call, tools=[WEATHER])
    assert choice["finish_reason"] == "length" and not choice["message"].get("content")
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert joined(chunks, "content") == "" and [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length"]
    assert any(
        entry["function"].get("name") == "get_weather" for c in chunks for entry in c["delta"].get("tool_calls", [])
    )
