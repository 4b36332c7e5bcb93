"""Tool calling through the official ``openai`` client against ``met serve`` on a release-shaped model
with random weights (Kimi's template and special tokens): with ``tool_choice="required"`` or a named
function, every seeded run returns calls whose arguments validate against the function's schema (the
worker masks the logits with the forced-call grammar), a stream of the same request joins to the same
calls, and the calls and a tool's result go back through the template on the next turn.

The schemas bound every string and number, so that every sentence of the grammar fits in
``MAX_TOKENS``: a random model then always completes the section rather than running out of tokens
inside an endless string.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from metrale.worker.model.release_layout import write_release_model
from tests.integration.deployments import API_KEY, Endpoint, serving_model
from tests.integration.processes import free_port, met_environment, start_met, wait_ready
from tests.text.kimi_reference import transformers_tokenizer

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
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Time now", "parameters": TIME_PARAMETERS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
RUNS = 50
MAX_TOKENS = 2048
"""Above the longest sentence of the grammar: 16 calls of at most ~120 tokens each (a 12-character
string may take 4 byte tokens a character)."""
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release_model(tmp_path_factory.mktemp("release-tools"), seed=11)


@pytest.fixture(scope="module")
def served(release_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    with serving_model(tmp_path_factory.mktemp("release-tools-serve"), release_dir, tenant="tools") as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def client(served: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _calls(message: Any) -> list[tuple[str, str, str]]:
    return [(call.id, call.function.name, call.function.arguments) for call in message.tool_calls or []]


def _create(client: openai.OpenAI, model: str, seed: int, tool_choice: Any, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, seed=seed, max_tokens=MAX_TOKENS, **extra
    )


def _stream(client: openai.OpenAI, model: str, seed: int, tool_choice: Any, **extra: Any) -> Any:
    with client.chat.completions.stream(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, seed=seed, max_tokens=MAX_TOKENS, **extra
    ) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_every_seeded_forced_run_returns_valid_calls_and_its_stream_joins_to_them(
    client: openai.OpenAI, served: Endpoint, tool_choice: Any
) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda seed: _create(client, served.model, seed, tool_choice), range(RUNS)))
        streams = list(pool.map(lambda seed: _stream(client, served.model, seed, tool_choice), range(RUNS)))
    valid = 0
    for answer, streamed in zip(answers, streams, strict=True):
        (choice,) = answer.choices
        calls = _calls(choice.message)
        assert choice.finish_reason == "tool_calls", choice
        assert calls and choice.message.content is None
        if tool_choice == NAMED:
            assert [name for _, name, _ in calls] == ["get_weather"]
        for position, (call_id, name, arguments) in enumerate(calls):
            assert call_id == f"functions.{name}:{position}"
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert _calls(streamed.choices[0].message) == calls
        assert streamed.choices[0].finish_reason == "tool_calls"
        valid += 1
    assert valid == RUNS


def test_a_call_and_its_result_go_back_through_the_template(
    client: openai.OpenAI, served: Endpoint, release_dir: Path
) -> None:
    answer = _create(client, served.model, 7, "required")
    message = answer.choices[0].message
    calls = [call.model_dump(exclude_none=True) for call in message.tool_calls or []]
    results = [{"role": "tool", "tool_call_id": call["id"], "content": f"result {i}"} for i, call in enumerate(calls)]
    chat = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls}, *results]
    follow_up = client.chat.completions.create(model=served.model, messages=chat, tools=TOOLS, max_tokens=4, seed=1)
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")
    reference = transformers_tokenizer(release_dir, kimi_split=True)
    text = reference.apply_chat_template(chat, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    for i, call in enumerate(calls):
        assert f"## Return of {call['id']}\nresult {i}" in text
        assert f"<|tool_call_begin|>{call['id']}<|tool_call_argument_begin|>{call['function']['arguments']}" in text
    assert follow_up.usage is not None
    assert follow_up.usage.prompt_tokens == len(reference(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def builtin_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """``met serve`` on the built-in model, whose template writes ``<tool_call>`` blocks."""
    logs = tmp_path_factory.mktemp("builtin-tools-serve")
    env = met_environment({"MET_API_KEYS": f"{API_KEY}:tools", "MET_CACHE_DIR": str(logs / "cache")}, torch_threads=1)
    port = free_port()
    serve = start_met("builtin-tools-serve", ["serve", "--port", str(port), "--no-batch-runner"], env, logs)
    try:
        wait_ready(serve, f"http://127.0.0.1:{port}")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    finally:
        serve.stop()


def test_the_builtin_model_makes_valid_calls_in_its_own_format(builtin_client: openai.OpenAI) -> None:
    for seed in range(5):
        answer = _create(builtin_client, "metrale-tiny", seed, "required", parallel_tool_calls=False)
        (choice,) = answer.choices
        assert choice.finish_reason == "tool_calls"
        calls = _calls(choice.message)
        assert len(calls) == 1
        for call_id, name, arguments in calls:
            assert call_id.startswith("call_")
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        streamed = _stream(builtin_client, "metrale-tiny", seed, "required", parallel_tool_calls=False)
        assert [c[1:] for c in _calls(streamed.choices[0].message)] == [c[1:] for c in calls]
