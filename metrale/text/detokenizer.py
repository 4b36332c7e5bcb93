"""Streaming token ids to text, one delta per batch of new tokens.

The approach is vLLM's incremental detokenization: keep a small window of ids, split by a read offset
into *prefix* tokens (already emitted, kept only as context, because a decoder such as SentencePiece's
decides a token's leading space from its neighbour) and *unread* tokens. Decoding the window and the
prefix alone, the delta is the difference. Byte-level tokens can end inside a UTF-8 character, which
decodes as a trailing U+FFFD; while the window's text ends that way nothing is emitted. Once a delta is
emitted, the unread tokens become the new prefix and older ids are dropped, so each push decodes a few
tokens however long the stream is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHARACTER = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
"""How many trailing prompt tokens seed the prefix window (vLLM uses the same number)."""


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer (``metrale.text.tokenizer.Tokenizer`` is one)."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Invariants: the concatenation of every ``push`` result and the final ``flush`` equals the text of the
    generated ids as the tokenizer decodes them after the prompt, and no delta ends inside a UTF-8
    character. A delta may contain U+FFFD only where the whole decoding does too (invalid bytes that are
    already followed by more text, or at the very end, from ``flush``). A character the generated ids
    complete counts as theirs, even if the prompt holds its first bytes. ``flush`` ends the stream.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = list(prompt_ids or ())[-PROMPT_CONTEXT_TOKENS:]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        # A prompt that ends inside a character leaves its partial bytes unread: the delta that completes
        # the character carries all of it.
        while self._read_offset > 0 and self._prefix_text.endswith(REPLACEMENT_CHARACTER):
            self._read_offset -= 1
            self._prefix_text = self._decode(self._window[: self._read_offset])

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; return the text they complete ("" while a character is still partial)."""
        self._window.extend(new_ids)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHARACTER):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Return whatever is held back, partial characters included (as U+FFFD); call at the end."""
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text):
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        """Emit ``text`` past the prefix and make the unread tokens the new prefix."""
        delta = text[len(self._prefix_text) :]
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
