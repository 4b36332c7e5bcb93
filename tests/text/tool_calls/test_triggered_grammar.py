"""Triggered grammars (strict tools with ``tool_choice`` "auto"): any text is allowed until the model
opens a call with its format's trigger; from there only a call to one of the tools whose arguments
validate against its schema; after the call, text again. Checked with llguidance's matcher over the
real tokenizers, and by sampling uniformly among the tokens its mask allows (the worker masks the
model's logits the same way)."""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from metrale.text.grammars import check_grammar, llguidance_tokenizer
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.formats import HERMES, KIMI_K2, QWEN3_CODER, ToolCallFormat
from metrale.text.tool_calls.grammar import FunctionSpec
from metrale.text.tool_calls.parser import parse_whole

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
NOTE = {"type": "object", "properties": {"a": SMALL, "b": SMALL}, "additionalProperties": False}
FUNCTIONS = [FunctionSpec("get_weather", WEATHER), FunctionSpec("ping", None), FunctionSpec("note", NOTE)]
SCHEMAS = {"get_weather": WEATHER, "ping": {"type": "object", "maxProperties": 0}, "note": NOTE}
MAX_TOKENS = 300
PREFIX = "Let me check that for you. "


FORMATS = [pytest.param(f, id=f.name) for f in (KIMI_K2, HERMES, QWEN3_CODER)]


def matcher(grammar: str, tokenizer: Tokenizer) -> llguidance.LLMatcher:
    built = llguidance.LLMatcher(llguidance_tokenizer(tokenizer), grammar, log_level=0)
    assert not built.is_error(), built.get_error()
    return built


def allowed(m: llguidance.LLMatcher, tokenizer: Tokenizer) -> list[int]:
    mask = allocate_token_bitmask(1, tokenizer.vocab_size)
    fill_next_token_bitmask(m, mask, 0)
    return np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: tokenizer.vocab_size])[0].tolist()


def opening(tool_format: ToolCallFormat, tokenizer: Tokenizer) -> list[int]:
    """Text, then the format's trigger, as a model would write them."""
    return tokenizer.encode(PREFIX + tool_format.trigger)


def sample_call(m: llguidance.LLMatcher, tokenizer: Tokenizer, seed: int) -> list[int]:
    """Tokens drawn uniformly among those allowed until the grammar is complete again (the call ended)."""
    rng = random.Random(seed)
    tokens: list[int] = []
    while not m.is_accepting() and len(tokens) < MAX_TOKENS:
        token = rng.choice(allowed(m, tokenizer))
        assert m.consume_token(token), m.get_error()
        tokens.append(token)
    assert m.is_accepting(), "the call did not complete within the budget"
    return tokens


@pytest.mark.parametrize("tool_format", FORMATS)
@pytest.mark.parametrize("max_calls", [1, 3])
def test_after_the_trigger_every_sampled_call_names_a_tool_and_validates(
    tool_format: ToolCallFormat, max_calls: int, tokenizers: dict[str, Tokenizer]
) -> None:
    tokenizer = tokenizers[tool_format.name]
    grammar = tool_format.triggered_grammar(FUNCTIONS, first_index=2, max_calls=max_calls)
    check_grammar(grammar, tokenizer)
    names = set()
    for seed in range(16):
        m = matcher(grammar, tokenizer)
        prefix = opening(tool_format, tokenizer)
        assert m.consume_tokens(prefix), m.get_error()
        assert not m.is_accepting()  # an opened call must be finished before the answer may end
        text = tokenizer.decode(prefix + sample_call(m, tokenizer, seed), skip_special_tokens=False)
        content, calls = parse_whole(tool_format.new_parser(lambda i: f"call_{i}", FUNCTIONS), text)
        assert content.startswith(PREFIX)  # the last token may carry text after the call (">\"," after a tag)
        assert "<tool_call" not in content and "<|" not in content
        assert 1 <= len(calls) <= (max_calls if tool_format is KIMI_K2 else 1)
        for position, call in enumerate(calls):
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            if tool_format is KIMI_K2:
                assert call.id == f"functions.{call.name}:{2 + position}"
            names.add(call.name)
    assert names == {f.name for f in FUNCTIONS}


