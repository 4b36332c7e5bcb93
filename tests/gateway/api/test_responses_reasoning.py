"""Reasoning on ``/v1/responses``, through the official client, on a Qwen-shaped model (a template that
opens ``<think>``): the model's ``<think>…</think>`` is a ``reasoning`` item before the message or
calls, never in the message's text, streamed with the reasoning events in OpenAI's order and adding
up to the whole answer; ``chat_template_kwargs`` reach the template (``enable_thinking`` false: no
reasoning item); replayed reasoning items are read as the template reads a chat's reasoning."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from metrale.shared.messages import ModelAnnouncement
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.qwen3_coder import call_text
from metrale.worker.fleet.announcement import tokenizer_config_text
from tests.gateway.fake_worker import FakeWorkerScript
from tests.gateway.harness import MODEL, Harness, gateway_harness
from tests.text.qwen_shaped import write_qwen_shaped_model

pytestmark = pytest.mark.anyio

THOUGHT = "\nThe user wants the weather.\n</think>\n\n"
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


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


class Served:
    """A gateway whose fake worker answers every request with ``reply``, and a client to it."""

    def __init__(self, harness: Harness, client: openai.AsyncOpenAI, tokenizer: Tokenizer) -> None:
        self.harness, self.client, self.tokenizer = harness, client, tokenizer

    def prompt(self) -> str:
        """The last prompt the worker was sent to answer (not a stored response's seal)."""
        asked = [request for request in self.harness.worker.requests if not request.request_id.endswith("-seal")]
        return self.tokenizer.decode(asked[-1].prompt_token_ids, skip_special_tokens=False)

    async def both(self, **body: Any) -> tuple[Response, list[Any]]:
        """The response whole, and the events of the same request streamed."""
        whole = await self.client.responses.create(model=MODEL, **body)
        stream = await self.client.responses.create(model=MODEL, stream=True, **body)
        return whole, [event async for event in stream]


@pytest.fixture
def reply() -> list[str]:
    return [THOUGHT + "It is sunny."]


@pytest.fixture
async def served(qwen: tuple[ModelAnnouncement, Tokenizer], reply: list[str]) -> AsyncIterator[Served]:
    announced, tokenizer = qwen
    end = tokenizer.encode("<|im_end|>")
    script = FakeWorkerScript(lambda request, index: [*tokenizer.encode(reply[0]), *end])
    async with gateway_harness(script, model=announced) as h:
        http = httpx.AsyncClient(transport=h.transport, timeout=30)
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="k", http_client=http, max_retries=0)  # type: ignore[arg-type]
        yield Served(h, client, tokenizer)


def without_ids(items: list[Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")} for item in items]


async def test_reasoning_is_an_item_before_the_message_whole_and_streamed(served: Served) -> None:
    whole, events = await served.both(input="Weather in Paris?")
    assert served.prompt().endswith("<|im_start|>assistant\n<think>\n")
    thought, message = whole.output
    assert thought.type == "reasoning" and thought.summary == [] and thought.status == "completed"
    assert [(part.type, part.text) for part in thought.content or []] == [
        ("reasoning_text", "The user wants the weather.")
    ]
    assert message.type == "message" and whole.output_text == "It is sunny."
    final = events[-1]
    assert final.type == "response.completed"
    assert without_ids(final.response.output) == without_ids(whole.output)
    assert [event.type for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * sum(e.type == "response.reasoning_text.delta" for e in events),
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * sum(e.type == "response.output_text.delta" for e in events),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert deltas == "The user wants the weather."
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert all("think>" not in event.delta for event in events if event.type == "response.output_text.delta")


async def test_with_enable_thinking_false_there_is_no_reasoning_item(served: Served, reply: list[str]) -> None:
    reply[0] = "It is sunny."
    kwargs = {"enable_thinking": False}
    whole, events = await served.both(input="Weather in Paris?", extra_body={"chat_template_kwargs": kwargs})
    assert served.prompt().endswith("<think>\n\n</think>\n\n")
    assert [item.type for item in whole.output] == ["message"] and whole.output_text == "It is sunny."
    assert not any("reasoning" in event.type for event in events)


async def test_reasoning_then_a_call_is_a_reasoning_item_then_a_function_call(served: Served, reply: list[str]) -> None:
    reply[0] = THOUGHT + call_text("get_weather", {"city": "Paris"})
    whole, events = await served.both(input="Weather in Paris?", tools=[WEATHER])
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    assert json.loads(getattr(whole.output[1], "arguments")) == {"city": "Paris"}  # noqa: B009
    assert without_ids(events[-1].response.output) == without_ids(whole.output)


async def test_a_cut_off_thought_is_an_incomplete_reasoning_item_and_an_empty_message(served: Served) -> None:
    whole, events = await served.both(input="Weather in Paris?", max_output_tokens=3)
    assert whole.status == "incomplete"
    thought, message = whole.output
    assert thought.type == "reasoning" and thought.status == "completed"
    assert message.type == "message" and whole.output_text == ""
    assert without_ids(events[-1].response.output) == without_ids(whole.output)


async def test_replayed_reasoning_reaches_the_template_as_a_chat_turns_reasoning(served: Served) -> None:
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    result = {"type": "function_call_output", "call_id": "c1", "output": "rain"}
    steps = [{"role": "user", "content": "Weather in Oslo?"}, thought, call, result]
    made = await served.client.responses.create(model=MODEL, input=steps, tools=[WEATHER])  # type: ignore[arg-type,list-item]
    this_turn = served.prompt()
    assert "<|im_start|>assistant\n<think>\nHm.\n</think>\n\n<tool_call>\n<function=get_weather>" in this_turn
    answered = {"type": "message", "role": "assistant", "content": "Rain."}
    later = [*steps, answered, {"role": "user", "content": "And tomorrow?"}]
    await served.client.responses.create(model=MODEL, input=later, tools=[WEATHER])  # type: ignore[arg-type,list-item]
    assert "Hm." not in served.prompt()  # an earlier turn's reasoning is dropped, as the template drops it
    listed = (await served.client.responses.input_items.list(made.id, order="asc")).data
    assert [item.type for item in listed] == ["message", "reasoning", "function_call", "function_call_output"]
    assert listed[1].id == "rs_1" and listed[1].content[0].text == "Hm."  # type: ignore[union-attr,index]


async def test_a_reasoning_item_with_an_answer_after_it_is_one_assistant_turn(served: Served) -> None:
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]}
    answered = {"type": "message", "role": "assistant", "content": "Rain."}
    steps = [{"role": "user", "content": "Weather?"}, thought, answered, {"role": "user", "content": "Sure?"}]
    await served.client.responses.create(model=MODEL, input=steps)  # type: ignore[arg-type]
    assert served.prompt().count("<|im_start|>assistant\n") == 2  # the answer's turn, then the new one


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning", "enable_thinking"),
        ({"reasoning": {"summary": "auto"}}, "reasoning", "no summary"),
        ({"extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs.tools", "tools"),
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
            "input[0].encrypted_content",
            "never encrypts",
        ),
        ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "x"}]}]}, "input[0].content", "parts"),
    ],
    ids=["effort", "summary", "server-variable", "encrypted", "not-reasoning-text"],
)
async def test_what_cannot_be_honoured_is_a_400_naming_it(
    served: Served, extra: dict[str, Any], param: str, says: str
) -> None:
    body = {"model": MODEL, "input": "Hi.", **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        await served.client.responses.create(**body)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == param and says in error["message"]
    assert served.harness.worker.requests == []
