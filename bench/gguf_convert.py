"""Run a llama.cpp tree's ``convert_hf_to_gguf.py`` on one of our models.

    python bench/gguf_convert.py LLAMA_CPP_TREE MODEL_DIR [--unknown-pre-tokenizer NAME] [converter arguments...]

(with the tree and its ``gguf-py`` on ``PYTHONPATH``; ``bench/llamacpp.py`` does this). The converter
names a BPE tokenizer's pre-tokenizer by hashing its ids on a test text and refuses ones it does not know;
our tokenizers are byte-level BPEs of our own vocabulary, so their hash is unknown and this names it
``NAME`` instead: ``gpt-2`` (the default: the built-in tokenizer's split) or the release's name for the
split a model's tokenizer copies (``qwen35`` for our Qwen3.5 tokenizer). Nothing else about the conversion
changes — the weights go through the converter's own code.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any


def split_arguments(argv: list[str]) -> tuple[str, str, str, list[str]]:
    """``(tree, model_dir, unknown pre-tokenizer name, the converter's own arguments)`` from ``argv``."""
    tree, model_dir, *rest = argv
    name = "gpt-2"
    if "--unknown-pre-tokenizer" in rest:
        at = rest.index("--unknown-pre-tokenizer")
        name = rest[at + 1]
        rest = rest[:at] + rest[at + 2 :]
    return tree, model_dir, name, rest


def main() -> None:
    tree, model_dir, unknown, rest = split_arguments(sys.argv[1:])
    from conversion.base import TextModel  # the tree's own package

    recognise = TextModel.get_vocab_base_pre

    def pre_tokenizer(self: Any, tokenizer: Any) -> str:
        try:
            return str(recognise(self, tokenizer))
        except NotImplementedError:
            return unknown

    TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = [str(Path(tree) / "convert_hf_to_gguf.py"), model_dir, *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
