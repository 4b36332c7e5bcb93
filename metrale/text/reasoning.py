"""Reasoning in generated text: ``<think>…</think>`` split from the answer (``--reasoning-parser qwen3``).

Qwen3 / Qwen3.5 (and DeepSeek-R1-style) models think inside ``<think>…</think>`` before they answer.
A chat template may open the block in the prompt (Qwen3.5's generation prompt ends ``<think>\\n`` when
thinking is on), so the generation starts inside it (``starts_inside``); otherwise the model may write
``<think>`` itself as the first thing it writes (whitespace before it aside). Everything up to
``</think>`` is reasoning, the rest is content; a text that never closes the block is all reasoning.
Whitespace around the reasoning, and before the content that follows ``</think>``, is the format's,
not the model's words: it is dropped. Invariant, as for the tool-call parsers: however the text is
split into pieces, the pieces joined give the same reasoning and content as the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from metrale.text.tool_calls.parser import held_back

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

REASONING_PARSERS = ("qwen3", "deepseek_r1")
"""The names ``--reasoning-parser`` takes (vLLM's); both read ``<think>…</think>`` as described above."""


def check_reasoning_parser(name: str | None) -> None:
    """Raise ``ValueError`` listing the known names unless ``name`` is one (or None)."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")


def template_thinks(template: str | None) -> bool:
    """Whether a chat template writes think blocks (its models reason before answering)."""
    return template is not None and THINK_OPEN in template and THINK_CLOSE in template


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a think block (its last ``<think>`` is not closed)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


@dataclass(slots=True)
class ReasoningDelta:
    """What one ``push`` or ``finish`` adds: reasoning text, then answer text."""

    reasoning: str = ""
    content: str = ""


class _State(Enum):
    OPENING = "opening"  # nothing but whitespace yet: may still open a block
    REASONING = "reasoning"
    AFTER = "after"  # after </think>, before the answer's first non-blank
    CONTENT = "content"


class ReasoningParser:
    """Splits one choice's text into reasoning and content; see the module docstring."""

    def __init__(self, *, starts_inside: bool) -> None:
        self._state = _State.REASONING if starts_inside else _State.OPENING
        self._buffer = ""
        self._started = False  # reasoning text shown yet (leading whitespace is dropped)
        self._blank = ""  # trailing whitespace of the reasoning, shown if more reasoning follows

    def push(self, text: str) -> ReasoningDelta:
        self._buffer += text
        out = ReasoningDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._state is _State.OPENING or self._state is _State.CONTENT:
            out.content = self._buffer
        elif self._state is _State.REASONING:
            self._reason(self._buffer.rstrip(), out)
        self._buffer = ""
        return out

    def _step(self, out: ReasoningDelta) -> bool:
        if self._state is _State.OPENING:
            return self._opening()
        if self._state is _State.REASONING:
            return self._reasoning(out)
        if self._state is _State.AFTER:
            stripped = self._buffer.lstrip()
            self._buffer = stripped
            if stripped:
                self._state = _State.CONTENT
            return bool(stripped)
        out.content += self._buffer
        self._buffer = ""
        return False

    def _opening(self) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(THINK_OPEN):
            self._state, self._buffer = _State.REASONING, head[len(THINK_OPEN) :]
            return True
        if THINK_OPEN.startswith(head):  # blank so far, or a prefix of the tag: wait
            return False
        self._state = _State.CONTENT
        return True

    def _reasoning(self, out: ReasoningDelta) -> bool:
        offset = self._buffer.find(THINK_CLOSE)
        if offset < 0:
            keep = held_back(self._buffer, [THINK_CLOSE])
            self._reason(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._reason(self._buffer[:offset].rstrip(), out)
        self._blank = ""
        self._state, self._buffer = _State.AFTER, self._buffer[offset + len(THINK_CLOSE) :]
        return True

    def _reason(self, text: str, out: ReasoningDelta) -> None:
        """Reasoning text, less leading whitespace and whitespace not (yet) followed by more."""
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        body = text.rstrip()
        if body:
            out.reasoning += self._blank + body
            self._blank = text[len(body) :]
        else:
            self._blank += text
