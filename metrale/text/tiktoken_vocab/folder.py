"""Loading a model folder whose tokenizer is tiktoken's (``tiktoken.model`` + ``tokenizer_config.json``).

What the release's remote ``TikTokenTokenizer`` does, without running it: the ranks of ``tiktoken.model``
are the base vocabulary; the ``num_special_ids`` ids after it are special tokens, named by
``added_tokens_decoder`` or else ``<|reserved_token_{id}|>``; the pattern comes from the tokenizer's
family. Encoding adds no BOS, and special-token text in the input encodes as the special id.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from metrale.text.tiktoken_vocab.backend import tiktoken_backend
from metrale.text.tiktoken_vocab.families import tiktoken_family
from metrale.text.tiktoken_vocab.ranks import TIKTOKEN_FILE, read_ranks
from metrale.text.tokenizer_files import NAMED_SPECIAL_TOKENS, TokenizerError, token_content


def load_tiktoken_folder(
    directory: Path, config: Mapping[str, Any], config_path: Path
) -> tuple[BackendTokenizer, dict[str, str]]:
    """The backend tokenizer of ``directory`` and its named special tokens (``bos_token`` → text).

    ``config`` is the folder's ``tokenizer_config.json`` (at ``config_path``; empty when absent). Raises
    ``TokenizerError`` naming the file at fault: an unknown (or no) tokenizer class, special ids inside
    the base vocabulary or past the special ids, a named special token that is not one of them.
    """
    family = tiktoken_family(config, config_path)
    ranks = read_ranks(directory / TIKTOKEN_FILE)
    specials = special_tokens(config, config_path, base=len(ranks), count=family.num_special_ids)
    backend = tiktoken_backend(ranks, family.pattern, specials)
    for offset, token in enumerate(specials):
        if backend.token_to_id(token) != len(ranks) + offset:
            raise TokenizerError(
                f"{config_path}: special token {token!r} (id {len(ranks) + offset}) is also a token of {TIKTOKEN_FILE}"
            )
    return backend, named_special_tokens(config, config_path, frozenset(specials))


def special_tokens(config: Mapping[str, Any], config_path: Path, *, base: int, count: int) -> list[str]:
    """The texts of ids ``base .. base+count-1``: ``added_tokens_decoder``'s, else reserved names."""
    named = _added_tokens(config, config_path)
    for token_id, token in named.items():
        if token_id < base:
            raise TokenizerError(
                f"{config_path}: added_tokens_decoder id {token_id} ({token!r}) collides with the base "
                f"vocabulary of {TIKTOKEN_FILE} (ids 0..{base - 1}); special ids start at {base}"
            )
        if token_id >= base + count:
            raise TokenizerError(
                f"{config_path}: added_tokens_decoder id {token_id} ({token!r}) is past the {count} special "
                f"ids {base}..{base + count - 1}"
            )
    texts = [named.get(token_id, f"<|reserved_token_{token_id}|>") for token_id in range(base, base + count)]
    if len(set(texts)) != len(texts):
        twice = next(text for text in texts if texts.count(text) > 1)
        raise TokenizerError(f"{config_path}: special token {twice!r} has more than one id")
    return texts


def named_special_tokens(config: Mapping[str, Any], config_path: Path, specials: frozenset[str]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as the config sets them; each must be one of ``specials``."""
    named: dict[str, str] = {}
    for name in NAMED_SPECIAL_TOKENS:
        content = token_content(config.get(name))
        if content is None:
            continue
        if content not in specials:
            raise TokenizerError(f"{config_path}: {name} {content!r} is not one of the special tokens")
        named[name] = content
    return named


def _added_tokens(config: Mapping[str, Any], config_path: Path) -> dict[int, str]:
    entries = config.get("added_tokens_decoder") or {}
    if not isinstance(entries, Mapping):
        raise TokenizerError(f"{config_path}: added_tokens_decoder must be an object of id → token")
    named: dict[int, str] = {}
    for key, entry in entries.items():
        content = token_content(entry)
        if not str(key).isdigit() or content is None:
            raise TokenizerError(f"{config_path}: added_tokens_decoder entry {key!r} is not id → token")
        named[int(key)] = content
    return named
