"""Qwen3-Coder XML calls: whole texts parse to the calls they hold (values typed by the tool's schema,
as vLLM's ``qwen3_coder`` parser types them), any split of a text parses the same, and every sentence
of the forced-call grammar, sampled under llguidance's mask, parses into valid calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.text.chat_templates.qwen import QWEN3_5_CHAT_TEMPLATE
from metrale.text.grammars import GrammarError, check_grammar
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.formats import QWEN3_CODER, format_for_template, format_named
from metrale.text.tool_calls.grammar import FunctionSpec
from metrale.text.tool_calls.parser import ToolCall, fold_deltas, parse_whole, read_whole
from metrale.text.tool_calls.qwen3_coder import Qwen3CoderToolCallParser, call_text, convert_value
from metrale.text.tool_calls.qwen3_coder_grammar import qwen3_coder_forced_grammar
from tests.text.qwen_shaped import write_qwen_shaped_model
from tests.text.tool_calls.test_grammar import sample

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hourly": {"type": "boolean"},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
            "required": ["lat"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
FUNCTIONS = [FunctionSpec("get_weather", WEATHER), FunctionSpec("ping", None)]
SCHEMAS = {function.name: function.parameters for function in FUNCTIONS}

TWO_CALLS = (
    "Let me check.\n\n"
    + call_text("get_weather", {"city": "Paris", "unit": "celsius", "days": 3, "hourly": True, "tags": ["a"]})
    + "\n"
    + call_text("ping", {})
)


def parser() -> Qwen3CoderToolCallParser:
    return Qwen3CoderToolCallParser(lambda index: f"call_{index}", SCHEMAS)


def test_blocks_parse_into_calls_with_values_typed_by_the_schema() -> None:
    content, calls = parse_whole(parser(), TWO_CALLS)
    assert content == "Let me check.\n\n"
    arguments = '{"city":"Paris","unit":"celsius","days":3,"hourly":true,"tags":["a"]}'
    assert calls == [ToolCall("call_0", "get_weather", arguments), ToolCall("call_1", "ping", "{}")]


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("42", {"type": "integer"}, 42),
        ("4.5", {"type": "number"}, 4.5),
        ("4", {"type": "number"}, 4),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("NULL", {"type": "string"}, None),
        ("42", {"type": "string"}, "42"),
        ("forty", {"type": "integer"}, "forty"),
        ("[1", {"type": "array"}, "[1"),
        ("7", None, "7"),
        ("7", {"type": ["null", "integer"]}, 7),
    ],
)
def test_a_value_is_converted_as_vllm_converts_it(text: str, schema: Any, value: Any) -> None:
    assert convert_value(text, schema) == value


def test_a_value_keeps_its_own_newlines_and_markup_less_text() -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n\nNew\nYork\n\n</parameter>\n</function>\n</tool_call>"
    )
    (call,) = parse_whole(parser(), text)[1]
    assert json.loads(call.arguments) == {"city": "\nNew\nYork\n"}


def test_a_value_also_ends_at_the_next_parameter_or_the_function_end() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</function>\n</tool_call>"
    (call,) = parse_whole(parser(), text)[1]
    assert json.loads(call.arguments) == {"city": "Oslo", "days": 2}


def test_text_without_calls_and_text_after_calls_are_content_blank_lines_between_are_not() -> None:
    assert parse_whole(parser(), "No tools <tool here") == ("No tools <tool here", [])
    content, calls = parse_whole(parser(), call_text("ping", {}) + "\n\n" + call_text("ping", {}) + "\n")
    assert (content, [call.name for call in calls]) == ("", ["ping", "ping"])
    assert parse_whole(parser(), call_text("ping", {}) + "\nDone.")[0] == "\nDone."


def test_a_call_cut_off_keeps_the_arguments_it_had_and_a_nameless_one_is_dropped() -> None:
    cut = "Hi<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert parse_whole(parser(), cut) == ("Hi", [ToolCall("call_0", "get_weather", '{"city":"Par"}')])
    assert parse_whole(parser(), "Hi<tool_call>\n<function=get_we") == ("Hi", [])
    assert read_whole(parser(), cut).cut_off and read_whole(parser(), "Hi<tool_call>").cut_off
    assert not read_whole(parser(), TWO_CALLS).cut_off


def test_an_argument_the_schema_does_not_declare_is_kept_as_text() -> None:
    text = "<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    assert parse_whole(parser(), text)[1] == [ToolCall("call_0", "other", '{"n":"5"}')]


def test_the_header_comes_before_the_arguments_when_streamed() -> None:
    p = parser()
    first = p.push("<tool_call>\n<function=get_weather>\n<param")
    assert [(c.id, c.name, c.arguments) for c in first.calls] == [("call_0", "get_weather", "")]
    assert p.push("eter=city>\nRome\n</parameter>\n").calls[0].arguments == '{"city":"Rome"'


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_split_of_a_text_parses_like_the_whole_text(data: st.DataObject) -> None:
    text = data.draw(
        st.sampled_from(
            [
                TWO_CALLS,
                TWO_CALLS + "\nafter",
                TWO_CALLS[:-9],
                "a < b <tool <function=x> </tool_call>",
                "<tool_call>\n<function=>\n<parameter=a>\nb\n</parameter>\n</function>\n</tool_call>tail",
            ]
        )
    )
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    streamed = parser()
    deltas = [streamed.push(piece) for piece in pieces] + [streamed.finish()]
    assert fold_deltas(deltas) == parse_whole(parser(), text)


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_qwen_shaped_model(tmp_path_factory.mktemp("qwen") / "model"))


@pytest.mark.parametrize("max_calls", [1, 3])
def test_every_sampled_sentence_of_the_forced_grammar_is_valid_calls(max_calls: int, qwen_tokenizer: Tokenizer) -> None:
    grammar = qwen3_coder_forced_grammar(FUNCTIONS, max_calls=max_calls)
    check_grammar(grammar, qwen_tokenizer)
    counts = set()
    for seed in range(20):
        text = qwen_tokenizer.decode(sample(grammar, qwen_tokenizer, seed), skip_special_tokens=True)
        content, calls = parse_whole(parser(), text)
        assert content == ""
        assert 1 <= len(calls) <= max_calls
        counts.add(len(calls))
        for call in calls:
            schema = SCHEMAS[call.name] or {"type": "object", "maxProperties": 0}
            jsonschema.validate(json.loads(call.arguments), schema)
    assert max(counts) > 1 or max_calls == 1


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^a+$"},
        {"type": "string", "format": "date"},
        {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        {"type": ["string", "integer"]},
        {"enum": [1, 2]},
    ],
    ids=["pattern", "format", "anyOf", "two-types", "untyped-number-enum"],
)
def test_what_raw_text_cannot_honour_is_refused(schema: dict[str, Any]) -> None:
    function = FunctionSpec("f", {"type": "object", "properties": {"x": schema}, "required": ["x"]})
    with pytest.raises(GrammarError, match="argument 'x'"):
        qwen3_coder_forced_grammar([function], max_calls=1)


def test_the_grammar_refuses_a_value_that_holds_a_value_end(qwen_tokenizer: Tokenizer, tmp_path: Path) -> None:
    import llguidance

    from metrale.text.grammars import llguidance_tokenizer

    function = FunctionSpec("f", {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]})
    grammar = qwen3_coder_forced_grammar([function], max_calls=1)
    head = "<tool_call>\n<function=f>\n<parameter=x>\n"

    def accepts(value: str) -> bool:
        matcher = llguidance.LLMatcher(llguidance_tokenizer(qwen_tokenizer), grammar, log_level=0)
        text = head + value + "\n</parameter>\n</function>\n</tool_call>"
        return all(matcher.consume_token(t) for t in qwen_tokenizer.encode(text)) and matcher.is_accepting()

    assert accepts("two\nlines")
    assert not accepts("a</parameter>b")
    assert not accepts("a<parameter=y>b")
    assert not accepts("null")


def test_a_qwen_template_picks_the_format_and_its_strict_auto_grammar_compiles(qwen_tokenizer: Tokenizer) -> None:
    assert format_for_template(QWEN3_5_CHAT_TEMPLATE) is QWEN3_CODER
    assert format_named("qwen3_coder") is QWEN3_CODER
    check_grammar(QWEN3_CODER.triggered_grammar(FUNCTIONS, first_index=0, max_calls=4), qwen_tokenizer)
    typed = QWEN3_CODER.new_parser(lambda index: f"call_{index}", FUNCTIONS)
    assert parse_whole(typed, TWO_CALLS) == parse_whole(parser(), TWO_CALLS)
