"""A KDA layer's decode rows in one C call (``native.kda_layer``) against the layer's op-by-op path — bit
for bit, logits and every state, since a decode row of one path must be the twin of the same row through
the other (a verify row, or a decode row beside a prefill, takes the op-by-op path) — and the C decay
against torch's softplus."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from metrale.worker.kernels.native import kda_layer as native_kda_layer
from metrale.worker.model.families.kimi_linear_decode import FusedDecodeLayers
from metrale.worker.model.layers.kda import KimiDeltaAttention
from metrale.worker.model.loader import load_model
from tests.worker.kernels.native.decode_runs import DECODE_FORWARDS, assert_same_bits, decode_run

pytestmark = pytest.mark.usefixtures("native_backend")


def _decode_run(model_dir: Path, fused: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``decode_run`` with the KDA layers' fused decode on or off (the layers one by one either way)."""
    calls = {"fused": 0}
    decode_layer = native_kda_layer.decode_layer

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["fused"] += 1
        return decode_layer(*args, **kwargs)

    monkeypatch.setattr(native_kda_layer, "decode_layer", counted)
    # The layers one by one (a decode step's whole layer stack is one C call of its own: test_native_decode_layers)
    monkeypatch.setattr(FusedDecodeLayers, "takes", lambda *args: False)
    if not fused:
        monkeypatch.setattr(native_kda_layer, "supports", lambda *args: False)
    result = decode_run(model_dir)
    monkeypatch.undo()
    layers = sum(isinstance(m, KimiDeltaAttention) for m in load_model(model_dir, dtype="float32").modules())
    assert calls["fused"] == (DECODE_FORWARDS * layers if fused else 0)
    return result


def test_fused_decode_rows_are_the_op_by_op_paths_bits(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_same_bits(_decode_run(tiny_model_dir, True, monkeypatch), _decode_run(tiny_model_dir, False, monkeypatch))


def test_the_c_decay_matches_torch_softplus() -> None:
    generator = torch.Generator().manual_seed(0)
    f = 8.0 * torch.randn(7, 3 * 16, generator=generator)
    f[0, :5] = torch.tensor([-30.0, 19.99, 20.0, 20.01, 60.0])
    dt_bias, a_log = torch.randn(48, generator=generator), torch.randn(3, generator=generator)
    neg_a = -a_log.exp()
    expected = neg_a[:, None] * F.softplus((f + dt_bias).view(7, 3, 16), threshold=20.0)
    torch.testing.assert_close(native_kda_layer.softplus_decay(f, dt_bias, neg_a), expected, rtol=4e-7, atol=1e-30)
