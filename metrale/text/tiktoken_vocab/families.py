"""Which tiktoken tokenizer a folder holds, and the pre-tokenizer pattern that family splits text with.

A ``tiktoken.model`` holds ranks only; the regular expression that cuts text into pieces before BPE lives
in the repository's remote code (``tokenization_kimi.py`` for Kimi), which Metrale never runs. The family
is named by ``tokenizer_config.json``'s ``auto_map`` (and ``tokenizer_class``); a class not listed here is
refused rather than split with a guessed pattern, which would give ids the model was never trained on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale.text.tokenizer_files import TokenizerError

KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
"""``TikTokenTokenizer.pat_str`` of Kimi's ``tokenization_kimi.py``: runs of Han characters on their own,
then words split at case changes (Han excluded from both letter classes, ``&&`` is a character-class
intersection, read alike by tiktoken's regex engine and the Oniguruma engine of ``tokenizers``) with a
contraction attached, numbers of up to three digits, punctuation runs, whitespace."""


@dataclass(frozen=True)
class TiktokenFamily:
    """What a tiktoken tokenizer class adds to its ranks file."""

    name: str
    pattern: str
    num_special_ids: int
    """How many ids after the base vocabulary are special; ``added_tokens_decoder`` names some of them,
    the others are ``<|reserved_token_{id}|>``."""


KIMI = TiktokenFamily(name="Kimi", pattern=KIMI_PATTERN, num_special_ids=256)

FAMILIES: dict[str, TiktokenFamily] = {"tokenization_kimi.TikTokenTokenizer": KIMI}
"""``auto_map`` class reference (``module.Class``) → family."""


def tiktoken_family(config: Mapping[str, Any], config_path: Path) -> TiktokenFamily:
    """The family ``config`` (read from ``config_path``) names; raise ``TokenizerError`` for any other."""
    reference = _auto_tokenizer_reference(config)
    declared = config.get("tokenizer_class")
    family = FAMILIES.get(reference or "")
    class_name = (reference or "").rpartition(".")[2]
    if family is None or (declared is not None and declared != class_name):
        shown = reference or declared
        what = "names no tokenizer class" if shown is None else f"names tiktoken tokenizer class {shown!r}"
        raise TokenizerError(
            f"{config_path}: {what}; Metrale knows the pre-tokenizer pattern of {', '.join(sorted(FAMILIES))} "
            f"only (the pattern lives in remote code, which Metrale does not run)"
        )
    return family


def _auto_tokenizer_reference(config: Mapping[str, Any]) -> str | None:
    """``module.Class`` of ``auto_map``'s ``AutoTokenizer`` (slow class first), without a ``repo--`` prefix."""
    auto_map = config.get("auto_map")
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, Mapping) else auto_map
    candidates = entry if isinstance(entry, list | tuple) else [entry]
    reference = next((item for item in candidates if isinstance(item, str)), None)
    return None if reference is None else reference.rpartition("--")[2]
