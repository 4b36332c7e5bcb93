"""``met model init-tiny --family qwen3_5``, ``qwen3_5_moe`` and ``qwen3_next``: written by our code, read by
transformers as the release's layout, generating what transformers generates."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.qwen3_5 import Qwen35Model
from metrale.worker.model.loader import load_model
from tests.worker.model.helpers import greedy_continuation


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def tiny_qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    result = CliRunner().invoke(app, ["model", "init-tiny", str(directory), "--family", request.param, "--seed", "4"])
    assert result.exit_code == 0, result.output
    return directory


def _family(directory: Path) -> str:
    return str(json.loads((directory / "config.json").read_text())["model_type"])


def _digest(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


def test_the_same_seed_writes_the_same_bytes(tiny_qwen: Path, tmp_path: Path) -> None:
    CliRunner().invoke(app, ["model", "init-tiny", str(tmp_path), "--family", _family(tiny_qwen), "--seed", "4"])
    assert _digest(tmp_path) == _digest(tiny_qwen)


def test_a_layout_flag_is_refused_for_qwen3_5(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["model", "init-tiny", str(tmp_path), "--family", "qwen3_5", "--layout", "release"]
    )
    assert result.exit_code != 0 and "--layout is for kimi_linear" in result.output


@pytest.fixture(scope="module")
def hf_model(tiny_qwen: Path) -> Any:
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM

    model_class = {
        "qwen3_5": Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration,
        "qwen3_next": Qwen3NextForCausalLM,
    }[_family(tiny_qwen)]
    hf, info = model_class.from_pretrained(tiny_qwen, dtype=torch.float32, output_loading_info=True)
    if _family(tiny_qwen) == "qwen3_next":  # text only: every tensor read
        assert not info["missing_keys"], info
    else:
        assert info["missing_keys"] and all(k.startswith("model.visual.") for k in info["missing_keys"]), info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    return hf.eval()


@pytest.mark.parametrize("length", [3, 40, 90])
def test_greedy_tokens_match_transformers(tiny_qwen: Path, hf_model: Any, length: int) -> None:
    prompt = torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
    model = load_model(tiny_qwen, dtype=torch.float32)
    assert isinstance(model, Qwen35Model)
    executor = ModelExecutor(model, num_slots=1, num_blocks=16, block_size=16)
    assert greedy_continuation(executor, prompt, 16) == out[0, length:].tolist()


def test_met_generate_runs_it(tiny_qwen: Path) -> None:
    result = CliRunner().invoke(
        app, ["generate", "--model", str(tiny_qwen), "--max-tokens", "6", "--temperature", "0", "Hello there"]
    )
    assert result.exit_code == 0, result.output


TRICKY_TEXTS = ["U\n\r 1 ", "\r \xa0\u0344\r交亷\ng", "Hello  world\n\n123456 it's", "e\u0301t\u00e9 <think>x</think>"]
"""Texts the built-in GPT-2 split tokenized otherwise than the release's (carriage returns, digit runs,
combining marks, NFC)."""


def test_our_tokenizer_splits_text_as_transformers_qwen3_5_tokenizer_does(tiny_qwen: Path) -> None:
    from transformers import AutoTokenizer

    from metrale.text.tokenizer import Tokenizer

    ours, theirs = Tokenizer.from_dir(tiny_qwen), AutoTokenizer.from_pretrained(str(tiny_qwen))
    for text in TRICKY_TEXTS:
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], repr(text)


def test_transformers_reads_every_token_of_the_tiny_qwen3_5_tokenizer_below_its_vocab_size(tmp_path: Path) -> None:
    """transformers' ``Qwen3_5Tokenizer`` adds ``<|endoftext|>`` to a tokenizer without it, one id past the
    model's vocabulary; the tiny writer writes it, special, as the last id."""
    from transformers import AutoTokenizer

    result = CliRunner().invoke(app, ["model", "init-tiny", str(tmp_path), "--family", "qwen3_5"])
    assert result.exit_code == 0, result.output
    text_config = json.loads((tmp_path / "config.json").read_text())["text_config"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    vocab = tokenizer.get_vocab()
    assert max(vocab.values()) == text_config["vocab_size"] - 1
    assert vocab["<|endoftext|>"] == text_config["vocab_size"] - 1 and "<|endoftext|>" in tokenizer.all_special_tokens
    assert tokenizer.convert_ids_to_tokens(
        [text_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")]
    ) == ["<|bos|>", "<|im_end|>", "<|pad|>"]
