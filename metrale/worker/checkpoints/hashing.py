"""Hashes of token prefixes: a chain over fixed blocks, so every prefix hash costs O(its tail).

``prefix_hash(tokens, n)`` identifies exactly the tokens ``[0, n)``: the chain value after the last
whole block, extended by the remaining tokens and ``n`` itself.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

CHAIN_BLOCK = 64
"""Tokens per link of the hash chain."""
_ROOT = hashlib.sha256(b"metrale-token-chain-v1").digest()


def _pack(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


class PrefixHasher:
    """Prefix hashes of one token sequence, sharing the chain work between prefixes."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens
        self._chain = [_ROOT]  # _chain[i] covers tokens [0, i * CHAIN_BLOCK)

    def _link(self, blocks: int) -> bytes:
        while len(self._chain) <= blocks:
            i = len(self._chain) - 1
            block = self.tokens[i * CHAIN_BLOCK : (i + 1) * CHAIN_BLOCK]
            self._chain.append(hashlib.sha256(self._chain[-1] + _pack(block)).digest())
        return self._chain[blocks]

    def __call__(self, n: int) -> str:
        """Hex hash of ``tokens[:n]`` (32 hex digits)."""
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"prefix length {n} outside 0..{len(self.tokens)}")
        whole = n // CHAIN_BLOCK
        tail = self.tokens[whole * CHAIN_BLOCK : n]
        return hashlib.sha256(self._link(whole) + _pack(tail) + struct.pack("<Q", n)).hexdigest()[:32]

    def many(self, lengths: Iterable[int]) -> dict[int, str]:
        return {n: self(n) for n in lengths}


def prefix_hash(tokens: Sequence[int], n: int | None = None) -> str:
    """Hex hash of ``tokens[:n]`` (all of them when ``n`` is None)."""
    return PrefixHasher(tokens)(len(tokens) if n is None else n)
