"""Learning a small byte-level BPE from text, as tiktoken ranks (for tokenizers Metrale writes itself)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from metrale.text.tiktoken_vocab.backend import byte_to_char


def learn_ranks(texts: Sequence[str], pattern: str, num_merges: int) -> dict[bytes, int]:
    """A BPE learned from ``texts`` split by ``pattern`` (``tokenizers``' ``BpeTrainer``, deterministic).

    Ranks: the 256 single bytes in byte order, then each learned token in the order it was learned, so
    both parts of a token rank below it. At most ``num_merges`` tokens are learned (fewer if no pair
    occurs twice any more).
    """
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + num_merges,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(texts), trainer=trainer)
    char_to_byte = {char: byte for byte, char in byte_to_char().items()}
    ranks = {bytes([byte]): byte for byte in range(256)}
    for spelled, _ in sorted(backend.get_vocab().items(), key=lambda item: item[1]):
        ranks.setdefault(bytes(char_to_byte[char] for char in spelled), len(ranks))
    return ranks
