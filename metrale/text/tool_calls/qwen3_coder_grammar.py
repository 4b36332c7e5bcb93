"""The grammar that forces Qwen3-Coder XML calls (``tool_choice`` "required" or a named function).

``<tool_call>`` and ``</tool_call>`` are tokens of the tokenizer (added tokens in the Qwen releases,
which llguidance matches as tokens, not as text): the grammar names them as such, so a model whose
tokenizer lacks them cannot be forced into this format (``check_grammar`` says which is unknown).

A call writes its function's arguments in the order the ``parameters`` schema lists its
``properties`` (then any ``required`` name it does not list): required ones always, the others
optionally. Each value is written as the parser reads it back (``qwen3_coder.convert_value``):

- a ``string`` argument as raw text, ``minLength``..``maxLength`` characters, holding none of the
  markers that end a value and not the word ``null``; a string ``enum`` (or ``const``) as one of its
  values;
- any other single ``type`` (integer, number, boolean, object, array, null) as JSON, by llguidance's
  ``%json`` with the argument's schema (compact, as ``grammar.arguments_schema`` forces).

What raw text cannot honour is refused (``GrammarError``): a string ``pattern`` or ``format``, a value
without a ``type`` that is not a string enum, several types, ``anyOf`` and the like, an argument name
holding ``>`` or a newline.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from llguidance import StructTag

from metrale.text.grammars import JSON_OPTIONS, GrammarError
from metrale.text.tool_calls import qwen3_coder
from metrale.text.tool_calls.grammar import EMPTY_PARAMETERS, FunctionSpec

VALUE_END = "\n" + qwen3_coder.PARAMETER_CLOSE + "\n"
"""What follows every value the grammar writes."""

_COMBINATORS = ("anyOf", "oneOf", "allOf", "not", "$ref", "if")


def qwen3_coder_forced_grammar(functions: Sequence[FunctionSpec], *, max_calls: int) -> str:
    """1..``max_calls`` ``<tool_call>`` blocks to ``functions``, one a line; ``GrammarError`` for an
    argument schema raw text cannot honour (see the module docstring)."""
    lines = ["%llguidance {}", "start: calls_0"]
    for k in range(max_calls):
        call = "call" if k == 0 else '"\\n" call'  # calls one a line
        lines.append(f"calls_{k}: {call} calls_{k + 1}?" if k < max_calls - 1 else f"calls_{k}: {call}")
    choices = []
    for i, function in enumerate(functions):
        head = _lark_string(f"\n{qwen3_coder.FUNCTION_OPEN}{function.name}>\n")
        tail = _lark_string(f"{qwen3_coder.FUNCTION_CLOSE}\n")
        arguments, rules = _argument_rules(i, function)
        lines += rules
        choices.append(" ".join([qwen3_coder.CALL_OPEN, head, *arguments, tail, qwen3_coder.CALL_CLOSE]))
    lines.append(f"call: {' | '.join(choices)}")
    return "\n".join(lines) + "\n"


def _argument_rules(i: int, function: FunctionSpec) -> tuple[list[str], list[str]]:
    """The sequence of argument items of function ``i`` and the rules they name."""
    schema = function.parameters if function.parameters is not None else EMPTY_PARAMETERS
    properties = schema.get("properties") or {}
    required = [name for name in schema.get("required") or [] if isinstance(name, str)]
    names = [*properties, *(name for name in required if name not in properties)]
    items: list[str] = []
    rules: list[str] = []
    for j, name in enumerate(names):
        where = f"function {function.name!r}, argument {name!r}"
        if not name or ">" in name or "\n" in name:
            raise GrammarError(f"{where}: the qwen3_coder format cannot write this argument name")
        rule = f"arg_{i}_{j}"
        opening = _lark_string(f"{qwen3_coder.PARAMETER_OPEN}{name}>\n")
        rules.append(f"{rule}: {opening} {_value(properties.get(name, {}), f'{i}_{j}', rules, where)}")
        items.append(rule if name in required else f"{rule}?")
    return items, rules


def _value(schema: Any, key: str, rules: list[str], where: str) -> str:
    """The grammar of one value followed by ``VALUE_END``."""
    if not isinstance(schema, Mapping):
        schema = {}
    kind = schema.get("type")
    combined = [word for word in _COMBINATORS if word in schema]
    if combined or isinstance(kind, list):
        what = ", ".join(combined) if combined else "several types"
        raise GrammarError(f"{where}: the qwen3_coder format writes values by one type; {what} is not supported")
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if kind in (None, "string") and choices is not None:
        if not choices or not all(isinstance(choice, str) for choice in choices):
            raise GrammarError(f"{where}: an enum without a type must list strings")
        return "(" + " | ".join(_lark_string(choice + VALUE_END) for choice in choices) + ")"
    if kind in (None, "string"):
        for word in ("pattern", "format"):
            if word in schema:
                raise GrammarError(f"{where}: string '{word}' is not supported in the qwen3_coder format")
        terminal = f"VALUE_{key.upper()}"
        rules.append(f"{terminal}: {_raw_text(schema.get('minLength', 0), schema.get('maxLength'))}")
        return terminal
    json_rule = f"json_{key}"
    with_options = dict(schema) if "x-guidance" in schema else {**schema, "x-guidance": dict(JSON_OPTIONS)}
    rules.append(f"{json_rule}: %json {json.dumps(with_options, ensure_ascii=False)}")
    return f"{json_rule} {_lark_string(VALUE_END)}"


def _raw_text(low: int, high: int | None) -> str:
    """A lexeme: ``low``..``high`` characters holding no value end and not ``null``, then ``VALUE_END``."""
    end = _regex_text(VALUE_END)
    count = f"{{{low},{'' if high is None else high}}}"
    markers = "|".join(_regex_text(marker) for marker in qwen3_coder.VALUE_ENDS)
    return f"/(?s:.{count}){end}/ & ~/(?s:.*({markers}).*{end})/ & ~/(?i:null){end}/"


def _regex_text(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/``."""
    return "".join("\\n" if char == "\n" else re.escape(char) for char in text).replace("/", "\\/")


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def qwen3_coder_call_tags(functions: Sequence[FunctionSpec]) -> list[StructTag]:
    """A tag per function: once the model writes ``<tool_call>`` (a token), a whole block calling one
    of ``functions`` with arguments written as ``qwen3_coder_forced_grammar`` writes them, closed by
    the ``</tool_call>`` token (named in the tag's grammar: a tag's ``end`` is text)."""
    tags = []
    for i, function in enumerate(functions):
        arguments, rules = _argument_rules(i, function)
        closing = f"{_lark_string(qwen3_coder.FUNCTION_CLOSE + chr(10))} {qwen3_coder.CALL_CLOSE}"
        grammar = "\n".join(["%llguidance {}", f"start: {' '.join([*arguments, closing])}", *rules]) + "\n"
        begin = f"{qwen3_coder.CALL_OPEN}\n{qwen3_coder.FUNCTION_OPEN}{function.name}>\n"
        tags.append(StructTag(trigger=qwen3_coder.CALL_OPEN, begin=begin, grammar=grammar, end=""))
    return tags
