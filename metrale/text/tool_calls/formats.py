"""The tool-call formats Metrale knows, by the names ``--tool-call-parser`` takes (vLLM's names).

A format is chosen from the chat template (one that writes Kimi's section tokens is ``kimi_k2``, one
that writes ``<function=`` is ``qwen3_coder``, another that writes ``<tool_call>`` is ``hermes``)
unless the server names one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llguidance import StructTag

from metrale.text.grammars import alternative_grammars
from metrale.text.tool_calls import hermes, kimi_k2, qwen3_coder
from metrale.text.tool_calls.grammar import (
    FunctionSpec,
    hermes_call_tags,
    hermes_forced_grammar,
    kimi_call_tags,
    kimi_forced_grammar,
)
from metrale.text.tool_calls.hermes import HermesToolCallParser
from metrale.text.tool_calls.kimi_k2 import KimiToolCallParser
from metrale.text.tool_calls.parser import CallIds, ToolCallParser
from metrale.text.tool_calls.qwen3_coder import Qwen3CoderToolCallParser
from metrale.text.tool_calls.qwen3_coder_grammar import qwen3_coder_call_tags, qwen3_coder_forced_grammar


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How a model writes calls: its parser, the grammar that forces a call, the structural tags that
    constrain a call the model opens by itself, and whether its markers are special tokens (then the
    text is decoded with special tokens kept, and ``trigger`` is one)."""

    name: str
    keeps_special_tokens: bool
    trigger: str
    """What opens the model's calls (a tag, or a special token): once written, only valid calls follow."""
    _new_parser: Callable[[CallIds], ToolCallParser]
    _forced_grammar: Callable[[Sequence[FunctionSpec], int, int], str]
    _call_tags: Callable[[Sequence[FunctionSpec], int, int], list[StructTag]]
    _new_typed_parser: Callable[[CallIds, Sequence[FunctionSpec]], ToolCallParser] | None = None
    """A format whose values are untyped text builds its parser with the request's functions."""
    marker_tokens: bool = False
    """Its markers are added tokens of the tokenizer that the text keeps (not special to Hugging Face,
    but tokens to llguidance: grammars name them as tokens)."""
    arguments_as_mapping: bool = False
    """Its chat templates iterate an earlier call's ``arguments`` as a mapping (``arguments|items``),
    not the JSON text the API carries."""

    def new_parser(self, call_ids: CallIds, functions: Sequence[FunctionSpec] = ()) -> ToolCallParser:
        """A parser for one choice's text; ``call_ids`` names calls whose text carries no id,
        ``functions`` are the request's tools (their schemas type a format's untyped values)."""
        if self._new_typed_parser is not None:
            return self._new_typed_parser(call_ids, functions)
        return self._new_parser(call_ids)

    def forced_grammar(self, functions: Sequence[FunctionSpec], *, first_index: int, max_calls: int) -> str:
        """A Lark grammar whose every sentence is 1..``max_calls`` valid calls to ``functions``;
        ``first_index`` counts the calls the chat already holds."""
        return self._forced_grammar(functions, first_index, max_calls)

    def triggered_grammar(self, functions: Sequence[FunctionSpec], *, first_index: int, max_calls: int) -> str:
        """A grammar of any text in which every call opened by ``trigger`` is a valid call to one of
        ``functions`` (strict tools with ``tool_choice`` "auto"): llguidance's ``StructTag`` lowering,
        a lazy lexeme ending at a text trigger, or the special token itself. Special tokens other
        than the trigger are not text (the request's stop tokens end it as always). ``max_calls``
        bounds the calls one opening holds where the format groups them (Kimi's section)."""
        tags = self._call_tags(functions, first_index, max_calls)
        assert all(tag.trigger == self.trigger for tag in tags)
        return StructTag.to_grammar(tags, assume_special=self.keeps_special_tokens or self.marker_tokens)

    def answer_or_calls_grammar(
        self, answer: str, functions: Sequence[FunctionSpec], *, first_index: int, max_calls: int
    ) -> str:
        """A grammar whose sentences are either ``answer``'s (a Lark grammar: a response format's JSON)
        or 1..``max_calls`` valid calls to ``functions`` opened at once, as ``forced_grammar`` writes
        them: tools in ``auto`` mode with a response format that constrains, where the model answers
        in the format or calls a tool. Raises ``GrammarError`` as ``forced_grammar`` does."""
        calls = self.forced_grammar(functions, first_index=first_index, max_calls=max_calls)
        return alternative_grammars({"answer": answer, "calls": calls})


KIMI_K2 = ToolCallFormat(
    name="kimi_k2",
    keeps_special_tokens=True,
    trigger=kimi_k2.SECTION_BEGIN,
    _new_parser=lambda _ids: KimiToolCallParser(),
    _forced_grammar=lambda functions, first, most: kimi_forced_grammar(functions, first_index=first, max_calls=most),
    _call_tags=lambda functions, first, most: kimi_call_tags(functions, first_index=first, max_calls=most),
)
HERMES = ToolCallFormat(
    name="hermes",
    keeps_special_tokens=False,
    trigger=hermes.CALL_OPEN,
    _new_parser=HermesToolCallParser,
    _forced_grammar=lambda functions, _first, most: hermes_forced_grammar(functions, max_calls=most),
    _call_tags=lambda functions, _first, _most: hermes_call_tags(functions),
)
QWEN3_CODER = ToolCallFormat(
    name="qwen3_coder",
    keeps_special_tokens=False,
    trigger=qwen3_coder.CALL_OPEN,
    _new_parser=Qwen3CoderToolCallParser,
    _forced_grammar=lambda functions, _first, most: qwen3_coder_forced_grammar(functions, max_calls=most),
    _call_tags=lambda functions, _first, _most: qwen3_coder_call_tags(functions),
    _new_typed_parser=lambda ids, functions: Qwen3CoderToolCallParser(ids, {f.name: f.parameters for f in functions}),
    marker_tokens=True,
    arguments_as_mapping=True,
)
TOOL_CALL_FORMATS = {tool_format.name: tool_format for tool_format in (KIMI_K2, HERMES, QWEN3_CODER)}
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
    if qwen3_coder.FUNCTION_OPEN in template:
        return QWEN3_CODER
    if hermes.CALL_OPEN in template:
        return HERMES
    return None
