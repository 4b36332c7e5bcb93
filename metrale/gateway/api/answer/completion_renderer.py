"""``text_completion`` objects (whole, and as stream chunks) for one request of one or more prompts.

Choice ``c`` answers prompt ``c // n``. With ``echo`` a choice's text starts with its prompt's text
(the prompt string as sent; a token-id prompt decoded with its special tokens), sent in the choice's
first chunk; with ``logprobs`` too, the prompt's tokens lead the logprob lists, the first token's
logprob and alternatives ``null``. ``text_offset`` counts characters of the tokens' texts from the
start of the choice, across chunks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from metrale.gateway.response_bodies import Completion, CompletionChoice, CompletionLogprobs, UsageInfo
from metrale.gateway.streams.choice import ChoiceDelta, merge_deltas
from metrale.gateway.streams.chunk_json import ChunkEnvelope, choice_json, json_text
from metrale.gateway.streams.logprobs import LogprobFormatter
from metrale.gateway.streams.prompt_scores import PromptScores
from metrale.shared.messages import FinishReason, Usage


@dataclass(frozen=True, slots=True)
class CompletionOptions:
    """What a completions body asks of its answer. ``echo_only``: ``echo`` with ``max_tokens`` 0, the
    prompt alone (the one token the worker samples is neither shown nor counted)."""

    echo: bool = False
    echo_only: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def worker_prompt_logprobs(self) -> int | None:
        """How many alternatives per prompt token the worker scores (None: no prompt logprobs)."""
        wanted = [count for count in (self.echoed_logprobs, self.prompt_logprobs) if count is not None]
        return max(wanted) if wanted else None

    @property
    def echoed_logprobs(self) -> int | None:
        """Alternatives shown with each echoed prompt token (None: the prompt's logprobs are not shown)."""
        return self.logprobs if self.echo else None


@dataclass(frozen=True, slots=True)
class EchoedPrompt:
    """One prompt of the request: its text, its token ids, and where its logprobs arrive (if asked)."""

    text: str
    token_ids: list[int]
    scores: PromptScores | None


class CompletionRenderer:
    """Renders the deltas of ``n`` choices per prompt of ``prompts``.

    ``prompts`` may be left out without ``echo`` or ``prompt_logprobs`` (one prompt then)."""

    def __init__(
        self,
        *,
        request_id: str,
        model: str,
        fingerprint: str,
        n: int,
        logprobs: LogprobFormatter | None,
        prompts: Sequence[EchoedPrompt] = (),
        options: CompletionOptions = CompletionOptions(),
    ) -> None:
        self._id = request_id
        self._model = model
        self._fingerprint = f"met-{fingerprint[:12]}"
        self._n = n
        self._prompts = list(prompts)
        self._choices = n * max(len(self._prompts), 1)
        self._options = options
        self._logprobs = logprobs
        self._offsets = [0] * self._choices
        self._opened = [False] * self._choices
        self._created = int(time.time())
        self._envelope = ChunkEnvelope(
            id=request_id,
            object="text_completion",
            created=self._created,
            model=model,
            system_fingerprint=self._fingerprint,
        )

    def opening_chunks(self) -> list[str]:
        return []

    def delta_chunk(self, delta: ChoiceDelta) -> str | None:
        text, logprobs = self._choice_head(delta.index)
        generated = self._generated_logprobs(delta)
        logprobs = _joined(logprobs, generated)
        text += "" if self._options.echo_only else delta.text
        reason = self._finish_reason(delta)
        if not text and reason is None and not (logprobs and logprobs.tokens):
            return None
        content = f'"text":{json_text(text)}'
        return self._envelope.chunk(choice_json(delta.index, content, logprobs, reason))

    def usage_chunk(self, usage: Usage) -> str:
        return self._completion([], usage=self._usage(usage)).model_dump_json()

    def response(self, deltas: Sequence[ChoiceDelta], usage: Usage) -> Completion:
        choices = [self._choice(delta) for delta in merge_deltas(deltas, self._choices)]
        return self._completion(choices, usage=self._usage(usage))

    def _choice(self, delta: ChoiceDelta) -> CompletionChoice:
        text, logprobs = self._choice_head(delta.index)
        logprobs = _joined(logprobs, self._generated_logprobs(delta))
        reason = self._finish_reason(delta)
        prompt = self._prompts[delta.index // self._n]
        prompt_logprobs = None
        if self._options.prompt_logprobs is not None and self._logprobs is not None and prompt.scores is not None:
            prompt_logprobs = self._logprobs.prompt_logprobs(
                prompt.token_ids, prompt.scores, self._options.prompt_logprobs
            )
        return CompletionChoice(
            index=delta.index,
            text=text + ("" if self._options.echo_only else delta.text),
            logprobs=logprobs,
            finish_reason=reason.value if reason is not None else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _choice_head(self, index: int) -> tuple[str, CompletionLogprobs | None]:
        """What a choice starts with, once: the echoed prompt's text and its logprobs."""
        if self._opened[index]:
            return "", None
        self._opened[index] = True
        if not self._options.echo:
            return "", None
        prompt = self._prompts[index // self._n]
        count = self._options.echoed_logprobs
        if count is None or self._logprobs is None or prompt.scores is None:
            return prompt.text, None
        logprobs, self._offsets[index] = self._logprobs.prompt_completion(prompt.token_ids, prompt.scores, count)
        return prompt.text, logprobs

    def _generated_logprobs(self, delta: ChoiceDelta) -> CompletionLogprobs | None:
        if self._logprobs is None or delta.logprobs is None or self._options.echo_only:
            return None
        logprobs, self._offsets[delta.index] = self._logprobs.completion(
            delta.token_ids, delta.logprobs, delta.top_logprobs, self._offsets[delta.index]
        )
        return logprobs

    def _finish_reason(self, delta: ChoiceDelta) -> FinishReason | None:
        """The choice's finish reason; ``length`` for the prompt alone (``max_tokens`` 0, as OpenAI)."""
        if self._options.echo_only and delta.finish_reason is not None:
            return FinishReason.LENGTH
        return delta.finish_reason

    def _usage(self, usage: Usage) -> UsageInfo:
        if self._options.echo_only:
            usage = Usage(usage.prompt_tokens, 0, usage.cached_tokens)
        return UsageInfo.of(usage)

    def _completion(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> Completion:
        return Completion(
            id=self._id,
            created=self._created,
            model=self._model,
            system_fingerprint=self._fingerprint,
            choices=choices,
            usage=usage,
        )


def _joined(head: CompletionLogprobs | None, tail: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """Two runs of legacy logprobs as one (either may be missing)."""
    if head is None or tail is None:
        return head if tail is None else tail
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + tail.text_offset,
    )
