"""Chat, reasoning and tools as Qwen3.5 speaks them, through the official ``openai`` client against
``met serve`` on a Qwen-shaped model folder (the tiny Kimi weights under a Qwen-style tokenizer and
ChatML template; ``tests/text/qwen_shaped.py``) and on the tiny Qwen3.5 family model, each served
with ``--tool-call-parser qwen3_coder --reasoning-parser qwen3``: with thinking on, the answer's reasoning comes back as
``reasoning_content`` apart from ``content``, streamed and not alike; a ``tool_choice="required"``
call in the XML format comes back as a schema-valid ``tool_calls`` entry (the worker masks the
logits with the format's grammar); a call and its result go back through the template, as
transformers renders them. The weights are random: what is checked is the format, not the words."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from metrale.worker.model.families.qwen3_5_tiny import write_tiny_qwen3_5
from tests.integration.deployments import API_KEY, Endpoint, serving_model
from tests.text.qwen_shaped import write_qwen_shaped_model

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}}]
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module", params=["qwen-shaped", "qwen3_5"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen-shaped folder over Kimi weights, then the real tiny Qwen3.5 family model (``init-tiny``)."""
    parent = tmp_path_factory.mktemp("qwen-chat")
    if request.param == "qwen3_5":
        return write_tiny_qwen3_5(parent / "tiny-qwen3_5", seed=3)
    return write_qwen_shaped_model(parent / "qwen-shaped", seed=3)


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    parsers = ("--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3")
    logs = tmp_path_factory.mktemp("qwen-chat-serve")
    with serving_model(logs, model_dir, tenant="qwen", options=parsers) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def client(served: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _stream(client: openai.OpenAI, **body: Any) -> tuple[str, str, Any]:
    """The streamed answer's reasoning and content, joined, and its last chunk's finish reason."""
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


def test_thinking_comes_back_as_reasoning_content_streamed_and_not_alike(
    client: openai.OpenAI, served: Endpoint
) -> None:
    reasonings = []
    for seed in range(4):
        body = {
            "model": served.model,
            "messages": MESSAGES,
            "seed": seed,
            "max_tokens": 12,
            "extra_body": {"ignore_eos": True},
        }
        whole = client.chat.completions.create(**body)
        message = whole.choices[0].message.model_dump()
        reasoning, content = message.get("reasoning_content") or "", message["content"] or ""
        assert (reasoning, content, whole.choices[0].finish_reason) == _stream(client, **body)
        assert "<think>" not in content and "</think>" not in content
        reasonings.append(reasoning)
    assert any(reasonings)  # the prompt opened the block: the model's words start as reasoning


def test_without_thinking_the_answer_is_content(client: openai.OpenAI, served: Endpoint) -> None:
    body = {"model": served.model, "messages": MESSAGES, "seed": 1, "max_tokens": 8, "extra_body": NO_THINKING}
    whole = client.chat.completions.create(**body)
    message = whole.choices[0].message.model_dump()
    assert message.get("reasoning_content") is None
    assert (None, message["content"]) == (None, _stream(client, **body)[1])


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
def test_a_required_call_comes_back_as_a_valid_tool_call(
    client: openai.OpenAI, served: Endpoint, thinking: bool
) -> None:
    extra = {} if thinking else {"extra_body": NO_THINKING}
    for seed in range(5):
        body = {"model": served.model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
        answer = client.chat.completions.create(**body, seed=seed, max_tokens=1024, **extra)
        (choice,) = answer.choices
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


def test_a_call_and_its_result_go_back_through_the_template(
    client: openai.OpenAI, served: Endpoint, model_dir: Path
) -> None:
    answer = client.chat.completions.create(
        model=served.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        seed=7,
        max_tokens=1024,
        parallel_tool_calls=False,
        extra_body=NO_THINKING,
    )
    (call,) = [c.model_dump(exclude_none=True) for c in answer.choices[0].message.tool_calls or []]
    chat = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
    ]
    follow_up = client.chat.completions.create(
        model=served.model, messages=chat, tools=TOOLS, max_tokens=4, seed=1, extra_body=NO_THINKING
    )
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    as_mapping = [
        *chat[:1],
        {
            **chat[1],
            "tool_calls": [
                {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
            ],
        },
        chat[2],
    ]
    text = reference.apply_chat_template(
        as_mapping, tools=TOOLS, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert f"<function=get_weather>\n<parameter=city>\n{json.loads(call['function']['arguments'])['city']}" in text
    assert follow_up.usage is not None
    assert follow_up.usage.prompt_tokens == len(reference(text, add_special_tokens=False)["input_ids"])


def test_an_image_part_is_refused_saying_images_are_not_served(client: openai.OpenAI, served: Endpoint) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    content: list[Any] = [{"type": "text", "text": "What is in this picture?"}, image]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": content}])
    assert refused.value.status_code == 400
    assert "images are not served" in str(refused.value) and "messages[0].content[1]" in str(refused.value)
