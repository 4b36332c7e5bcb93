"""The random-weight tiny model's cache: written whole or not at all, and staging folders of crashed
writers removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from metrale.worker.model import builtin
from metrale.worker.model.builtin import RANDOM_MODEL_NAME, random_model_dir, remove_stale_staging


def test_the_random_model_is_written_once_and_reused(tmp_path: Path) -> None:
    first = random_model_dir(tmp_path)
    assert first.name == RANDOM_MODEL_NAME  # the folder name is the name it is served under
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert random_model_dir(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written
    assert [p.name for p in first.parent.iterdir()] == [RANDOM_MODEL_NAME]


def test_a_failed_write_leaves_no_folder_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(directory: Path) -> Path:
        (directory / "config.json").parent.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(builtin, "write_tiny_model", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        random_model_dir(tmp_path)
    models = tmp_path / "models"
    assert [p for p in models.rglob("*") if p.is_dir() and p.name.startswith(RANDOM_MODEL_NAME)] == []


def test_staging_folders_of_dead_writers_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"{RANDOM_MODEL_NAME}.tmp-{dead_pid}"
    live = tmp_path / f"{RANDOM_MODEL_NAME}.tmp-{os.getpid()}"
    for folder in (stale, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    assert remove_stale_staging(tmp_path) == [stale]
    assert not stale.exists() and live.exists()


def test_a_stale_staging_folder_is_cleaned_when_the_model_is_written(tmp_path: Path) -> None:
    target_parent = random_model_dir(tmp_path / "first").parent.relative_to(tmp_path / "first")
    parent = tmp_path / "second" / target_parent
    parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = parent / f"{RANDOM_MODEL_NAME}.tmp-{int(dead.stdout)}"
    stale.mkdir()
    random_model_dir(tmp_path / "second")
    assert not stale.exists()


def test_the_trained_builtin_model_ships_in_the_package() -> None:
    directory = builtin.builtin_model_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md"):
        assert (directory / name).is_file(), name
