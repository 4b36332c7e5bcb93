"""What a tiktoken folder must hold, and the one error naming the file for each thing wrong with it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from metrale.text.tiktoken_vocab.kimi_writer import write_kimi_tokenizer
from metrale.text.tiktoken_vocab.ranks import read_ranks, write_ranks
from metrale.text.tokenizer import Tokenizer, TokenizerError
from tests.text.kimi_reference import no_tiktoken_cache


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("kimi_tokenizer")
    write_kimi_tokenizer(directory)
    return directory


@pytest.fixture
def folder(written: Path, tmp_path: Path) -> Path:
    """A writable copy of the written tokenizer folder."""
    return Path(shutil.copytree(written, tmp_path / "model"))


def edit_config(folder: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
    return path


def base_size(folder: Path) -> int:
    return len(read_ranks(folder / "tiktoken.model"))


def test_ranks_round_trip_through_tiktokens_reader(written: Path, tmp_path: Path) -> None:
    from tiktoken.load import load_tiktoken_bpe

    with no_tiktoken_cache():
        expected = load_tiktoken_bpe(str(written / "tiktoken.model"))
    assert read_ranks(written / "tiktoken.model") == expected
    write_ranks(tmp_path / "copy.model", expected)
    assert (tmp_path / "copy.model").read_bytes() == (written / "tiktoken.model").read_bytes()


def test_tokenizer_json_wins_over_tiktoken_model(folder: Path) -> None:
    converted = Tokenizer.from_dir(folder)
    (folder / "tokenizer.json").write_text(converted.backend_json())
    (folder / "tiktoken.model").write_text("not read\n")
    reloaded = Tokenizer.from_dir(folder)
    text = "It's 中文abc <|im_end|> 👋🏽 12345"
    assert reloaded.encode(text) == converted.encode(text)
    assert reloaded.special_token_ids == converted.special_token_ids


def _unknown_class(folder: Path) -> tuple[Path, str]:
    def change(config: dict[str, Any]) -> None:
        config["auto_map"] = {"AutoTokenizer": ["tokenization_other.TikTokenTokenizer", None]}

    return edit_config(folder, change), "names tiktoken tokenizer class 'tokenization_other.TikTokenTokenizer'"


def _class_without_auto_map(folder: Path) -> tuple[Path, str]:
    return edit_config(folder, lambda config: config.pop("auto_map")), "class 'TikTokenTokenizer'"


def _no_config(folder: Path) -> tuple[Path, str]:
    path = folder / "tokenizer_config.json"
    path.unlink()
    return path, "names no tokenizer class"


def _collision(folder: Path) -> tuple[Path, str]:
    def change(config: dict[str, Any]) -> None:
        config["added_tokens_decoder"]["100"] = {"content": "<|im_user|>", "special": True}

    return edit_config(folder, change), "added_tokens_decoder id 100 ('<|im_user|>') collides with the base vocabulary"


def _past_the_specials(folder: Path) -> tuple[Path, str]:
    token_id = base_size(folder) + 256

    def change(config: dict[str, Any]) -> None:
        config["added_tokens_decoder"][str(token_id)] = {"content": "<|late|>", "special": True}

    return edit_config(folder, change), f"added_tokens_decoder id {token_id} ('<|late|>') is past the 256 special ids"


def _special_is_a_base_token(folder: Path) -> tuple[Path, str]:
    first = str(base_size(folder))

    def change(config: dict[str, Any]) -> None:
        config["added_tokens_decoder"][first]["content"] = "the"

    return edit_config(folder, change), f"special token 'the' (id {first}) is also a token of tiktoken.model"


def _named_token_not_special(folder: Path) -> tuple[Path, str]:
    return edit_config(folder, lambda config: config.update(bos_token="<s>")), "bos_token '<s>' is not one of"


def _bad_line(folder: Path) -> tuple[Path, str]:
    path = folder / "tiktoken.model"
    path.write_bytes(path.read_bytes() + b"%%% 7\n")
    return path, "expected 'base64-token rank'"


def _missing_byte(folder: Path) -> tuple[Path, str]:
    path = folder / "tiktoken.model"
    ranks = {token: rank for token, rank in read_ranks(path).items() if token != b"\x00"}
    write_ranks(path, {token: index for index, token in enumerate(sorted(ranks, key=ranks.__getitem__))})
    return path, "single bytes are not tokens (the first is 0x00)"


def _sparse_ranks(folder: Path) -> tuple[Path, str]:
    path = folder / "tiktoken.model"
    write_ranks(path, {token: rank * 2 for token, rank in read_ranks(path).items()})
    return path, "the ranks are not exactly 0.."


BREAKAGES: dict[str, Callable[[Path], tuple[Path, str]]] = {
    "unknown-class": _unknown_class,
    "class-without-auto-map": _class_without_auto_map,
    "no-tokenizer-config": _no_config,
    "special-id-in-base-vocab": _collision,
    "special-id-past-the-specials": _past_the_specials,
    "special-text-is-a-base-token": _special_is_a_base_token,
    "named-token-not-special": _named_token_not_special,
    "ranks-bad-line": _bad_line,
    "ranks-missing-byte": _missing_byte,
    "ranks-not-dense": _sparse_ranks,
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_bad_tiktoken_folder_is_refused_naming_the_file(folder: Path, breakage: str) -> None:
    path, expected = BREAKAGES[breakage](folder)
    with pytest.raises(TokenizerError) as caught:
        Tokenizer.from_dir(folder)
    message = str(caught.value)
    assert message.startswith(str(path)), message
    assert expected in message, message
    assert "\n" not in message
