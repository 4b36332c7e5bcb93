"""Reading the JSON and Jinja files of a Hugging Face model directory that describe its tokenizer."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken

NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The special-token names ``tokenizer_config.json`` may set (``transformers``' named special tokens)."""

_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized")


class TokenizerError(ValueError):
    """A tokenizer file is missing or cannot be read; the message names the file."""


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None if there is no such file."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(f"{path}: cannot read JSON ({error})") from error
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def token_content(value: object) -> str | None:
    """The token string of a config entry: a plain string or an AddedToken-style ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def added_token(value: str | Mapping[str, Any]) -> AddedToken:
    """A special ``AddedToken`` from a config entry, keeping its strip / single-word / normalized flags."""
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    flags = {flag: bool(value[flag]) for flag in _ADDED_TOKEN_FLAGS if flag in value}
    flags.setdefault("normalized", False)
    return AddedToken(str(value["content"]), special=True, **flags)


def read_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: ``chat_template.jinja`` if present, else the config's ``chat_template``.

    The config holds either one template string or a list of ``{"name", "template"}`` entries, of which
    the one named ``"default"`` is taken.
    """
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        try:
            return template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise TokenizerError(f"{template_file}: cannot read ({error})") from error
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, Mapping) and entry.get("name") == "default":
                return str(entry["template"])
    return None


def read_config_eos_ids(directory: Path) -> frozenset[int]:
    """``eos_token_id`` (an int or a list of ints) of ``generation_config.json`` and ``config.json``."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        config = read_json(directory / name) or {}
        value = config.get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        ids.update(item for item in values if isinstance(item, int) and not isinstance(item, bool))
    return frozenset(ids)
