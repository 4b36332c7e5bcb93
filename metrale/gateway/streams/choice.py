"""One choice of a request, turned from token events into text deltas.

The worker includes a matched stop token (an EOS id or one of ``stop_token_ids``) in its output; like
OpenAI and vLLM, the gateway counts it as generated but does not show its text. Stop strings are
matched here, on the text.

The incremental detokenizer decodes twice per delta: its window, then the tokens it keeps as the next
prefix, which is one token when tokens come one at a time. ``OneTokenTexts`` remembers the text of
single tokens (per tokenizer, shared by every choice decoded with it), so that second decode is a
lookup; ``ChoiceDecoder(..., one_token_texts=False)`` decodes every time, the reference path.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from metrale.gateway.streams.stop_strings import StopStringMatcher
from metrale.shared.messages import FinishReason, TokenEvent
from metrale.text.detokenizer import Decoder, IncrementalDetokenizer

TopLogprobs = list[tuple[int, float]]

ONE_TOKEN_TEXTS_LIMIT = 1 << 18
"""The most single-token texts remembered per tokenizer and ``skip_special_tokens`` (a vocabulary's
worth for every model served today); past it, new ones are decoded each time."""


class OneTokenTexts:
    """``tokenizer`` as a ``Decoder`` that remembers the text of each single token it decodes.

    The text of one token depends only on its id and ``skip_special_tokens``, so the remembered text
    is what ``tokenizer.decode`` returns; longer id lists are decoded every time."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._texts: tuple[dict[int, str], dict[int, str]] = ({}, {})  # by skip_special_tokens

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if len(ids) != 1:
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        texts = self._texts[skip_special_tokens]
        text = texts.get(ids[0])
        if text is None:
            text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            if len(texts) < ONE_TOKEN_TEXTS_LIMIT:
                texts[ids[0]] = text
        return text


_ONE_TOKEN_TEXTS: weakref.WeakKeyDictionary[Decoder, OneTokenTexts] = weakref.WeakKeyDictionary()
"""The remembered texts of every tokenizer in use, dropped with it."""


def one_token_texts_of(tokenizer: Decoder) -> OneTokenTexts:
    """The ``OneTokenTexts`` of ``tokenizer`` (one per tokenizer, made on first use; a new one each
    time for a tokenizer that cannot be weakly referenced)."""
    try:
        texts = _ONE_TOKEN_TEXTS.get(tokenizer)
        if texts is None:
            texts = _ONE_TOKEN_TEXTS[tokenizer] = OneTokenTexts(tokenizer)
    except TypeError:  # not hashable or not weakly referable
        return OneTokenTexts(tokenizer)
    return texts


@dataclass(slots=True)
class ChoiceDelta:
    """What one token event adds to a choice: text, the tokens behind it (with logprobs when asked
    for), and the finish reason if this is the choice's last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[TopLogprobs] | None
    finish_reason: FinishReason | None


class ChoiceDecoder:
    """Detokenizes one choice and applies its stop strings. Special tokens' text is dropped unless
    ``skip_special_tokens`` is false (a tool-call format written in special tokens needs them).

    ``finished`` turns true at the worker's final event or at a stop-string match, whichever comes
    first; ``worker_finished`` only at the worker's final event (until then the worker is still
    generating this choice). ``one_token_texts`` (the default) decodes through the tokenizer's
    ``OneTokenTexts``; False decodes every time, the reference.
    """

    def __init__(
        self,
        index: int,
        tokenizer: Decoder,
        prompt_ids: Sequence[int],
        *,
        stop_strings: Sequence[str],
        stop_ids: Collection[int],
        skip_special_tokens: bool = True,
        one_token_texts: bool = True,
    ) -> None:
        self.index = index
        decoder = one_token_texts_of(tokenizer) if one_token_texts else tokenizer
        self._detokenizer = IncrementalDetokenizer(decoder, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._matcher = StopStringMatcher(stop_strings)
        self._stop_ids = stop_ids
        self._generated = 0
        self._reported_tokens: int | None = None
        self.finish_reason: FinishReason | None = None
        self.worker_finished = False
        self.cached_tokens = 0
        self.token_ids: list[int] = []
        """Every token generated for this choice, as the worker produced them (stop token included)."""
        self.text = ""
        """Every text delta shown to the client, joined."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def hidden_stop_token(self) -> int | None:
        """The stop token that ended this choice, generated but not shown as text, if any."""
        last = self.token_ids[-1] if self.token_ids else None
        return last if self.finish_reason is FinishReason.STOP and last in self._stop_ids else None

    @property
    def ended_by_worker(self) -> bool:
        """Finished by the worker's final event (stop token or length), not cut by a stop string."""
        return self.worker_finished and not self._matcher.matched

    @property
    def completion_tokens(self) -> int:
        """Tokens generated for this choice: the worker's count once it reported one, else those seen."""
        return self._reported_tokens if self._reported_tokens is not None else self._generated

    def accept(self, event: TokenEvent) -> ChoiceDelta:
        """Take the next event of this choice (call only while not ``finished``)."""
        self._generated += len(event.token_ids)
        self.token_ids += event.token_ids
        if event.finished:
            self.worker_finished = True
            if event.usage is not None:
                self._reported_tokens = event.usage.completion_tokens
                self.cached_tokens = event.usage.cached_tokens
        text = self._matcher.push(self._detokenize(event))
        if self._matcher.matched:
            self.finish_reason = FinishReason.STOP
        elif event.finished:
            text += self._matcher.flush()
            self.finish_reason = event.finish_reason
        self.text += text
        return ChoiceDelta(
            index=self.index,
            text=text,
            token_ids=list(event.token_ids),
            logprobs=event.logprobs,
            top_logprobs=event.top_logprobs,
            finish_reason=self.finish_reason,
        )

    def _detokenize(self, event: TokenEvent) -> str:
        shown = event.token_ids
        if event.finish_reason is FinishReason.STOP and shown and shown[-1] in self._stop_ids:
            shown = shown[:-1]
        text = self._detokenizer.push(shown)
        return text + self._detokenizer.flush() if event.finished else text


def merge_deltas(deltas: Sequence[ChoiceDelta], n: int) -> list[ChoiceDelta]:
    """One delta per choice ``0..n-1`` holding everything ``deltas`` carried for it, in order."""
    merged = [ChoiceDelta(index, "", [], None, None, None) for index in range(n)]
    for delta in deltas:
        total = merged[delta.index]
        total.text += delta.text
        total.token_ids += delta.token_ids
        if delta.logprobs is not None:
            total.logprobs = (total.logprobs or []) + delta.logprobs
        if delta.top_logprobs is not None:
            total.top_logprobs = (total.top_logprobs or []) + delta.top_logprobs
        total.finish_reason = delta.finish_reason or total.finish_reason
    return merged
