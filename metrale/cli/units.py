"""Sizes as people type them: memory (``141GB``, ``141GiB``, ``80G``) and token counts (``32k``, ``1M``)."""

from __future__ import annotations

import re

_PREFIXES = "KMGT"
_BYTES = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", re.IGNORECASE)
_TOKENS = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KM]?)\s*", re.IGNORECASE)


class UnitError(ValueError):
    """A size that cannot be read; the message shows what is accepted."""


def parse_bytes(text: str) -> int:
    """Bytes in ``text``: SI prefixes are powers of 1000 (``141GB``, ``80G``), binary ones of 1024
    (``141GiB``, ``512Mi``); a bare number is bytes."""
    match = _BYTES.fullmatch(text)
    if match is None:
        raise UnitError(f"cannot read the memory size {text!r} (examples: 141GB, 141GiB, 80G, 512MiB)")
    number, prefix, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** (_PREFIXES.index(prefix.upper()) + 1 if prefix else 0))


def parse_tokens(text: str) -> int:
    """Tokens in ``text``: ``k`` is 1024 and ``M`` 1024² (``32k`` = 32,768; ``1M`` = 1,048,576, as
    context lengths are quoted); a bare number is tokens."""
    match = _TOKENS.fullmatch(text)
    if match is None:
        raise UnitError(f"cannot read the token count {text!r} (examples: 4096, 32k, 128K, 1M)")
    number, prefix = match.groups()
    tokens = int(float(number) * 1024 ** ("KM".index(prefix.upper()) + 1 if prefix else 0))
    if tokens < 1:
        raise UnitError(f"the token count {text!r} must be at least 1")
    return tokens
