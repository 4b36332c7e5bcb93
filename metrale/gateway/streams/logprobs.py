"""Token logprobs in the two OpenAI formats: chat (``content`` entries) and legacy completions; a
prompt's in the legacy format (``echo``) and in vLLM's ``prompt_logprobs``.

Each token is shown as its own decoded text (special tokens included); ``bytes`` are that text's
UTF-8 bytes, so a token holding part of a character shows as U+FFFD there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from metrale.gateway.response_bodies import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobsList,
    TokenLogprob,
    TopLogprob,
)
from metrale.gateway.streams.choice import TopLogprobs
from metrale.gateway.streams.prompt_scores import PromptScores
from metrale.gateway.streams.submission import Submission
from metrale.text.detokenizer import Decoder


@dataclass(frozen=True, slots=True)
class PromptLogprobsRequest:
    """vLLM's ``prompt_logprobs`` asked of one request: the prompt, where its scores arrive, how many
    alternatives to show."""

    prompt_ids: list[int]
    scores: PromptScores
    count: int

    @classmethod
    def of(cls, submission: Submission, count: int | None) -> PromptLogprobsRequest | None:
        """What ``submission`` asks (None: no prompt logprobs)."""
        scores = submission.prompt_scores
        if count is None or scores is None:
            return None
        return cls(submission.request.prompt_token_ids, scores, count)

    def render(self, formatter: LogprobFormatter | None) -> PromptLogprobsList | None:
        """The entries, once the request has ended (None without a formatter)."""
        return None if formatter is None else formatter.prompt_logprobs(self.prompt_ids, self.scores, self.count)


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
            tokens=tokens, token_logprobs=list(logprobs), top_logprobs=list(top), text_offset=offsets
        )
        return formatted, text_offset

    def prompt_completion(
        self, prompt_ids: Sequence[int], scores: PromptScores, count: int
    ) -> tuple[CompletionLogprobs, int]:
        """The legacy format for an echoed prompt (OpenAI's ``echo`` with ``logprobs``): its first token
        has no logprob (``null``, and ``null`` alternatives); each other token's ``top_logprobs`` holds
        its ``count`` best alternatives and itself. Also returns the offset after the prompt."""
        tokens = [self.token_text(token_id) for token_id in prompt_ids]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top: list[dict[str, float] | None] = [None]
        for token, logprob, alternatives in zip(tokens[1:], scores.logprobs, scores.top_logprobs, strict=True):
            entry = {self.token_text(alt_id): alt_logprob for alt_id, alt_logprob in alternatives[:count]}
            entry[token] = logprob
            top.append(entry)
        logprobs: list[float | None] = [None, *scores.logprobs]
        return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=top, text_offset=offsets), offset

    def prompt_logprobs(self, prompt_ids: Sequence[int], scores: PromptScores, count: int) -> PromptLogprobsList:
        """vLLM's ``prompt_logprobs``: ``null`` for the first token; for each other, the token itself and
        its ``count`` best alternatives, keyed by token id, with their ranks."""
        entries: PromptLogprobsList = [None]
        for token_id, logprob, alternatives in zip(prompt_ids[1:], scores.logprobs, scores.top_logprobs, strict=True):
            ranks = {alt_id: rank for rank, (alt_id, _) in enumerate(alternatives, start=1)}
            entry = {
                str(token_id): PromptLogprob(
                    logprob=logprob, rank=ranks.get(token_id), decoded_token=self.token_text(token_id)
                )
            }
            for rank, (alt_id, alt_logprob) in enumerate(alternatives[:count], start=1):
                entry.setdefault(
                    str(alt_id), PromptLogprob(logprob=alt_logprob, rank=rank, decoded_token=self.token_text(alt_id))
                )
            entries.append(entry)
        return entries

    def _entry(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def _top(self, alternatives: TopLogprobs) -> list[TopLogprob]:
        return [self._entry(token_id, logprob) for token_id, logprob in alternatives]
