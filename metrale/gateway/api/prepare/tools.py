"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request: checked, then planned.

OpenAI's semantics, as vLLM serves them:

- ``tools`` are function tools (``{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}``); they go to the chat template as given. A model whose template does not
  declare tools cannot take them (400), nor can one whose call format is unknown (the server may name
  it: ``--tool-call-parser``).
- ``tool_choice`` ``"auto"`` (the default with tools): the output is parsed; calls the model makes
  become ``message.tool_calls``. ``"none"``: the tools are still in the prompt (vLLM's default), the
  output is plain text and never parsed. ``"required"``: decoding is constrained to a call section of
  one or more calls to any of the tools, each call's arguments valid for its ``parameters`` schema. A
  named function (``{"type": "function", "function": {"name": ...}}``): exactly one call to it.
- ``parallel_tool_calls: false``: at most one call (forced grammars allow one; parsed output keeps the
  first).
- ``strict: true`` on a function is kept whenever decoding is forced. With ``"auto"`` and a strict
  function, the model may answer in text or call a tool; once it opens a call (its format's
  ``trigger``), decoding is constrained to a call to one of the tools (``triggered_grammar``): a
  strict function's arguments valid for its schema, a non-strict one's any JSON object. Without a
  strict function, ``"auto"`` decoding is free.
- With a ``response_format`` that constrains (``json_object``, ``json_schema``), as OpenAI serves it:
  a forced call governs its turn (the format shapes a text answer, which a forced turn does not
  give); in ``"auto"`` mode, strict tools or not, the model either answers in the format or opens
  calls at once, each constrained as strict ``"auto"`` constrains them (``answer_or_calls_grammar``);
  with ``"none"`` only the format constrains. The tool plan's grammar thus already holds the format
  wherever the format applies (``structured_outputs.request_grammar`` relies on it).
- A call cut off (``max_tokens``, a stop string) is a call with the arguments written so far, never
  markup in ``content`` (``tool_call_output.py``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metrale.gateway.api.prepare.sampling import require
from metrale.gateway.api.prepare.structured_outputs import refuse_endless_functions, response_format_grammar
from metrale.gateway.request_bodies import ChatCompletionRequest, ChatMessage
from metrale.shared.errors import BadRequest
from metrale.text.grammars import GrammarError
from metrale.text.tokenizer import Tokenizer
from metrale.text.tool_calls.formats import ToolCallFormat, format_for_template, format_named
from metrale.text.tool_calls.grammar import MAX_FORCED_CALLS, FunctionSpec
from metrale.text.tool_calls.parser import CallLimit, ToolCallParser

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""OpenAI's rule for function names."""

TOOL_CHOICES = ("auto", "none", "required")

ANY_ARGUMENTS = {"type": "object"}
"""The arguments of a non-strict function when calls are constrained: any JSON object."""


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What the tools of a request change: the format its output is parsed in (None: plain text), the
    grammar that forces or constrains calls (None: free decoding), the most calls kept (None: any
    number), and the request field a grammar the model cannot follow is blamed on."""

    tool_format: ToolCallFormat | None = None
    grammar: str | None = None
    max_calls: int | None = None
    grammar_param: str = "tool_choice"
    functions: tuple[FunctionSpec, ...] = ()
    """The request's functions (a format whose values are untyped text types them by their schemas)."""

    def new_parser(self, request_id: str, choice: int) -> ToolCallParser | None:
        """The parser of one choice's text, or None when the output is not parsed."""
        if self.tool_format is None:
            return None
        parser = self.tool_format.new_parser(lambda index: call_id(request_id, choice, index), self.functions)
        return CallLimit(parser, self.max_calls)


NO_TOOLS = ToolPlan()


def call_id(request_id: str, choice: int, index: int) -> str:
    """``call_`` + 24 hex digits, the same for the same request, choice and call."""
    digest = hashlib.sha256(f"{request_id}/{choice}/{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def plan_tools(body: ChatCompletionRequest, tokenizer: Tokenizer, parser_name: str | None = None) -> ToolPlan:
    """Check the tool fields of ``body`` (400 naming the field) and plan them for ``tokenizer``'s model;
    ``parser_name`` (``--tool-call-parser``) overrides the format the chat template implies."""
    if body.tools is None:
        require(body.tool_choice in (None, "none"), "tool_choice is only allowed when tools are given", "tool_choice")
        alone = "parallel_tool_calls is only allowed when tools are given"
        require(body.parallel_tool_calls is None, alone, "parallel_tool_calls")
        return NO_TOOLS
    functions = check_tools(body.tools)
    choice = check_tool_choice(body.tool_choice, functions)
    template = tokenizer.chat_template or ""
    require("tools" in template, "This model's chat template does not declare tools.", "tools")
    if choice == "none":
        return NO_TOOLS  # the tools are in the prompt; the answer is text
    tool_format = format_named(parser_name) if parser_name is not None else format_for_template(template)
    require(
        tool_format is not None,
        "This model's chat template writes tool calls in no format Metrale knows; "
        "start the server with --tool-call-parser to name one.",
        "tools",
    )
    assert tool_format is not None
    parallel = body.parallel_tool_calls is not False
    if choice == "auto":
        return _auto_plan(tool_format, body, functions, parallel)
    forced = [choice] if isinstance(choice, FunctionSpec) else functions
    refuse_endless_functions(forced)
    most = 1 if isinstance(choice, FunctionSpec) or not parallel else MAX_FORCED_CALLS
    try:
        grammar = tool_format.forced_grammar(forced, first_index=calls_in(body.messages), max_calls=most)
    except GrammarError as error:
        raise BadRequest(f"tools cannot be forced in the {tool_format.name} format: {error}", param="tools") from None
    # build_submission checks the grammar (and response_format)
    return ToolPlan(tool_format, grammar, most, functions=tuple(functions))


def _auto_plan(
    tool_format: ToolCallFormat, body: ChatCompletionRequest, functions: Sequence[FunctionSpec], parallel: bool
) -> ToolPlan:
    """``"auto"``: free decoding, unless a function is strict or ``response_format`` constrains; then
    every call the model opens is constrained (a non-strict function's arguments to any JSON object),
    and with such a format the model answers in it or calls (``answer_or_calls_grammar``)."""
    most = None if parallel else 1
    answer = response_format_grammar(body.response_format)
    strict = {tool["function"]["name"] for tool in body.tools or () if tool["function"].get("strict")}
    if not strict and answer is None:
        return ToolPlan(tool_format, None, most, functions=tuple(functions))
    refuse_endless_functions([f for f in functions if f.name in strict])
    constrained = [f if f.name in strict else FunctionSpec(f.name, ANY_ARGUMENTS) for f in functions]
    calls = MAX_FORCED_CALLS if parallel else 1
    first = calls_in(body.messages)
    try:
        if answer is not None:
            grammar = tool_format.answer_or_calls_grammar(answer, constrained, first_index=first, max_calls=calls)
        else:
            grammar = tool_format.triggered_grammar(constrained, first_index=first, max_calls=calls)
    except GrammarError as error:
        raise BadRequest(f"strict tools in the {tool_format.name} format: {error}", param="tools") from None
    return ToolPlan(tool_format, grammar, most, grammar_param="tools", functions=tuple(functions))


def check_tools(tools: Sequence[Mapping[str, Any]]) -> list[FunctionSpec]:
    """The functions ``tools`` declares; 400 for an empty list, a tool that is not a function, a bad
    or repeated name, or ``parameters`` that are not an object schema."""
    require(len(tools) > 0, "tools must hold at least one tool", "tools")
    functions: list[FunctionSpec] = []
    for position, tool in enumerate(tools):
        where = f"tools[{position}]"
        kind = tool.get("type")
        require(kind == "function", f"{where}: only function tools are supported, got type {kind!r}", "tools")
        function = tool.get("function")
        require(isinstance(function, dict), f"{where}.function must be an object", "tools")
        assert isinstance(function, dict)
        name = function.get("name")
        ok_name = isinstance(name, str) and FUNCTION_NAME.fullmatch(name) is not None
        require(ok_name, f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", "tools")
        assert isinstance(name, str)
        require(name not in {f.name for f in functions}, f"{where}: function {name!r} is declared twice", "tools")
        parameters = function.get("parameters")
        is_object = isinstance(parameters, dict) and parameters.get("type", "object") == "object"
        require(parameters is None or is_object, f"{where}.function.parameters must be an object schema", "tools")
        for field, kinds in (("description", str), ("strict", bool)):
            value = function.get(field)
            require(value is None or isinstance(value, kinds), f"{where}.function.{field} has the wrong type", "tools")
        functions.append(FunctionSpec(name, parameters))
    return functions


def check_tool_choice(
    tool_choice: str | Mapping[str, Any] | None, functions: Sequence[FunctionSpec]
) -> str | FunctionSpec:
    """``"auto"``, ``"none"``, ``"required"``, or the one function the call must be to."""
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        require(
            tool_choice in TOOL_CHOICES,
            f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, got {tool_choice!r}",
            "tool_choice",
        )
        return tool_choice
    function = tool_choice.get("function")
    named = tool_choice.get("type") == "function" and isinstance(function, dict)
    require(named, 'tool_choice must look like {"type": "function", "function": {"name": ...}}', "tool_choice")
    assert isinstance(function, dict)
    name = function.get("name")
    known = [f.name for f in functions]
    unknown = f"tool_choice names function {name!r}, which is not in tools ({', '.join(known)})"
    require(name in known, unknown, "tool_choice")
    return functions[known.index(str(name))]


def calls_in(messages: Sequence[ChatMessage]) -> int:
    """How many tool calls the chat's assistant messages hold (Kimi numbers calls across the chat)."""
    count = 0
    for message in messages:
        calls = (message.model_extra or {}).get("tool_calls") if message.role == "assistant" else None
        count += len(calls) if isinstance(calls, list) else 0
    return count
