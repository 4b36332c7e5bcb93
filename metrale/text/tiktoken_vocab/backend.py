"""A tiktoken vocabulary as a ``tokenizers`` tokenizer, converted the way ``transformers`` converts one.

tiktoken merges, in a piece of text, the adjacent pair whose joined bytes have the lowest rank, and takes a
piece that is itself a token whole. The same tokenizer in ``tokenizers`` terms (``transformers``'
``TikTokenConverter``): a byte-level BPE whose vocabulary is the ranks (bytes spelled with GPT-2's
byte-to-character table), whose merges are every split of each token into two tokens, ordered by the
joined token's rank, with ``ignore_merges`` (whole tokens first); the family's pattern splits the text
(``Split``, isolated) before the byte-level step. Special tokens follow the base vocabulary, in id order.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer


def tiktoken_backend(ranks: dict[bytes, int], pattern: str, special_tokens: Sequence[str]) -> BackendTokenizer:
    """The tokenizer of ``ranks`` (dense ids ``0..n-1``) split by ``pattern``, with ``special_tokens`` as
    ids ``n, n+1, ...``. A special token whose text is also a base token keeps that token's id: callers
    check the ids they need."""
    vocab, merges = _vocab_and_merges(ranks)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # tiktoken matches special tokens exactly: no stripping of neighbouring spaces, no normalization.
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special_tokens])
    return backend


@cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's table spelling each byte as one printable character (printable Latin-1 bytes as
    themselves, the others as U+0100 onwards): what byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in table)
    table.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return dict(sorted(table.items()))


def spell(token: bytes) -> str:
    """``token`` in the byte-level alphabet."""
    return token.decode("latin-1").translate(byte_to_char())  # Latin-1: code point = byte


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    spelled = {token: spell(token) for token in ranks}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    vocab = {spelled[token]: rank for token, rank in ranks.items()}
    return vocab, [(spelled[left], spelled[right]) for _, _, _, left, right in merges]
