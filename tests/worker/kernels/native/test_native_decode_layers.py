"""A Kimi-Linear model's decoder layers over decode rows as one C call (``native.decode_layers``) against the
layers run one by one: bit for bit — every step's logits and every state after — since a decode row of
one path must be the twin of the same row through the other (a verify row, a decode row beside a
prefill, a bf16 model's, all take the layers one by one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.models import bench_model
from metrale.worker.model.families.kimi_linear_decode import FusedDecodeLayers
from metrale.worker.model.loader import load_model
from tests.worker.kernels.native.decode_runs import DECODE_FORWARDS, assert_same_bits, decode_run

pytestmark = pytest.mark.usefixtures("native_backend")


def _decode_run(model_dir: Path, fused: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``decode_run`` with the whole-stack C call on or off."""
    calls = {"run": 0}
    run = FusedDecodeLayers.run

    def counted(self: FusedDecodeLayers, *args: Any) -> torch.Tensor:
        calls["run"] += 1
        return run(self, *args)

    monkeypatch.setattr(FusedDecodeLayers, "run", counted)
    if not fused:
        monkeypatch.setattr(FusedDecodeLayers, "takes", lambda *args: False)
    result = decode_run(model_dir)
    monkeypatch.undo()
    assert calls["run"] == (DECODE_FORWARDS if fused else 0)
    return result


@pytest.fixture(scope="module")
def medium_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Kimi bench model's shape (MoE with grouped routing and a shared expert, 4-head MLA)."""
    return bench_model("medium-4-heads", tmp_path_factory.mktemp("medium"))


@pytest.mark.parametrize("which", ["tiny", "medium-4-heads"])
def test_fused_decode_layers_are_the_layer_by_layer_bits(
    which: str, tiny_model_dir: Path, medium_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_model_dir if which == "tiny" else medium_model_dir
    assert_same_bits(_decode_run(model_dir, True, monkeypatch), _decode_run(model_dir, False, monkeypatch))


def test_a_bf16_model_takes_the_layers_one_by_one(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype="bfloat16")
    assert not model._fused_layers().fits
