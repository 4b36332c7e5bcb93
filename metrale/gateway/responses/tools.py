"""Function tools of a response, planned by the chat path's tool machinery (``api/prepare/tools.py``).

The Responses API writes a function tool flat (``{"type": "function", "name", "description",
"parameters", "strict"}``) and a named choice as ``{"type": "function", "name": ...}``; both become
chat's shapes, which the chat template renders and ``plan_tools`` checks and plans, so tool calling
behaves the same on both endpoints (formats, forced grammars, strictness, ``text.format`` beside
tools, planned as chat's ``response_format``). Hosted tools (web search, file search, MCP, ...) and
their choices are refused with a 400 naming the tool. ``max_tool_calls`` caps the calls kept
(further calls are ignored, as OpenAI does); 1 plans like ``parallel_tool_calls: false``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from metrale.gateway.api.prepare.tools import ToolPlan, plan_tools
from metrale.gateway.request_bodies import ChatCompletionRequest
from metrale.gateway.responses.bodies import ResponseCreateRequest
from metrale.shared.errors import BadRequest
from metrale.text.tokenizer import Tokenizer

_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
_ASKS_NOTHING: dict[str, tuple[Any, ...]] = {
    "allowed_callers": (None, ["direct"]),
    "async": (None, False),
    "defer_loading": (None, False),
}
"""Other fields of a function tool, with the values that ask for what a plain call is."""


def chat_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """``tools`` as chat's function tools; 400 for a tool that is not a function, or a field of one
    that asks for something a plain call is not."""
    if tools is None:
        return None
    converted = []
    for position, tool in enumerate(tools):
        where = f"tools[{position}]"
        kind = tool.get("type")
        if kind != "function":
            raise BadRequest(
                f"{where} is a {kind!r} tool: only function tools are served (hosted tools are OpenAI's).",
                param=f"{where}.type",
            )
        for name, allowed in _ASKS_NOTHING.items():
            if tool.get(name) not in allowed:
                raise BadRequest(f"{where}.{name} {tool[name]!r} is not supported.", param=f"{where}.{name}")
        unknown = sorted(set(tool) - {"type", *_FUNCTION_FIELDS, *_ASKS_NOTHING, "output_schema"})
        if unknown:
            raise BadRequest(f"{where} has fields a function tool does not: {', '.join(unknown)}.", param=where)
        if tool.get("output_schema") is not None:
            why = "the model is not told the shape of a function's output"
            raise BadRequest(f"{where}.output_schema is not supported: {why}.", param=f"{where}.output_schema")
        function = {name: tool[name] for name in _FUNCTION_FIELDS if tool.get(name) is not None}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(tool_choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``tool_choice`` as chat's: the same strings, or ``{"type": "function", "function": {"name"}}``."""
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice
    kind = tool_choice.get("type")
    if kind != "function":
        raise BadRequest(
            f"tool_choice of type {kind!r} is not supported: choose 'auto', 'none', 'required' or "
            '{"type": "function", "name": ...}.',
            param="tool_choice",
        )
    name = tool_choice.get("name")
    if not isinstance(name, str):
        raise BadRequest('tool_choice must look like {"type": "function", "name": ...}.', param="tool_choice")
    return {"type": "function", "function": {"name": name}}


def plan_response_tools(
    body: ResponseCreateRequest,
    messages: Sequence[dict[str, Any]],
    tokenizer: Tokenizer,
    parser_name: str | None = None,
) -> ToolPlan:
    """The tool plan of ``body`` for ``tokenizer``'s model; ``messages`` is the whole conversation
    (earlier calls count in formats that number calls across a chat)."""
    tool_choice, parallel = body.tool_choice, body.parallel_tool_calls
    if body.tools is None:  # OpenAI takes these without tools: they ask for nothing then
        tool_choice = None if tool_choice == "auto" else tool_choice
        parallel = None
    elif body.max_tool_calls == 1:
        parallel = False
    fields = {
        "model": body.model,
        "messages": list(messages),
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(tool_choice),
        "parallel_tool_calls": parallel,
        "response_format": body.chat_response_format(),  # auto mode's grammar holds the format's answer
    }
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:  # a shape only a conversion could make: name the field, never a 500
        where = str(error.errors()[0]["loc"][0])
        raise BadRequest(f"{where}: {error.errors()[0]['msg']}", param=where) from None
    try:
        plan = plan_tools(chat, tokenizer, parser_name)
    except BadRequest as error:  # the format is text.format here
        if error.param != "response_format":
            raise
        raise BadRequest(error.message.replace("response_format", "text.format"), param="text.format") from None
    if body.max_tool_calls is not None and plan.tool_format is not None:
        most = min(body.max_tool_calls, plan.max_calls or body.max_tool_calls)
        plan = dataclasses.replace(plan, max_calls=most)
    return plan
