"""A model folder whose tokenizer and chat template are shaped like Qwen3.5's, over the tiny Kimi model.

The weights don't matter for format tests (constrained decoding guarantees a forced call's format):
the built-in tiny model's, with an embedding table widened for four added tokens that, as in the
release, are not special (they survive ``skip_special_tokens``): ``<tool_call>``, ``</tool_call>``,
``<think>``, ``</think>``. ``<|im_end|>`` ends a turn. The chat template is ``QWEN3_5_CHAT_TEMPLATE``
(thinking on unless ``enable_thinking`` is false); ``generation_config.json`` holds Qwen's sampling
defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from metrale.text.builtin_tokenizer import IM_END_TOKEN, write_builtin_tokenizer
from metrale.text.chat_templates.qwen import QWEN3_5_CHAT_TEMPLATE
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.tiny import random_weights, tiny_config_dict

ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
GENERATION_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def write_qwen_shaped_model(directory: Path, *, seed: int = 0) -> Path:
    """Write the folder to ``directory`` (created if needed); the same bytes every time."""
    directory.mkdir(parents=True, exist_ok=True)
    write_builtin_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in ADDED_TOKENS])
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config_file = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text(encoding="utf-8"))
    tokenizer_config.pop("chat_template")
    config_file.write_text(json.dumps({**tokenizer_config, "eos_token": IM_END_TOKEN}, indent=2) + "\n")
    (directory / "chat_template.jinja").write_text(QWEN3_5_CHAT_TEMPLATE, encoding="utf-8")
    data = tiny_config_dict(tokenizer.get_vocab_size(with_added_tokens=True))
    (directory / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    generation = {"eos_token_id": data["eos_token_id"], **GENERATION_DEFAULTS}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights = random_weights(ModelConfig.from_hf_dict(data), seed)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
