"""Run a llama.cpp tree's ``convert_hf_to_gguf.py`` on one of our models.

    python bench/gguf_convert.py LLAMA_CPP_TREE MODEL_DIR [converter arguments...]

(with the tree and its ``gguf-py`` on ``PYTHONPATH``; ``bench/llamacpp.py`` does this). The converter
names a BPE tokenizer's pre-tokenizer by hashing its ids on a test text and refuses ones it does not know;
our built-in tokenizer is a byte-level BPE with GPT-2's pre-tokenizer, so an unknown hash is named
``gpt-2``. Nothing else about the conversion changes — the weights go through the converter's own code.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    tree, model_dir, *rest = sys.argv[1:]
    from conversion.base import TextModel  # the tree's own package

    recognise = TextModel.get_vocab_base_pre

    def pre_tokenizer(self: Any, tokenizer: Any) -> str:
        try:
            return str(recognise(self, tokenizer))
        except NotImplementedError:
            return "gpt-2"

    TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = [str(Path(tree) / "convert_hf_to_gguf.py"), model_dir, *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
