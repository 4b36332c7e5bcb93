"""Prompt lookup (vLLM's ``ngram`` speculative method): draft the tokens that followed the latest earlier
occurrence of the sequence's last ``n`` tokens, for the longest ``n`` that occurs."""

from __future__ import annotations

from collections.abc import Sequence


def ngram_draft(tokens: Sequence[int], count: int, longest: int, shortest: int) -> tuple[int, ...]:
    """Up to ``count`` draft tokens for the continuation of ``tokens`` (prompt, then output).

    For ``n`` from ``longest`` down to ``shortest``, look for the last ``n`` tokens earlier in
    ``tokens`` (latest occurrence first); the first match found gives the tokens that followed it,
    at most ``count`` (fewer when it lies near the end). Empty when nothing matches.
    """
    total = len(tokens)
    if count < 1:
        return ()
    for n in range(min(longest, total - 1), shortest - 1, -1):
        suffix = list(tokens[total - n :])
        first = suffix[0]
        for start in range(total - n - 1, -1, -1):  # a match that ends before the suffix does
            if tokens[start] == first and list(tokens[start : start + n]) == suffix:
                return tuple(tokens[start + n : start + n + count])
    return ()
