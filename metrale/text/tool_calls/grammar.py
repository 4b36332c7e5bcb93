"""Grammars for tool calls: forced ones (``tool_choice`` "required" or a named function), and the
structural tags of strict tools in ``auto`` mode (free text until the model opens a call, then only
valid calls: ``ToolCallFormat.triggered_grammar`` lowers them with llguidance's ``StructTag``).

The grammars are llguidance's Lark syntax: special tokens are written ``<|name|>``, each function's
arguments are ``%json`` with its ``parameters`` schema. JSON is forced without free whitespace
(``"x-guidance": {"whitespace_flexible": false}``, unless the schema sets its own ``x-guidance``), so
the only unbounded parts left are those the schema leaves unbounded (strings without ``maxLength``,
arrays without ``maxItems``, ...). A section holds 1 to ``max_calls`` calls; Kimi's call ids number
the calls of the whole chat, from ``first_index``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llguidance import StructTag

from metrale.text.tool_calls import hermes, kimi_k2

MAX_FORCED_CALLS = 16
"""The most calls a forced section may hold with ``parallel_tool_calls`` true."""

EMPTY_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments of a function declared without ``parameters``: none (``{}``)."""


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """A function the call may name, and the JSON schema of its arguments (an object)."""

    name: str
    parameters: Mapping[str, Any] | None


def arguments_schema(function: FunctionSpec) -> dict[str, Any]:
    """The schema ``%json`` forces for ``function``'s arguments: compact JSON unless it says otherwise."""
    schema = dict(function.parameters if function.parameters is not None else EMPTY_PARAMETERS)
    schema.setdefault("x-guidance", {"whitespace_flexible": False})
    return schema


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _argument_rules(functions: Sequence[FunctionSpec]) -> list[str]:
    return [f"args_{i}: %json {json.dumps(arguments_schema(f), ensure_ascii=False)}" for i, f in enumerate(functions)]


def _nested_calls(max_calls: int) -> list[str]:
    """``calls_0: call_0 calls_1?`` ... : 1 to ``max_calls`` calls, each rule knowing its position."""
    rules = [f"calls_{k}: call_{k} calls_{k + 1}?" for k in range(max_calls - 1)]
    return [*rules, f"calls_{max_calls - 1}: call_{max_calls - 1}"]


def kimi_forced_grammar(functions: Sequence[FunctionSpec], *, first_index: int, max_calls: int) -> str:
    """A Kimi section of 1..``max_calls`` calls to ``functions``, ids ``functions.NAME:IDX`` from ``first_index``."""
    head = "start: <|tool_calls_section_begin|> calls_0 <|tool_calls_section_end|>"
    return _kimi_section(head, functions, first_index, max_calls)


def kimi_call_tags(functions: Sequence[FunctionSpec], *, first_index: int, max_calls: int) -> list[StructTag]:
    """One tag: the section the model opens with ``<|tool_calls_section_begin|>``, then 1..``max_calls``
    calls to ``functions`` as ``kimi_forced_grammar`` writes them (a second section, should the model
    open one, numbers its calls from ``first_index`` again)."""
    rest = _kimi_section("start: calls_0 <|tool_calls_section_end|>", functions, first_index, max_calls)
    return [StructTag(trigger=kimi_k2.SECTION_BEGIN, begin=kimi_k2.SECTION_BEGIN, grammar=rest, end="")]


def _kimi_section(head: str, functions: Sequence[FunctionSpec], first_index: int, max_calls: int) -> str:
    lines = ["%llguidance {}", head, *_nested_calls(max_calls)]
    for k in range(max_calls):
        choices = " | ".join(
            f"{_lark_string(kimi_k2.call_header(f.name, first_index + k))} <|tool_call_argument_begin|> args_{i}"
            for i, f in enumerate(functions)
        )
        lines.append(f"call_{k}: <|tool_call_begin|> ({choices}) <|tool_call_end|>")
    return "\n".join([*lines, *_argument_rules(functions)]) + "\n"


def hermes_forced_grammar(functions: Sequence[FunctionSpec], *, max_calls: int) -> str:
    """1..``max_calls`` ``<tool_call>`` blocks to ``functions``, separated by newlines."""
    lines = ["%llguidance {}", "start: calls_0", *_nested_calls(max_calls)]
    lines += ["call_0: call", *(f'call_{k}: "\\n" call' for k in range(1, max_calls))]
    choices = []
    for i, function in enumerate(functions):
        head, tail = _hermes_call_ends(function.name)
        choices.append(f"{_lark_string(head)} args_{i} {_lark_string(tail)}")
    lines.append(f"call: {' | '.join(choices)}")
    return "\n".join([*lines, *_argument_rules(functions)]) + "\n"


def hermes_call_tags(functions: Sequence[FunctionSpec]) -> list[StructTag]:
    """A tag per function: once the model writes ``<tool_call>``, a whole block calling one of
    ``functions`` with valid arguments. Blocks may follow one another (the parser keeps the first
    ``max_calls``)."""
    tags = []
    for function in functions:
        head, tail = _hermes_call_ends(function.name)
        tags.append(StructTag(trigger=hermes.CALL_OPEN, begin=head, grammar=arguments_schema(function), end=tail))
    return tags


def _hermes_call_ends(name: str) -> tuple[str, str]:
    """The text of a block to ``name`` before its arguments, and after them."""
    return hermes.CALL_OPEN + "\n" + '{"name": ' + json.dumps(name) + ', "arguments": ', "}\n" + hermes.CALL_CLOSE
