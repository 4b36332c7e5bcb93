"""The ``tiktoken.model`` file: a byte-level BPE as one ``base64(token bytes) rank`` line per token.

A token's rank is its id and its merge priority: BPE joins the adjacent pair whose joined bytes have the
lowest rank. The file is read here rather than with ``tiktoken.load.load_tiktoken_bpe``, which caches
every file it reads under the temporary directory by its *path*, so a file changed in place would be
read stale.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from metrale.text.tokenizer_files import TokenizerError

TIKTOKEN_FILE = "tiktoken.model"
"""The name tiktoken-format vocabularies go by in a model folder (Kimi's releases)."""


def read_ranks(path: Path) -> dict[bytes, int]:
    """Token bytes → rank of the file at ``path``; raise ``TokenizerError`` naming the file (and line).

    The ranks must be exactly ``0..n-1`` (special ids are numbered from ``n`` on) and every single byte
    must be a token (else some text could not be encoded at all).
    """
    try:
        lines = path.read_bytes().splitlines()
    except OSError as error:
        raise TokenizerError(f"{path}: cannot read ({error})") from error
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        token, rank = _parse_line(path, number, line)
        if token in ranks:
            raise TokenizerError(f"{path}:{number}: token {token!r} is listed twice")
        ranks[token] = rank
    _check_complete(path, ranks)
    return ranks


def write_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    """Write ``ranks`` to ``path`` in tiktoken's format, in rank order."""
    lines = [base64.b64encode(token) + b" " + str(rank).encode() for token, rank in sorted(ranks.items(), key=_rank)]
    path.write_bytes(b"\n".join(lines) + b"\n")


def _rank(item: tuple[bytes, int]) -> int:
    return item[1]


def _parse_line(path: Path, number: int, line: bytes) -> tuple[bytes, int]:
    try:
        token, rank = line.split()
        return base64.b64decode(token, validate=True), int(rank)
    except (ValueError, binascii.Error):
        raise TokenizerError(f"{path}:{number}: expected 'base64-token rank', got {line[:60]!r}") from None


def _check_complete(path: Path, ranks: dict[bytes, int]) -> None:
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: the ranks are not exactly 0..{len(ranks) - 1}, one per token")
    missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: {len(missing)} single bytes are not tokens (the first is {missing[0]:#04x})")
