"""The model announcement: what it carries, and a fingerprint that follows the weights cheaply."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.fleet.announcement import (
    FINGERPRINT_HEAD_BYTES,
    generation_config_text,
    model_announcement,
    model_fingerprint,
    tokenizer_config_text,
)


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def append_to_config(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "note": "changed"}))


CHANGES: dict[str, Callable[[Path], None]] = {
    "weight-byte-in-head": lambda d: flip_byte(d / "model.safetensors", FINGERPRINT_HEAD_BYTES - 1),
    "config": append_to_config,
    "extra-weights-file": lambda d: (d / "extra.safetensors").write_bytes(b"\x00" * 16),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_the_fingerprint_changes_with_the_weights_or_config(
    tiny_model_dir: Path, model_copy: Path, change: Callable[[Path], None]
) -> None:
    assert model_fingerprint(model_copy) == model_fingerprint(tiny_model_dir)
    change(model_copy)
    assert model_fingerprint(model_copy) != model_fingerprint(tiny_model_dir)


def test_the_fingerprint_reads_only_the_head_of_each_weights_file(tiny_model_dir: Path, model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    assert weights.stat().st_size > FINGERPRINT_HEAD_BYTES
    flip_byte(weights, FINGERPRINT_HEAD_BYTES)
    assert model_fingerprint(model_copy) == model_fingerprint(tiny_model_dir)


def test_a_chat_template_file_is_folded_into_the_tokenizer_config(model_copy: Path) -> None:
    original = (model_copy / "tokenizer_config.json").read_text()
    assert tokenizer_config_text(model_copy) == original
    (model_copy / "chat_template.jinja").write_text("{{ messages[0].content }}")

    folded = json.loads(tokenizer_config_text(model_copy))

    assert folded == {**json.loads(original), "chat_template": "{{ messages[0].content }}"}


def test_the_generation_config_is_announced_as_its_text(model_copy: Path) -> None:
    assert generation_config_text(model_copy) == "{}"
    text = '{"temperature": 0.6, "top_k": 20}'
    (model_copy / "generation_config.json").write_text(text)
    assert generation_config_text(model_copy) == text


def test_the_announcement_describes_the_loaded_model(tiny_model_dir: Path) -> None:
    loaded = build_engine(tiny_model_dir, EngineLimits(max_seqs=2, num_blocks=16, max_model_len=200))

    announced = model_announcement(loaded, "served-as")

    assert announced.model == "served-as"
    assert announced.max_model_len == 200
    assert announced.vocab_size == loaded.config.vocab_size
    assert set(announced.eos_token_ids) == set(loaded.config.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)
    assert announced.tokenizer_json == (tiny_model_dir / "tokenizer.json").read_text()
    assert announced.fingerprint == model_fingerprint(tiny_model_dir)


def test_a_tiktoken_folder_announces_a_tokenizer_the_gateway_loads_alike(tmp_path: Path) -> None:
    from metrale.gateway.fleet.registry import build_tokenizer
    from metrale.worker.model.release_layout import write_release_model

    directory = write_release_model(tmp_path / "release")
    assert not (directory / "tokenizer.json").exists()
    loaded = build_engine(directory, EngineLimits(max_seqs=2, num_blocks=16))

    gateway_side = build_tokenizer(model_announcement(loaded, "kimi"))

    worker_side = loaded.tokenizer
    text = "It's 中文abc HelloWorld <|im_end|> 👋🏽 12345\n\tdef f(): pass"
    assert gateway_side.encode(text) == worker_side.encode(text)
    assert gateway_side.special_token_ids == worker_side.special_token_ids
    assert gateway_side.eos_token_ids == worker_side.eos_token_ids
    chat = [{"role": "user", "content": "你好"}]
    assert gateway_side.apply_chat_template(chat) == worker_side.apply_chat_template(chat)
