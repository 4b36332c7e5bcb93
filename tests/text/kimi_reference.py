"""The outside yardsticks for a Kimi tiktoken folder: tiktoken itself, and transformers' conversion.

``KIMI_PAT_STR`` is copied here from the release's ``tokenization_kimi.py`` (``TikTokenTokenizer.pat_str``),
not imported from Metrale; ``kimi_encoding`` builds the ``tiktoken.Encoding`` exactly as that file's
``TikTokenTokenizer.__init__`` does (tiktoken's own file reader, 256 special ids after the ranks, named by
``added_tokens_decoder`` or ``<|reserved_token_{id}|>``). transformers 5.23 loads such a folder without
remote code but splits its text with cl100k's pattern (``TikTokenConverter``'s default);
``transformers_tokenizer(..., kimi_split=True)`` swaps in the release's pattern and keeps everything else
transformers built: vocabulary, merges, special and reserved tokens, decoder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tokenizers import Regex, pre_tokenizers

KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED_SPECIAL_TOKENS = 256


def no_tiktoken_cache() -> Any:
    """tiktoken caches every file it reads by its path; tests write new files under reused names."""
    return mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": ""})


def kimi_encoding(directory: Path) -> tiktoken.Encoding:
    """The release's ``TikTokenTokenizer.model`` for ``directory``."""
    with no_tiktoken_cache():
        ranks = load_tiktoken_bpe(str(directory / "tiktoken.model"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    named = {int(i): entry["content"] for i, entry in config["added_tokens_decoder"].items()}
    base = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + NUM_RESERVED_SPECIAL_TOKENS)}
    return tiktoken.Encoding(name="kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def transformers_tokenizer(directory: Path, *, kimi_split: bool) -> Any:
    """``AutoTokenizer.from_pretrained(directory)``, its split pattern replaced by Kimi's if asked."""
    from transformers import AutoTokenizer

    with no_tiktoken_cache():
        tokenizer = AutoTokenizer.from_pretrained(directory)
    if kimi_split:
        backend = tokenizer.backend_tokenizer
        backend.pre_tokenizer[0] = pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated", invert=False)
    return tokenizer


def split_pattern(tokenizer: Any) -> str:
    """The regular expression of the first (``Split``) pre-tokenizer of a transformers tokenizer."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    return str(state["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"])
