"""A response format beside tools in ``auto`` mode (``ToolCallFormat.answer_or_calls_grammar``): the
model answers with JSON the format's schema accepts, or opens calls at once, each naming a tool with
arguments its schema accepts; nothing else (free text, an answer then a call, an empty reply).
Checked with llguidance's matcher over each format's real tokenizer, and by sampling uniformly among
the tokens its mask allows (the worker masks the model's logits the same way)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping

import jsonschema
import pytest

from metrale.text.grammars import alternative_grammars, check_grammar, json_object_grammar, json_schema_grammar
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.formats import KIMI_K2, QWEN3_CODER, ToolCallFormat
from metrale.text.tool_calls.parser import parse_whole
from tests.text.tool_calls.test_triggered_grammar import (
    CALL_TEXTS,
    FORMATS,
    FUNCTIONS,
    MAX_TOKENS,
    SCHEMAS,
    allowed,
    matcher,
)

ANSWER = {
    "type": "object",
    "properties": {"verdict": {"enum": ["sunny", "rainy"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["verdict", "score"],
    "additionalProperties": False,
}


def grammar_for(tool_format: ToolCallFormat, max_calls: int = 1, answer: str | None = None) -> str:
    answer = json_schema_grammar(ANSWER) if answer is None else answer
    return tool_format.answer_or_calls_grammar(answer, FUNCTIONS, first_index=0, max_calls=max_calls)


def follows(grammar: str, tokenizer: Tokenizer, text: str) -> bool:
    """Whether ``text`` is a whole sentence of ``grammar``."""
    m = matcher(grammar, tokenizer)
    return bool(m.consume_tokens(tokenizer.encode(text))) and bool(m.is_accepting())


def call_text(tool_format: ToolCallFormat, name: str, arguments: Mapping[str, object]) -> str:
    if tool_format is QWEN3_CODER:
        values = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments.items())
        return f"<tool_call>\n<function={name}>\n{values}</function>\n</tool_call>"
    compact = json.dumps(arguments, separators=(",", ":"))
    return CALL_TEXTS[tool_format.name].replace("NAME", name).replace("ARGS", compact)


PARIS = {"city": "Paris", "unit": "celsius"}


@pytest.mark.parametrize("tool_format", FORMATS)
def test_an_answer_in_the_format_or_a_valid_call_and_nothing_else(
    tool_format: ToolCallFormat, tokenizers: dict[str, Tokenizer]
) -> None:
    tokenizer = tokenizers[tool_format.name]
    grammar = grammar_for(tool_format)
    check_grammar(grammar, tokenizer)
    call = call_text(tool_format, "get_weather", PARIS)
    assert follows(grammar, tokenizer, '{"verdict":"sunny","score":3}')
    assert follows(grammar, tokenizer, call)
    refused = {
        "an answer the schema refuses": '{"verdict":"foggy","score":3}',
        "an answer missing a property": '{"verdict":"sunny"}',
        "free text": "It is sunny.",
        "text before a call": "Let me check. " + call,
        "an answer then a call": '{"verdict":"sunny","score":3}' + call,
        "a call to a tool that is not there": call_text(tool_format, "get_time", {}),
        "a call with arguments its schema refuses": call_text(tool_format, "get_weather", {"city": "Paris"}),
        "nothing": "",
    }
    for why, text in refused.items():
        assert not follows(grammar, tokenizer, text), why


@pytest.mark.parametrize("tool_format", FORMATS)
def test_json_object_format_takes_any_object_or_a_call(
    tool_format: ToolCallFormat, tokenizers: dict[str, Tokenizer]
) -> None:
    tokenizer = tokenizers[tool_format.name]
    grammar = grammar_for(tool_format, answer=json_object_grammar())
    assert follows(grammar, tokenizer, '{"anything":[1,2]}')
    assert follows(grammar, tokenizer, call_text(tool_format, "get_weather", PARIS))
    assert not follows(grammar, tokenizer, "[1,2]") and not follows(grammar, tokenizer, "Hello")


@pytest.mark.parametrize("tool_format", FORMATS)
@pytest.mark.parametrize("max_calls", [1, 3])
def test_every_sampled_reply_is_an_answer_in_the_format_or_valid_calls(
    tool_format: ToolCallFormat, max_calls: int, tokenizers: dict[str, Tokenizer]
) -> None:
    tokenizer = tokenizers[tool_format.name]
    grammar = grammar_for(tool_format, max_calls=max_calls)
    kinds = set()
    for seed in range(24):
        rng = random.Random(seed)
        m = matcher(grammar, tokenizer)
        tokens: list[int] = []
        while not m.is_accepting() and len(tokens) < MAX_TOKENS:
            token = rng.choice(allowed(m, tokenizer))
            assert m.consume_token(token), m.get_error()
            tokens.append(token)
        assert m.is_accepting(), "the reply did not complete within the budget"
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        content, calls = parse_whole(tool_format.new_parser(lambda i: f"call_{i}", FUNCTIONS), text)
        if calls:
            kinds.add("calls")
            assert content.strip() == ""
            assert 1 <= len(calls) <= max_calls
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        else:
            kinds.add("answer")
            jsonschema.validate(json.loads(text), ANSWER)
    assert kinds == {"answer", "calls"}


def test_a_kimi_section_numbers_its_calls_from_the_chats_count(kimi_tokenizer: Tokenizer) -> None:
    grammar = KIMI_K2.answer_or_calls_grammar(json_object_grammar(), FUNCTIONS, first_index=4, max_calls=2)
    numbered = call_text(KIMI_K2, "get_weather", PARIS).replace(":0", ":4")
    assert follows(grammar, kimi_tokenizer, numbered)
    assert not follows(grammar, kimi_tokenizer, call_text(KIMI_K2, "get_weather", PARIS))


def test_alternatives_refuse_what_they_cannot_name(builtin_tokenizer: Tokenizer) -> None:
    one = 'start: "a"\n'
    assert follows(alternative_grammars({"a": one, "b": 'start: "b"\n'}), builtin_tokenizer, "b")
    with pytest.raises(ValueError, match="at least two"):
        alternative_grammars({"a": one})
    with pytest.raises(ValueError, match="identifier"):
        alternative_grammars({"a": one, "B c": one})
    with pytest.raises(ValueError, match="identifier"):
        alternative_grammars({"a": one, "alternatives": one})
    with pytest.raises(ValueError, match="llguidance JSON"):
        alternative_grammars({"a": one, "b": '{"grammars": []}'})
