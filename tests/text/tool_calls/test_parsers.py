"""The tool-call parsers: whole texts parse to the calls they hold, and any split of a text into pieces
(streaming) adds up to the same content and calls."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.text.builtin_tokenizer import CHAT_TEMPLATE
from metrale.text.chat_templates.kimi import KIMI_CHAT_TEMPLATE
from metrale.text.tool_calls.formats import HERMES, KIMI_K2, format_for_template, format_named
from metrale.text.tool_calls.hermes import HermesToolCallParser, call_text
from metrale.text.tool_calls.kimi_k2 import KimiToolCallParser, name_of
from metrale.text.tool_calls.parser import (
    CallLimit,
    ParsedDelta,
    ToolCall,
    ToolCallParser,
    fold_deltas,
    parse_whole,
    read_whole,
)

B, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

KIMI_TWO_CALLS = (
    f'Let me check.{B}{CB}functions.get_weather:0{AB}{{"city": "Paris"}}{CE}'
    f'{CB}functions.get_time:1{AB}{{"zone":"CET"}}{CE}{E}'
)
HERMES_TWO_CALLS = (
    "Let me check.\n" + call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("get_time", {"zone": "CET"})
)


def ids(index: int) -> str:
    return f"call_{index}"


def kimi() -> ToolCallParser:
    return KimiToolCallParser()


def hermes() -> ToolCallParser:
    return HermesToolCallParser(ids)


def test_a_kimi_section_parses_into_its_calls_with_the_text_before_it_as_content() -> None:
    content, calls = parse_whole(kimi(), KIMI_TWO_CALLS)
    assert content == "Let me check."
    assert calls == [
        ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
        ToolCall("functions.get_time:1", "get_time", '{"zone":"CET"}'),
    ]


def test_hermes_blocks_parse_into_calls_with_generated_ids_and_compact_arguments() -> None:
    content, calls = parse_whole(hermes(), HERMES_TWO_CALLS)
    assert content == "Let me check.\n"
    assert calls == [
        ToolCall("call_0", "get_weather", '{"city":"Paris"}'),
        ToolCall("call_1", "get_time", '{"zone":"CET"}'),
    ]


@pytest.mark.parametrize(
    ("header", "name"),
    [("functions.get_weather:0", "get_weather"), ("get_weather:12", "get_weather"), ("functions.a.b:3", "a.b")],
)
def test_a_kimi_header_names_its_function(header: str, name: str) -> None:
    assert name_of(header) == name


def test_text_without_calls_is_all_content() -> None:
    for parser in (kimi(), hermes()):
        assert parse_whole(parser, "No tools <tool here: {}") == ("No tools <tool here: {}", [])


def test_text_after_a_kimi_section_is_content_and_text_between_calls_is_dropped() -> None:
    text = f"A{B} junk {CB}functions.f:0{AB}{{}}{CE} more junk {E}B"
    assert parse_whole(kimi(), text) == ("AB", [ToolCall("functions.f:0", "f", "{}")])


def test_a_kimi_call_cut_off_keeps_the_arguments_it_had() -> None:
    text = f'{B}{CB}functions.f:0{AB}{{"a": "unfinis'
    assert parse_whole(kimi(), text) == ("", [ToolCall("functions.f:0", "f", '{"a": "unfinis')])


def test_a_kimi_call_without_a_name_or_without_arguments_is_not_a_call() -> None:
    text = f"{B}{CB}functions.:0{AB}{{}}{CE}{CB}functions.g:1{CE}{E}"
    assert parse_whole(kimi(), text) == ("", [])


def test_a_hermes_block_that_is_not_a_call_object_stays_content() -> None:
    text = "<tool_call>\nnot json\n</tool_call> and <tool_call>[1]</tool_call>"
    assert parse_whole(hermes(), text) == (text, [])


def test_an_unclosed_hermes_block_is_a_call_once_named_and_never_content() -> None:
    assert parse_whole(hermes(), '<tool_call>{"name": "f", "arguments": {}}') == ("", [ToolCall("call_0", "f", "{}")])
    assert parse_whole(hermes(), '<tool_call>{"name": "f", "argu') == ("", [ToolCall("call_0", "f", "")])
    cut = '<tool_call>\n{"name": "f", "arguments": {"city": "Par'
    assert parse_whole(hermes(), cut) == ("", [ToolCall("call_0", "f", '{"city": "Par')])
    assert parse_whole(hermes(), 'Hi <tool_call>\n{"name": "get_wea') == ("Hi ", [])
    assert parse_whole(hermes(), "See <tool_call> tags") == ("See <tool_call> tags", [])  # not a call's start


def read(parser: ToolCallParser, text: str) -> ParsedDelta:
    return read_whole(parser, text)


@pytest.mark.parametrize(
    ("whole", "new_parser"), [(KIMI_TWO_CALLS, kimi), (HERMES_TWO_CALLS, hermes)], ids=["kimi_k2", "hermes"]
)
def test_every_cut_of_a_reply_is_content_then_calls_and_never_markup(
    whole: str, new_parser: type[ToolCallParser]
) -> None:
    """Cut anywhere (``max_tokens``, a stop string): the content is a prefix of the whole reply's, the
    calls are the whole reply's first ones with a prefix of the last one's arguments, and ``cut_off``
    says whether the text ended inside a call."""
    full_content, full_calls = parse_whole(new_parser(), whole)
    inside_special = {i for m in re.finditer(r"<\|[a-z_]+\|>", whole) for i in range(m.start() + 1, m.end())}
    for end in sorted(set(range(len(whole) + 1)) - inside_special):  # a special token is one token
        parsed = read(new_parser(), whole[:end])
        content, calls = fold_deltas([parsed])
        assert full_content.startswith(content), whole[:end]
        assert not any(marker in content for marker in ("<tool_call", "<|tool", '{"name"')), whole[:end]
        assert [c.name for c in calls] == [c.name for c in full_calls[: len(calls)]]
        for got, expected in zip(calls[:-1], full_calls, strict=False):
            assert got == expected
        if calls:  # the last call: whole, or the text written of its arguments
            last = calls[-1]
            assert last == full_calls[len(calls) - 1] or (parsed.cut_off and last.arguments in whole)
        if parsed.cut_off:
            assert content == full_content and end < len(whole)
    assert not read(new_parser(), whole).cut_off


def test_a_hermes_reply_cut_inside_its_opening_tag_drops_the_tag() -> None:
    parsed = read(hermes(), "Let me check.\n<tool_c")
    assert (parsed.content, parsed.calls, parsed.cut_off) == ("Let me check.\n", [], True)


def test_whitespace_after_hermes_calls_is_not_content_but_text_after_them_is() -> None:
    call = call_text("f", {})
    assert parse_whole(hermes(), f"{call}\n\n") == ("", [ToolCall("call_0", "f", "{}")])
    assert parse_whole(hermes(), f"{call}\n done") == ("\n done", [ToolCall("call_0", "f", "{}")])


def test_a_call_limit_keeps_the_first_calls() -> None:
    _, calls = parse_whole(CallLimit(kimi(), 1), KIMI_TWO_CALLS)
    assert [call.name for call in calls] == ["get_weather"]


def test_the_first_delta_of_a_kimi_call_names_it_and_arguments_stream_in_pieces() -> None:
    parser = kimi()
    first = parser.push(f"Hi{B}{CB}functions.f:0{AB}")
    assert first.content == "Hi"
    assert [(c.index, c.id, c.name, c.arguments) for c in first.calls] == [(0, "functions.f:0", "f", "")]
    second = parser.push('{"a": 1')
    assert [(c.index, c.id, c.name, c.arguments) for c in second.calls] == [(0, None, None, '{"a": 1')]
    third = parser.push(f"}}{CE}<|tool_calls")  # the start of a marker is held back
    assert [c.arguments for c in third.calls] == ["}"]
    assert parser.push("_section_end|>").empty
    assert parser.finish().empty


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(cut, len(text)) for cut in cuts})
    edges = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


def _streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    return fold_deltas([*(parser.push(piece) for piece in pieces), parser.finish()])


SAMPLES = [
    KIMI_TWO_CALLS,
    HERMES_TWO_CALLS,
    f'text {B}{CB}functions.f:0{AB}{{"s": "<|tool_call_end"}}{CE}{E} after <tool_call',
    f"{B}{CB}functions.f:0{AB}{{}}",
    "<tool_call>\nbad\n</tool_call>" + call_text("g", {"x": [1, 2]}) + "\n\n tail <",
    '<tool_call>{"name": "f", "arguments": {"q": "</tool_"}}',
]


@settings(derandomize=True, max_examples=300, deadline=None)
@given(sample=st.sampled_from(SAMPLES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=40))
def test_any_split_of_a_text_streams_to_the_calls_of_the_whole(sample: str, cuts: list[int]) -> None:
    pieces = _pieces(sample, cuts)
    assert "".join(pieces) == sample
    for new_parser in (kimi, hermes):
        assert _streamed(new_parser(), pieces) == parse_whole(new_parser(), sample)


MARKER_SOUP = st.lists(
    st.sampled_from(
        [
            B,
            E,
            CB,
            AB,
            CE,
            "functions.f:0",
            "functions.g:1",
            '{"a": 1}',
            "<",
            "|",
            " ",
            "x",
            "\n",
            "<tool_call>",
            "</tool_call>",
            '{"name": "f", "arguments": {}}',
            "}",
            "<tool_",
        ]
    ),
    max_size=30,
).map("".join)


@settings(derandomize=True, max_examples=400, deadline=None)
@given(text=MARKER_SOUP, cuts=st.lists(st.integers(min_value=0, max_value=500), max_size=30))
def test_any_split_of_any_marker_soup_streams_to_the_whole(text: str, cuts: list[int]) -> None:
    pieces = _pieces(text, cuts)
    for new_parser in (kimi, hermes):
        assert _streamed(new_parser(), pieces) == parse_whole(new_parser(), text)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(arguments=st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=8)), max_size=4))
def test_arguments_of_any_json_object_come_back_as_that_object(arguments: dict[str, object]) -> None:
    kimi_text = f"{B}{CB}functions.f:0{AB}{json.dumps(arguments)}{CE}{E}"
    (kimi_call,) = parse_whole(kimi(), kimi_text)[1]
    (hermes_call,) = parse_whole(hermes(), call_text("f", arguments))[1]
    assert json.loads(kimi_call.arguments) == json.loads(hermes_call.arguments) == arguments


def test_the_format_is_chosen_from_the_chat_template_or_by_name() -> None:
    assert format_for_template(KIMI_CHAT_TEMPLATE) is KIMI_K2
    assert format_for_template(CHAT_TEMPLATE) is HERMES
    assert format_for_template("{{ messages }}") is None
    assert format_named("hermes") is HERMES
    with pytest.raises(ValueError, match="known: kimi_k2, hermes"):
        format_named("mistral")