@pytest.mark.parametrize("tool_format", FORMATS)
def test_text_is_free_before_a_call_and_after_it(tool_format: ToolCallFormat, tokenizers: dict[str, Tokenizer]) -> None:
    tokenizer = tokenizers[tool_format.name]
    grammar = tool_format.triggered_grammar(FUNCTIONS, first_index=0, max_calls=4)
    m = matcher(grammar, tokenizer)
    is_token = tool_format.keeps_special_tokens or tool_format.marker_tokens
    (trigger,) = tokenizer.encode(tool_format.trigger) if is_token else [None]
    assert trigger is None or trigger in allowed(m, tokenizer)  # the trigger itself, a token
    for token in tokenizer.encode("Any text at all: <b>{not JSON}</b>, 42 \n\t ünïcode."):
        assert token in allowed(m, tokenizer)
        assert m.consume_token(token)
    assert m.is_accepting()  # the answer may end here: no call is open
    assert m.consume_tokens(opening(tool_format, tokenizer))
    sample_call(m, tokenizer, seed=0)
    assert m.consume_tokens(tokenizer.encode(" Done, anything goes again.")) and m.is_accepting()


CALL_TEXTS = {
    "hermes": '<tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>',
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>ARGS"
        "<|tool_call_end|><|tool_calls_section_end|>"
    ),
}


@pytest.mark.parametrize("tool_format", [f for f in FORMATS if f.values[0] is not QWEN3_CODER])  # JSON arguments
@pytest.mark.parametrize(
    ("name", "arguments", "valid"),
    [
        ("get_weather", '{"city":"Paris","unit":"celsius"}', True),
        ("note", '{"a":1,"b":2}', True),
        ("get_weather", '{"city":"Paris"}', False),  # "unit" is required
        ("get_weather", '{"city":"Paris","unit":"kelvin"}', False),
        ("get_weather", '{"city":"Paris, France","unit":"celsius"}', False),  # maxLength 10
        ("get_time", "{}", False),  # not a tool
        ("ping", '{"x":1}', False),  # ping takes no arguments
    ],
)
def test_a_call_is_refused_unless_it_names_a_tool_with_valid_arguments(
    tool_format: ToolCallFormat,
    name: str,
    arguments: str,
    valid: bool,
    tokenizers: dict[str, Tokenizer],
) -> None:
    tokenizer = tokenizers[tool_format.name]
    grammar = tool_format.triggered_grammar(FUNCTIONS, first_index=0, max_calls=1)
    m = matcher(grammar, tokenizer)
    call = CALL_TEXTS[tool_format.name].replace("NAME", name).replace("ARGS", arguments)
    ok = m.consume_tokens(tokenizer.encode(PREFIX + call))
    assert (ok and m.is_accepting()) == valid, m.get_error()


def test_a_strict_schema_llguidance_cannot_follow_is_refused_naming_it(builtin_tokenizer: Tokenizer) -> None:
    bad = FunctionSpec("f", {"type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}})
    with pytest.raises(ValueError, match="no-such-format"):
        check_grammar(HERMES.triggered_grammar([bad], first_index=0, max_calls=1), builtin_tokenizer)


@pytest.mark.parametrize(
    ("name", "parameters", "valid"),
    [
        ("get_weather", {"city": "Paris", "unit": "celsius"}, True),
        ("get_weather", {"city": "Paris", "unit": "kelvin"}, False),
        ("get_weather", {"city": "Paris"}, False),  # "unit" is required
        ("get_time", {}, False),  # not a tool
    ],
)
def test_a_qwen3_coder_call_is_refused_unless_it_names_a_tool_with_valid_arguments(
    name: str, parameters: dict[str, str], valid: bool, qwen_tokenizer: Tokenizer
) -> None:
    grammar = QWEN3_CODER.triggered_grammar(FUNCTIONS, first_index=0, max_calls=1)
    m = matcher(grammar, qwen_tokenizer)
    values = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    call = f"<tool_call>\n<function={name}>\n{values}</function>\n</tool_call>"
    ok = m.consume_tokens(qwen_tokenizer.encode(PREFIX + call))
    assert (ok and m.is_accepting()) == valid, m.get_error()
