"""A bound on how many characters one token can cover, to refuse a prompt without tokenizing it.

For a BPE tokenizer with no normalizer and a pre-tokenizer that keeps every character (byte-level,
or splits that isolate rather than remove), each input character becomes at least one byte of some
token (BPE's unknown token stands for one character; other models' may stand for a whole word), and
an added token matches its own text: a token covers at most ``L`` characters, where ``L`` is the
longest vocabulary entry (byte-level entries are written one character per byte) or added token. A
text of ``c`` characters therefore needs at least ``ceil(c / L)`` tokens. For any other tokenizer (a
normalizer could fold characters away, a whitespace splitter drops them) no bound is claimed:
``max_chars_per_token`` is None and prompts are tokenized to be measured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Sequence", "Metaspace"})
"""Pre-tokenizers that keep every character (``Split`` unless its behaviour is ``Removed``)."""


def max_chars_per_token(backend: BackendTokenizer) -> int | None:
    """The most characters one token of ``backend`` can cover, or None when no bound holds."""
    config = json.loads(backend.to_str())
    if config.get("model", {}).get("type") != "BPE" or config.get("normalizer") is not None:
        return None
    if not all(_keeps_characters(step) for step in _pre_tokenizer_steps(config.get("pre_tokenizer"))):
        return None
    longest_entry = max((len(token) for token in backend.get_vocab(with_added_tokens=False)), default=1)
    longest_added = max((len(token["content"]) for token in config.get("added_tokens", [])), default=1)
    return max(longest_entry, longest_added, 1)


def min_tokens_for(chars: int, chars_per_token: int) -> int:
    """The fewest tokens ``chars`` characters can encode to, given at most ``chars_per_token`` per token."""
    return math.ceil(chars / chars_per_token)


def _pre_tokenizer_steps(pre_tokenizer: Mapping[str, Any] | None) -> Iterator[Mapping[str, Any]]:
    if pre_tokenizer is None:
        return
    yield pre_tokenizer
    for step in pre_tokenizer.get("pretokenizers", []):
        yield from _pre_tokenizer_steps(step)


def _keeps_characters(step: Mapping[str, Any]) -> bool:
    kind = step.get("type")
    return kind in _KEEPING_PRE_TOKENIZERS and not (kind == "Split" and step.get("behavior") == "Removed")
