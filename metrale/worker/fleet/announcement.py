"""What a worker tells gateways about the model it serves, and the fingerprint naming its weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from metrale.shared.messages import ModelAnnouncement
from metrale.worker.engine.factory import LoadedModel

FINGERPRINT_HEAD_BYTES = 1 << 20
"""How much of each safetensors file the fingerprint reads (besides its size)."""


def model_fingerprint(directory: Path) -> str:
    """sha256 (hex) of ``config.json``'s bytes, then each ``*.safetensors`` file's size and first MiB.

    Files are taken in name order. Cheap on a large checkpoint, and changes whenever the
    architecture, the shapes or (almost surely) the weights change.
    """
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for weights in sorted(directory.glob("*.safetensors")):
        digest.update(weights.stat().st_size.to_bytes(8, "little"))
        with weights.open("rb") as file:
            digest.update(file.read(FINGERPRINT_HEAD_BYTES))
    return digest.hexdigest()


def model_announcement(loaded: LoadedModel, served_name: str) -> ModelAnnouncement:
    """The announcement of ``loaded`` under ``served_name``, with the engine's context limit."""
    vocab_size = loaded.config.vocab_size
    eos = set(loaded.config.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)
    return ModelAnnouncement(
        model=served_name,
        tokenizer_json=tokenizer_json_text(loaded),
        tokenizer_config_json=tokenizer_config_text(loaded.directory),
        max_model_len=loaded.engine.config.max_model_len,
        vocab_size=vocab_size,
        eos_token_ids=sorted(token for token in eos if 0 <= token < vocab_size),
        fingerprint=model_fingerprint(loaded.directory),
        generation_config_json=generation_config_text(loaded.directory),
    )


def generation_config_text(directory: Path) -> str:
    """``generation_config.json`` as text; ``{}`` when the folder has none."""
    path = directory / "generation_config.json"
    return path.read_text(encoding="utf-8") if path.is_file() else "{}"


def tokenizer_json_text(loaded: LoadedModel) -> str:
    """``tokenizer.json`` as text; a folder without one (a ``tiktoken.model`` folder) announces its
    tokenizer as converted, which the gateway loads as it would that folder's."""
    tokenizer_file = loaded.directory / "tokenizer.json"
    if tokenizer_file.is_file():
        return tokenizer_file.read_text(encoding="utf-8")
    return loaded.tokenizer.backend_json()


def tokenizer_config_text(directory: Path) -> str:
    """``tokenizer_config.json`` as text (``{}`` when absent), with ``chat_template.jinja`` folded in.

    Newer repositories keep the chat template in its own file, where it wins over the config's; the
    gateway only receives the config, so the file's template is written into it.
    """
    config_file, template_file = directory / "tokenizer_config.json", directory / "chat_template.jinja"
    text = config_file.read_text(encoding="utf-8") if config_file.is_file() else "{}"
    if not template_file.is_file():
        return text
    config = json.loads(text)
    config["chat_template"] = template_file.read_text(encoding="utf-8")
    return json.dumps(config, ensure_ascii=False)
