"""Writing a small tokenizer in exactly the files and layout of a Kimi release, made without downloads.

``tiktoken.model`` holds a byte-level BPE learned (``bpe_training.learn_ranks``, split by Kimi's pattern)
from ``TRAINING_TEXTS``: prose, Chinese, Japanese, Korean, emoji, digits, contractions and code, so
every kind of piece the pattern cuts has merges. The 256 special ids follow the base vocabulary as in the
release (``[BOS]`` first, ``<|im_end|>`` third, ``[PAD]`` last); ``tokenizer_config.json`` names them in
``added_tokens_decoder`` (the unnamed ones are ``<|reserved_token_{id}|>``) and declares the tokenizer as
the release does (``tokenizer_class`` + ``auto_map``); ``chat_template.jinja`` is Kimi's chat format.
Training is deterministic: the same bytes on every machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from metrale.text.builtin_tokenizer import TRAINING_TEXT
from metrale.text.chat_templates.kimi import KIMI_CHAT_TEMPLATE
from metrale.text.tiktoken_vocab.bpe_training import learn_ranks
from metrale.text.tiktoken_vocab.families import KIMI
from metrale.text.tiktoken_vocab.ranks import TIKTOKEN_FILE, write_ranks

KIMI_NAMED_SPECIALS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}
"""Offset after the base vocabulary → the release's named special token."""

KIMI_ADDITIONAL_SPECIALS = [
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "[EOT]",
    "<|im_system|>",
    "<|im_middle|>",
]

NUM_MERGES = 768

TRAINING_TEXTS = (
    TRAINING_TEXT,
    """\
灯塔看守人每天黎明前醒来。她爬上塔楼的九十二级台阶，给转动大透镜的发条上紧，然后在一本蓝色的小笔记本里
写下时间、风向和海况。平静的日子里，记录很短；暴风雨的日子里，她写满整整一页。我们在北京学习中文，
中文的文字很美。今天天气很好，我们去公园散步吧！你好，世界。谢谢你的帮助。
灯台守は毎朝夜明け前に目を覚ました。カタカナとひらがなと漢字が混ざった文章です。ありがとうございます。
등대지기는 매일 새벽 전에 일어났다. 한국어 문장도 조금 있습니다. 감사합니다.
Emoji: 👋 👋🏽 😀😀 🚀✨ 👩‍💻 🇫🇷 ❤️ — naïve café, Ünïcödé, ÉCOLE, straße.
It's what they'd said: we'll see, I'M sure, DON'T worry, you're right, she's here, they've gone.
Numbers: 0 1 12 123 1234 12345 3.14159 2026-12-01 10,000,000 $42.50 99% ²³ ٣٤٥.
CamelCaseIdentifiers like HelloWorld, parseJSONValue and HTTPServer.
""",
    """\
def fibonacci(n: int) -> list[int]:
    \"\"\"The first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def tick(self, step: int = 1) -> int:
        self.count += step
        return self.count

if __name__ == "__main__":
\tprint(fibonacci(10), {"key": [1, 2, 3]}, x != y, a <= b)
""",
)


@dataclass(frozen=True)
class KimiTokenizerIds:
    """The ids a model config must agree with."""

    base_vocab_size: int
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


def write_kimi_tokenizer(directory: Path) -> KimiTokenizerIds:
    """Write ``tiktoken.model``, ``tokenizer_config.json`` and ``chat_template.jinja`` into ``directory``."""
    ranks = learn_ranks(TRAINING_TEXTS, KIMI.pattern, NUM_MERGES)
    write_ranks(directory / TIKTOKEN_FILE, ranks)
    base = len(ranks)
    config = kimi_tokenizer_config(base)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (directory / "chat_template.jinja").write_text(KIMI_CHAT_TEMPLATE, encoding="utf-8")
    return KimiTokenizerIds(
        base_vocab_size=base,
        vocab_size=base + KIMI.num_special_ids,
        bos_token_id=base,
        eos_token_id=base + 2,
        pad_token_id=base + 255,
    )


def kimi_tokenizer_config(base: int) -> dict[str, object]:
    """The release's ``tokenizer_config.json`` for a base vocabulary of ``base`` tokens."""
    added = {
        str(base + offset): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, token in KIMI_NAMED_SPECIALS.items()
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": KIMI_ADDITIONAL_SPECIALS,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
