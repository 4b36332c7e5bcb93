"""Tools, assistant tool calls and tool results through the two templates Metrale ships (Kimi's and the
built-in model's), rendered as transformers 5.23 renders the same Jinja, and the earlier calls written
as each format's parser reads them back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from metrale.text.builtin_tokenizer import CHAT_TEMPLATE as BUILTIN_TEMPLATE
from metrale.text.chat_templates.kimi import KIMI_CHAT_TEMPLATE
from metrale.text.chat_templates.render import render_chat, turn_boundaries
from metrale.text.tiktoken_vocab.kimi_writer import write_kimi_tokenizer
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.formats import HERMES, KIMI_K2, ToolCallFormat
from metrale.text.tool_calls.parser import ToolCall, parse_whole
from tests.text.kimi_reference import transformers_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now — «in one city»",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
CALLS = [
    {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
    {"id": "call_b", "type": "function", "function": {"name": "ping", "arguments": "{}"}},
]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Zürich? And ping."},
    {"role": "assistant", "content": "Checking.", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21°C"},
    {"role": "tool", "tool_call_id": "call_b", "content": "pong"},
    {"role": "assistant", "content": "Sunny, and pong."},
    {"role": "user", "content": "Again?"},
    {"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
]
TEMPLATES = {"kimi": (KIMI_CHAT_TEMPLATE, KIMI_K2), "builtin": (BUILTIN_TEMPLATE, HERMES)}
SPECIAL_TOKENS = {"bos_token": "<|bos|>"}


def hf_render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template, **SPECIAL_TOKENS, **kwargs)
    return str(rendered[0])


@pytest.mark.parametrize("add_generation_prompt", [False, True], ids=["no-prompt", "generation-prompt"])
@pytest.mark.parametrize("name", TEMPLATES)
def test_tools_calls_and_results_render_like_transformers(name: str, add_generation_prompt: bool) -> None:
    template, _ = TEMPLATES[name]
    ours = render_chat(
        template, MESSAGES, add_generation_prompt=add_generation_prompt, special_tokens=SPECIAL_TOKENS, tools=TOOLS
    )
    theirs = hf_render(template, MESSAGES, add_generation_prompt=add_generation_prompt, tools=TOOLS)
    assert ours == theirs
    assert "get_weather" in ours and "sunny, 21°C" in ours and "pong" in ours


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_chat_without_tools_renders_as_before_tools_existed(name: str) -> None:
    template, _ = TEMPLATES[name]
    plain = [{"role": "user", "content": "hi"}]
    assert render_chat(template, plain, add_generation_prompt=True, special_tokens=SPECIAL_TOKENS) == hf_render(
        template, plain, add_generation_prompt=True
    )
    if name == "builtin":
        rendered = render_chat(template, plain, add_generation_prompt=True, special_tokens=SPECIAL_TOKENS)
        assert rendered == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_kimi_renders_calls_numbered_across_the_chat_and_results_naming_them() -> None:
    text = render_chat(KIMI_CHAT_TEMPLATE, MESSAGES, add_generation_prompt=True, special_tokens={}, tools=TOOLS)
    assert text.startswith(
        "<|im_system|>tool_declare<|im_middle|>" + json.dumps(TOOLS, separators=(",", ":"), ensure_ascii=False)
    )
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in text
    assert "<|tool_call_begin|>functions.ping:1<|tool_call_argument_begin|>" in text
    assert "<|tool_call_begin|>functions.get_weather:2<|tool_call_argument_begin|>" in text
    assert "## Return of functions.get_weather:0\nsunny, 21°C" in text
    assert "## Return of functions.ping:1\npong" in text


@pytest.mark.parametrize("name", TEMPLATES)
def test_an_assistant_turn_with_calls_parses_back_to_those_calls(name: str) -> None:
    template, tool_format = TEMPLATES[name]
    turn = [MESSAGES[1], MESSAGES[2]]
    before = render_chat(template, turn[:1], add_generation_prompt=True, special_tokens=SPECIAL_TOKENS, tools=TOOLS)
    whole = render_chat(template, turn, add_generation_prompt=False, special_tokens=SPECIAL_TOKENS, tools=TOOLS)
    assert whole.startswith(before)
    reply = whole[len(before) :].removesuffix("<|im_end|>\n").removesuffix("<|im_end|>")
    content, calls = parse_whole(_parser(tool_format), reply)
    assert content.strip() == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Zürich"}), ("ping", {})]


def _parser(tool_format: ToolCallFormat) -> Any:
    return tool_format.new_parser(lambda index: f"call_{index}")


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_turn_with_tools_ends_at_a_prefix_of_the_whole_chat(name: str) -> None:
    template, _ = TEMPLATES[name]
    boundaries = turn_boundaries(template, MESSAGES, special_tokens=SPECIAL_TOKENS, tools=TOOLS)
    assert len(boundaries) == len(MESSAGES)


def test_a_release_folder_renders_tools_as_its_transformers_tokenizer_does_with_one_id_per_marker(
    tmp_path: Path,
) -> None:
    ids = write_kimi_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_linear", "eos_token_id": ids.eos_token_id}))
    ours = Tokenizer.from_dir(tmp_path)
    theirs = transformers_tokenizer(tmp_path, kimi_split=True)
    text = ours.render_chat(MESSAGES, add_generation_prompt=True, tools=TOOLS)
    assert text == theirs.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    token_ids = ours.encode(text)
    assert token_ids == theirs(text, add_special_tokens=False)["input_ids"]
    for marker in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_end|>"):
        assert ours.token_to_id(marker) in token_ids
    assert parse_whole(
        _parser(KIMI_K2), ours.decode(token_ids, skip_special_tokens=False).split("<|im_assistant|>")[1]
    )[1] == [
        ToolCall("functions.get_weather:0", "get_weather", '{"city": "Zürich"}'),
        ToolCall("functions.ping:1", "ping", "{}"),
    ]
