"""Token logprobs in the two OpenAI formats: chat (``content`` entries) and legacy completions.

Each token is shown as its own decoded text (special tokens included); ``bytes`` are that text's
UTF-8 bytes, so a token holding part of a character shows as U+FFFD there.
"""

from __future__ import annotations

from collections.abc import Sequence

from metrale.gateway.response_bodies import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from metrale.gateway.streams.choice import TopLogprobs
from metrale.text.detokenizer import Decoder


class LogprobFormatter:
    """Formats the logprobs a worker sent with a choice's tokens."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def chat(
        self, token_ids: Sequence[int], logprobs: Sequence[float], top_logprobs: Sequence[TopLogprobs] | None
    ) -> ChatLogprobs:
        """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}``, one entry per token."""
        alternatives = top_logprobs if top_logprobs is not None else [[] for _ in token_ids]
        return ChatLogprobs(
            content=[
                TokenLogprob(**self._entry(token_id, logprob).model_dump(), top_logprobs=self._top(top))
                for token_id, logprob, top in zip(token_ids, logprobs, alternatives, strict=True)
            ]
        )

    def completion(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        top_logprobs: Sequence[TopLogprobs] | None,
        text_offset: int,
    ) -> tuple[CompletionLogprobs, int]:
        """The legacy format for tokens whose text starts at ``text_offset`` in the choice's text; also
        returns the offset after them. ``top_logprobs`` maps each alternative's text (and the chosen
        token's) to its logprob."""
        tokens = [self.token_text(token_id) for token_id in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        alternatives = top_logprobs if top_logprobs is not None else [[] for _ in token_ids]
        top = [
            {self.token_text(alt_id): alt_logprob for alt_id, alt_logprob in top} | {token: logprob}
            for token, logprob, top in zip(tokens, logprobs, alternatives, strict=True)
        ]
        formatted = CompletionLogprobs(
            tokens=tokens, token_logprobs=list(logprobs), top_logprobs=top, text_offset=offsets
        )
        return formatted, text_offset

    def _entry(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def _top(self, alternatives: TopLogprobs) -> list[TopLogprob]:
        return [self._entry(token_id, logprob) for token_id, logprob in alternatives]
