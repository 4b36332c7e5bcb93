"""The tool-call formats Metrale knows, by the names ``--tool-call-parser`` takes (vLLM's names).

A format is chosen from the chat template (one that writes Kimi's section tokens is ``kimi_k2``, one
that writes ``<tool_call>`` is ``hermes``) unless the server names one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from metrale.text.tool_calls import hermes, kimi_k2
from metrale.text.tool_calls.grammar import FunctionSpec, hermes_forced_grammar, kimi_forced_grammar
from metrale.text.tool_calls.hermes import HermesToolCallParser
from metrale.text.tool_calls.kimi_k2 import KimiToolCallParser
from metrale.text.tool_calls.parser import CallIds, ToolCallParser


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How a model writes calls: its parser, the grammar that forces a call, and whether its markers
    are special tokens (then the text is decoded with special tokens kept)."""

    name: str
    keeps_special_tokens: bool
    _new_parser: Callable[[CallIds], ToolCallParser]
    _forced_grammar: Callable[[Sequence[FunctionSpec], int, int], str]

    def new_parser(self, call_ids: CallIds) -> ToolCallParser:
        """A parser for one choice's text; ``call_ids`` names calls whose text carries no id."""
        return self._new_parser(call_ids)

    def forced_grammar(self, functions: Sequence[FunctionSpec], *, first_index: int, max_calls: int) -> str:
        """A Lark grammar whose every sentence is 1..``max_calls`` valid calls to ``functions``;
        ``first_index`` counts the calls the chat already holds."""
        return self._forced_grammar(functions, first_index, max_calls)


KIMI_K2 = ToolCallFormat(
    name="kimi_k2",
    keeps_special_tokens=True,
    _new_parser=lambda _ids: KimiToolCallParser(),
    _forced_grammar=lambda functions, first, most: kimi_forced_grammar(functions, first_index=first, max_calls=most),
)
HERMES = ToolCallFormat(
    name="hermes",
    keeps_special_tokens=False,
    _new_parser=HermesToolCallParser,
    _forced_grammar=lambda functions, _first, most: hermes_forced_grammar(functions, max_calls=most),
)
TOOL_CALL_FORMATS = {tool_format.name: tool_format for tool_format in (KIMI_K2, HERMES)}
"""Every format, by name."""


def format_named(name: str) -> ToolCallFormat:
    """The format called ``name``; raises ``ValueError`` listing the known ones."""
    try:
        return TOOL_CALL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_FORMATS)}") from None


def format_for_template(template: str | None) -> ToolCallFormat | None:
    """The format a chat template writes earlier calls in, or None if it writes none it knows."""
    if template is None:
        return None
    if kimi_k2.SECTION_BEGIN in template:
        return KIMI_K2
    if hermes.CALL_OPEN in template:
        return HERMES
    return None
