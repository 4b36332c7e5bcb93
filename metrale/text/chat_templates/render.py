"""Render chats with Hugging Face chat templates (Jinja), the way ``transformers`` does.

The environment matches ``transformers``' ``apply_chat_template``: a sandboxed, immutable Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``{% generation %}`` block that
renders its body, the globals ``raise_exception`` and ``strftime_now``, and a ``tojson`` filter that does
not HTML-escape. Templates come from model repositories and are untrusted code: the sandbox is what keeps
them from reaching Python internals.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]

SPECIAL_TOKEN_NAMES = frozenset(
    {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}
)
"""The names ``transformers`` gives a tokenizer's special tokens in the template's variables."""

SERVER_VARIABLES = SPECIAL_TOKEN_NAMES | {
    "messages",
    "add_generation_prompt",
    "tools",
    "raise_exception",
    "strftime_now",
}
"""Template variables the server fills itself (``render_chat``'s and the environment's): the chat, the
special tokens, the checked ``tools`` and the globals. A caller's extra variables must not replace
them (``documents`` is only defaulted, so a caller may give it)."""

# Errors a template can raise while rendering besides Jinja's own: untrusted code doing bad arithmetic,
# indexing or comparisons on the caller's data.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError)


class ChatTemplateError(ValueError):
    """The chat template does not compile, fails while rendering, or called ``raise_exception``."""


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training; it renders as is."""

    tags = {"generation"}  # noqa: RUF012 - typed by Jinja as an instance set

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=64)
def compile_template(template: str) -> jinja2.Template:
    """Compile ``template`` once; later calls with the same text return the cached ``jinja2.Template``."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template line {error.lineno}: {error.message}") from error


def render_chat(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str | None],
    **extra: Any,
) -> str:
    """Render ``messages`` with ``template``.

    ``special_tokens`` maps names such as ``bos_token`` to token strings; names whose value is None stay
    undefined in the template, as in ``transformers``. ``extra`` (``tools``, ``documents``,
    ``enable_thinking``, ...) become template variables too and win over special tokens of the same name;
    ``tools`` and ``documents`` are None unless given. A template that never names the ``developer`` role
    gets developer messages as system messages (OpenAI's developer role replaced system). Raises
    ``ChatTemplateError``.
    """
    if "developer" not in template:
        messages = [developer_as_system(message) for message in messages]
    variables: dict[str, Any] = {name: token for name, token in special_tokens.items() if token is not None}
    variables.update({"tools": None, "documents": None})
    variables.update(extra)
    variables.update({"messages": list(messages), "add_generation_prompt": add_generation_prompt})
    compiled = compile_template(template)
    try:
        return compiled.render(variables)
    except _RENDER_ERRORS as error:
        raise ChatTemplateError(str(error) or type(error).__name__) from error


def developer_as_system(message: Message) -> Message:
    """``message`` with the role ``developer`` renamed ``system``; any other message as it is."""
    return {**message, "role": "system"} if message.get("role") == "developer" else message


def turn_boundaries(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None],
    **extra: Any,
) -> list[int]:
    """Character offsets in the full rendering at which a chat prefix ends, in increasing order.

    The full rendering is ``render_chat(template, messages, add_generation_prompt=...)``. For each
    k = 1..len(messages), ``messages[:k]`` is rendered without a generation prompt; its length is a
    boundary only if that rendering is a true prefix of the full one (templates that render earlier turns
    differently once later turns exist are not prefix-stable there), is not empty, and does not fail to
    render. Offsets are unique, so a message that renders as nothing adds no boundary.
    """
    full = render_chat(
        template,
        messages,
        add_generation_prompt=add_generation_prompt,
        special_tokens=special_tokens,
        **extra,
    )
    boundaries: set[int] = set()
    for k in range(1, len(messages) + 1):
        try:
            prefix = render_chat(
                template, messages[:k], add_generation_prompt=False, special_tokens=special_tokens, **extra
            )
        except ChatTemplateError:
            continue
        if prefix and full.startswith(prefix):
            boundaries.add(len(prefix))
    return sorted(boundaries)
