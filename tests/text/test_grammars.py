"""Grammars for constrained decoding: built from JSON schemas, checked by llguidance against our
tokenizers (the HF ``tokenizer.json`` kind and the tiktoken kind), refused with the construct named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest

from metrale.text.grammars import (
    GrammarError,
    check_grammar,
    json_object_grammar,
    json_schema_grammar,
    llguidance_tokenizer,
)
from metrale.text.tiktoken_vocab.kimi_writer import write_kimi_tokenizer
from metrale.text.tokenizer import Tokenizer
from metrale.worker.model.builtin import builtin_model_dir

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["tokenizer.json", "tiktoken"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param == "tokenizer.json":
        return Tokenizer.from_dir(builtin_model_dir())
    directory = tmp_path_factory.mktemp("kimi-tokenizer")
    write_kimi_tokenizer(directory)
    return Tokenizer.from_dir(directory)


def accepts(grammar: str, tokenizer: Tokenizer, text: str) -> bool:
    """Whether ``text``, tokenized as the tokenizer does, is a complete sentence of ``grammar``."""
    matcher = llguidance.LLMatcher(llguidance_tokenizer(tokenizer), grammar)
    return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()


def test_the_llguidance_tokenizer_has_our_vocabulary_and_eos(tokenizer: Tokenizer) -> None:
    ll_tokenizer = llguidance_tokenizer(tokenizer)
    assert ll_tokenizer.vocab_size == tokenizer.vocab_size
    assert set(ll_tokenizer.eos_tokens) == set(tokenizer.eos_token_ids)
    text = '{"name":"Ada","age":36} 中文'
    assert ll_tokenizer.decode_str(tokenizer.encode(text)) == text


def test_a_padded_vocabulary_widens_the_llguidance_tokenizer(tokenizer: Tokenizer) -> None:
    assert llguidance_tokenizer(tokenizer, tokenizer.vocab_size + 5).vocab_size == tokenizer.vocab_size + 5
    with pytest.raises(ValueError, match="smaller than"):
        llguidance_tokenizer(tokenizer, tokenizer.vocab_size - 1)


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ('{"name":"Ada","age":36}', True),
        ('{"age":36,"name":"Ada"}', False),  # properties come in the schema's order
        ('{"name": "Ada", "age": 36}', False),  # no free whitespace
        ('{"name":"Ada"}', False),
        ('{"name":"Ada Lovelace","age":36}', False),  # maxLength 8
        ('{"name":"Ada","age":-1}', False),
    ],
)
def test_a_schema_grammar_accepts_exactly_compact_valid_json(tokenizer: Tokenizer, text: str, valid: bool) -> None:
    assert accepts(json_schema_grammar(PERSON), tokenizer, text) is valid
    if valid:
        jsonschema.validate(json.loads(text), PERSON)


def test_a_schema_with_its_own_options_keeps_them(tokenizer: Tokenizer) -> None:
    flexible = {**PERSON, "x-guidance": {"whitespace_flexible": True}}
    assert accepts(json_schema_grammar(flexible), tokenizer, '{"name": "Ada", "age": 36}')


def test_the_json_object_grammar_takes_any_object_and_nothing_else(tokenizer: Tokenizer) -> None:
    grammar = json_object_grammar()
    assert accepts(grammar, tokenizer, '{"a":[1,2.5,{"b":null}],"c":"中文"}')
    assert accepts(grammar, tokenizer, "{}")
    assert not accepts(grammar, tokenizer, "[1]")
    assert not accepts(grammar, tokenizer, '"text"')


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "if": {"required": ["a"]}, "then": {}}, 'Unimplemented keys: ["if", "then"]'),
        ({"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
        ({"type": "string", "format": "colour"}, "Unknown format: colour"),
        ({"type": "teapot"}, "Invalid type: teapot"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
        ({"$ref": "https://example.com/schema.json"}, "https://example.com/schema.json"),
    ],
)
def test_an_unsupported_schema_is_refused_naming_the_construct(
    tokenizer: Tokenizer, schema: dict[str, Any], named: str
) -> None:
    with pytest.raises(GrammarError) as refused:
        check_grammar(json_schema_grammar(schema), tokenizer)
    message = str(refused.value)
    assert named in message
    assert "\n" not in message and "|" not in message  # one line, without llguidance's excerpt


def test_a_supported_grammar_passes_the_check(tokenizer: Tokenizer) -> None:
    check_grammar(json_schema_grammar(PERSON), tokenizer)
    check_grammar(json_object_grammar(), llguidance_tokenizer(tokenizer))
    check_grammar('start: "yes" | "no"', tokenizer)


def test_special_tokens_are_checked_against_the_tokenizer(tokenizer: Tokenizer) -> None:
    check_grammar("start: <|im_end|>", tokenizer)
    with pytest.raises(GrammarError, match="unknown special token"):
        check_grammar("start: <|no_such_token|>", tokenizer)


def test_broken_lark_and_empty_grammars_are_refused(tokenizer: Tokenizer) -> None:
    with pytest.raises(GrammarError, match="Expected"):
        check_grammar("start: foo(", tokenizer)
    with pytest.raises(GrammarError, match="empty"):
        check_grammar("  \n", tokenizer)


def test_a_schema_must_be_a_json_object() -> None:
    with pytest.raises(GrammarError, match="must be an object"):
        json_schema_grammar(["type", "object"])  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="not JSON"):
        json_schema_grammar({"type": "number", "maximum": float("nan")})


def test_a_kimi_tool_call_grammar_matches_the_release_tokens(tmp_path: Path) -> None:
    """What a forced tool call's grammar looks like: Kimi's special tokens around ``%json`` arguments."""
    write_kimi_tokenizer(tmp_path)
    kimi = Tokenizer.from_dir(tmp_path)
    arguments = json_schema_grammar(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    )
    grammar = (
        'start: <|tool_calls_section_begin|> <|tool_call_begin|> "functions.get_weather:0" '
        "<|tool_call_argument_begin|> arguments <|tool_call_end|> <|tool_calls_section_end|>\n"
        + arguments.replace("start:", "arguments:")
    )
    check_grammar(grammar, kimi)
    call = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city":"Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    assert accepts(grammar, kimi, call)
    assert not accepts(grammar, kimi, call.replace('"Oslo"', "7"))
