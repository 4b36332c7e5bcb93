from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from metrale.text.builtin_tokenizer import (
    BOS_ID,
    BUILTIN_VOCAB_SIZE,
    EOS_ID,
    IM_END_ID,
    write_builtin_tokenizer,
)
from metrale.text.chat_templates.render import ChatTemplateError
from metrale.text.tokenizer import Tokenizer, TokenizerError

CHAT = [{"role": "system", "content": "Terse."}, {"role": "user", "content": "Hi 👋"}]


@pytest.fixture(scope="session")
def builtin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("builtin_tokenizer")
    write_builtin_tokenizer(directory)
    return directory


@pytest.fixture
def model_dir(builtin_dir: Path, tmp_path: Path) -> Path:
    """A writable copy of the built-in tokenizer's directory."""
    return Path(shutil.copytree(builtin_dir, tmp_path / "model"))


def read(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text(encoding="utf-8")))


def write(path: Path, value: object) -> None:
    path.write_text(json.dumps(value), encoding="utf-8")


def update_config(directory: Path, **changes: Any) -> None:
    config = read(directory / "tokenizer_config.json")
    config.update(changes)
    write(directory / "tokenizer_config.json", config)


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("file_name", "content"),
    [
        ("tokenizer.json", "{not json"),
        ("tokenizer.json", '{"model": {"type": "NoSuchModel"}}'),
        ("tokenizer_config.json", "{not json"),
        ("tokenizer_config.json", "[1, 2]"),
        ("generation_config.json", "\xff\xfe"),
    ],
    ids=[
        "tokenizer-json-syntax",
        "tokenizer-json-schema",
        "config-syntax",
        "config-not-object",
        "gen-config",
    ],
)
def test_corrupt_files_name_the_file(model_dir: Path, file_name: str, content: str) -> None:
    (model_dir / file_name).write_bytes(content.encode("latin-1"))
    with pytest.raises(TokenizerError, match=re.escape(str(model_dir / file_name))):
        Tokenizer.from_dir(model_dir)


def test_tokenizer_json_alone_loads_without_special_tokens_or_template(model_dir: Path) -> None:
    (model_dir / "tokenizer_config.json").unlink()
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.bos_token is None
    assert tokenizer.eos_token_ids == frozenset()
    assert tokenizer.chat_template is None
    assert tokenizer.decode(tokenizer.encode("naïve 灯塔")) == "naïve 灯塔"
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.apply_chat_template(CHAT)


def test_added_token_dicts_and_model_config_eos_ids_are_read(model_dir: Path) -> None:
    update_config(model_dir, eos_token={"content": "<|im_end|>", "lstrip": False, "rstrip": False})
    write(model_dir / "generation_config.json", {"eos_token_id": [EOS_ID, 7]})
    write(model_dir / "config.json", {"eos_token_id": 9})
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {IM_END_ID, EOS_ID, 7, 9}


def test_a_special_token_missing_from_the_vocab_is_added_as_transformers_does(model_dir: Path) -> None:
    update_config(model_dir, eos_token="<|end_of_text|>")
    tokenizer = Tokenizer.from_dir(model_dir)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    new_id = tokenizer.token_to_id("<|end_of_text|>")
    assert new_id == BUILTIN_VOCAB_SIZE
    assert tokenizer.vocab_size == BUILTIN_VOCAB_SIZE + 1 == len(hf_tokenizer)
    assert new_id in tokenizer.special_token_ids
    assert new_id in tokenizer.eos_token_ids
    assert tokenizer.encode("a<|end_of_text|>") == hf_tokenizer.encode("a<|end_of_text|>", add_special_tokens=False)


def test_chat_template_list_takes_the_default_entry(model_dir: Path) -> None:
    update_config(
        model_dir,
        chat_template=[
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"},
        ],
    )
    assert Tokenizer.from_dir(model_dir).render_chat(CHAT) == "[Terse.][Hi 👋]"


def test_chat_template_jinja_file_wins_over_the_config(model_dir: Path) -> None:
    (model_dir / "chat_template.jinja").write_text("{{ messages | length }} turns", encoding="utf-8")
    assert Tokenizer.from_dir(model_dir).render_chat(CHAT) == "2 turns"


def without_bos_eos_flags(directory: Path, *, keep_post_processor: bool) -> None:
    """Drop ``add_bos_token`` / ``add_eos_token`` from the config, and maybe the post-processor."""
    config = read(directory / "tokenizer_config.json")
    config.pop("add_bos_token")
    config.pop("add_eos_token")
    write(directory / "tokenizer_config.json", config)
    if not keep_post_processor:
        write(directory / "tokenizer.json", {**read(directory / "tokenizer.json"), "post_processor": None})


@pytest.mark.parametrize("keep_post_processor", [True, False], ids=["post-processor", "no-post-processor"])
def test_without_config_flags_the_post_processor_decides_as_in_transformers(
    model_dir: Path, keep_post_processor: bool
) -> None:
    without_bos_eos_flags(model_dir, keep_post_processor=keep_post_processor)
    ids = Tokenizer.from_dir(model_dir).encode("hello", add_special_tokens=True)
    assert (ids[0] == BOS_ID) == keep_post_processor
    assert ids == AutoTokenizer.from_pretrained(str(model_dir)).encode("hello", add_special_tokens=True)


@pytest.mark.parametrize(
    ("flags", "keep_post_processor", "adds_bos", "adds_eos"),
    [
        ({"add_bos_token": False}, True, False, False),
        ({"add_bos_token": True}, False, True, False),
        ({"add_bos_token": True, "add_eos_token": True}, True, True, True),
        ({"add_eos_token": True}, True, False, True),
    ],
    ids=["bos-off-over-post-processor", "bos-on-without-post-processor", "bos-and-eos", "eos-only"],
)
def test_config_flags_replace_the_post_processor(
    model_dir: Path, flags: dict[str, bool], keep_post_processor: bool, adds_bos: bool, adds_eos: bool
) -> None:
    # transformers 5 ignores these flags whenever tokenizer.json exists; Metrale honours them as
    # transformers 4 did for Llama-style tokenizers, because the config states the model's training setup.
    without_bos_eos_flags(model_dir, keep_post_processor=keep_post_processor)
    update_config(model_dir, **flags)
    tokenizer = Tokenizer.from_dir(model_dir)
    expected = [BOS_ID] * adds_bos + tokenizer.encode("hello") + [EOS_ID] * adds_eos
    assert tokenizer.encode("hello", add_special_tokens=True) == expected


def test_a_rendered_chat_keeps_the_templates_single_bos(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    ids = tokenizer.apply_chat_template(CHAT)
    assert tokenizer.encode(tokenizer.render_chat(CHAT), add_special_tokens=True)[:2] == [BOS_ID, BOS_ID]
    assert ids.count(BOS_ID) == 1
    assert ids == tokenizer.encode(tokenizer.render_chat(CHAT))


def test_extra_variables_reach_the_template(model_dir: Path) -> None:
    update_config(model_dir, chat_template="{{ 'think' if enable_thinking else 'fast' }}:{{ messages | length }}")
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.render_chat(CHAT, enable_thinking=True) == "think:2"
    assert tokenizer.apply_chat_template(CHAT, enable_thinking=False) == tokenizer.encode("fast:2")
