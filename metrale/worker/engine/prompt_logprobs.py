"""Log-probabilities of a prompt's own tokens, read off the prefill that fills the state (vLLM's
``prompt_logprobs``; what ``echo`` + ``logprobs`` shows on ``/v1/completions``).

The logits of the row at position ``p`` predict the token at ``p + 1``. So a prefill chunk over
positions ``[start, end)`` scores the prompt tokens at ``start + 1 .. min(end, len(prompt) - 1)``; its
last row scores the first token of the next chunk (or, after the whole prompt, is the row the first
output token is sampled from). Position 0 has no logprob (nothing precedes it). ``PromptScorer``
remembers, per request, the next position still to report, so a prefill that runs again (a sequence
restarted after preemption) reports nothing twice, and a chunk that scores nothing new asks for no
extra logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Alternatives = tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The logprobs of the prompt tokens at positions ``[start, start + len(logprobs))``, each under the
    raw model distribution (``log_softmax`` of the logits, as the sampler reports chosen tokens), and
    each position's ``top`` most likely tokens, best first (empty when none were asked for)."""

    start: int
    logprobs: tuple[float, ...]
    top_logprobs: tuple[Alternatives, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.logprobs)


def score_rows(logits: torch.Tensor, targets: Sequence[int], top: int) -> tuple[list[float], list[Alternatives]]:
    """The logprob of ``targets[r]`` under row ``r`` of ``logits`` ``[R, V]`` (any float dtype; scored in
    fp32), and each row's ``top`` most likely ``(token_id, logprob)``, best first, ties by lower id."""
    if logits.dim() != 2 or logits.shape[0] != len(targets):
        raise ValueError(f"logits must be [{len(targets)}, vocab], got {list(logits.shape)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(targets), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
    if top <= 0:
        return chosen, [() for _ in targets]
    values, ids = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)
    alternatives = [
        tuple(sorted(zip(row_ids, row_values, strict=True), key=lambda pair: (-pair[1], pair[0])))
        for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
    ]
    return chosen, alternatives


class PromptScorer:
    """Which prefill rows of each request need logits for its prompt logprobs, and scoring them."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[tuple[int, ...], int]] = {}  # request -> (prompt ids, top)
        self._next: dict[str, int] = {}  # request -> the next prompt position to report

    def register(self, request_id: str, prompt_ids: Sequence[int], top: int) -> None:
        """Report the prompt logprobs of ``request_id``, with ``top`` alternatives each."""
        self._prompts[request_id] = (tuple(prompt_ids), top)
        self._next[request_id] = 1

    def forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
        self._next.pop(request_id, None)

    def wants_rows(self, request_id: str, start: int, end: int) -> bool:
        """Whether a prefill chunk of ``request_id`` over positions ``[start, end)`` scores a prompt token
        not reported yet (then the forward must return the logits of every row of it)."""
        wanted = self._prompts.get(request_id)
        if wanted is None:
            return False
        first, last = self._scored_positions(len(wanted[0]), start, end)
        return last >= max(first, self._next[request_id])

    def score(self, request_id: str, start: int, logits: torch.Tensor) -> PromptLogprobs | None:
        """The new prompt logprobs in the logits ``[end - start, V]`` of a chunk over ``[start, end)``
        (None: nothing new); what it returns is never returned again."""
        prompt, top = self._prompts[request_id]
        first, last = self._scored_positions(len(prompt), start, start + logits.shape[0])
        expected = self._next[request_id]
        if first > expected:
            raise ValueError(f"{request_id}: a prefill from {start} skips prompt logprobs from {expected}")
        first = expected
        if last < first:
            return None
        rows = logits[first - 1 - start : last - start]  # row p - 1 scores position p
        chosen, alternatives = score_rows(rows, prompt[first : last + 1], top)
        self._next[request_id] = last + 1
        return PromptLogprobs(first, tuple(chosen), tuple(alternatives))

    @staticmethod
    def _scored_positions(prompt_len: int, start: int, end: int) -> tuple[int, int]:
        """The prompt positions ``[first, last]`` the rows of ``[start, end)`` score (empty: last < first)."""
        return start + 1, min(end, prompt_len - 1)
