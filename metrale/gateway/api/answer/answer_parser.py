"""One choice's generated text read as an assistant answer: reasoning first, then content and tool calls.

The reasoning parser (if the model thinks) takes the text first; what it passes on as content goes
through the tool-call parser (if the request's tools are parsed). A call written inside the think
block is reasoning, not a call. Either parser may be absent; with neither, the text is the content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.text.reasoning import ReasoningParser, prompt_opens_thinking, template_thinks
from metrale.text.tool_calls.parser import ParsedDelta, ToolCallParser


@dataclass(slots=True)
class AnswerDelta:
    """What one ``push`` or ``finish`` adds: reasoning text, then content and call pieces."""

    reasoning: str = ""
    parsed: ParsedDelta = field(default_factory=ParsedDelta)

    @property
    def empty(self) -> bool:
        return not self.reasoning and self.parsed.empty

    def extend(self, other: AnswerDelta) -> None:
        self.reasoning += other.reasoning
        self.parsed.extend(other.parsed)


class AnswerParser:
    """Reasoning, then content and calls, piece by piece (the parsers' invariant holds for the pair)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def push(self, text: str) -> AnswerDelta:
        if self._reasoning is None:
            return AnswerDelta("", self._content(text))
        split = self._reasoning.push(text)
        return AnswerDelta(split.reasoning, self._content(split.content))

    def finish(self) -> AnswerDelta:
        out = AnswerDelta()
        if self._reasoning is not None:
            split = self._reasoning.finish()
            out.reasoning = split.reasoning
            out.parsed = self._content(split.content)
        if self._tools is not None:
            out.parsed.extend(self._tools.finish())
        return out

    def read_whole(self, text: str) -> AnswerDelta:
        """``text`` read in one piece, then ended."""
        answer = self.push(text)
        answer.extend(self.finish())
        return answer

    def _content(self, text: str) -> ParsedDelta:
        if self._tools is None:
            return ParsedDelta(content=text)
        return self._tools.push(text) if text else ParsedDelta()


def reasoning_start(parser_name: str | None, template: str | None, prompt: str, *, constrained: bool) -> bool | None:
    """Whether a choice's text starts inside its reasoning (None: the answer has no reasoning parser).

    A model is read for reasoning when the server names a parser (``--reasoning-parser``) or its chat
    template writes think blocks; its text starts inside when the prompt opened one. A constrained
    answer (a forced tool call, a response format) is written from its first token, so it is never
    reasoning, even after a prompt that opened the block."""
    if parser_name is None and not template_thinks(template):
        return None
    return prompt_opens_thinking(prompt) and not constrained
