"""The loader: each source tensor lands in its place in the fused parameter, cast once, and loading
never holds a second copy of the weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.load_memory import measure
from bench.models import MEDIUM
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.families.kimi_linear import KimiLinearModel
from metrale.worker.model.loader import load_model
from metrale.worker.model.precision import parameter_dtype
from metrale.worker.model.tiny import write_tiny_model
from metrale.worker.model.weight_map import build_weight_map, canonical_name
from tests.worker.model.hf_reference import HF_CONFIGS, make_hf_checkpoint


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-bf16"), dtype="bfloat16")


def _configs(tmp_path_factory: pytest.TempPathFactory) -> list[ModelConfig]:
    configs = [ModelConfig.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("tiny")))]
    for name in sorted(HF_CONFIGS):
        directory = tmp_path_factory.mktemp(name)
        make_hf_checkpoint(name, directory)
        configs.append(ModelConfig.from_pretrained(directory))
    return configs


def test_every_recipe_fills_its_parameter_exactly_once(tmp_path_factory: pytest.TempPathFactory) -> None:
    for config in _configs(tmp_path_factory):
        with torch.device("meta"):
            shapes = {name: p.shape for name, p in KimiLinearModel(config).named_parameters()}
        weight_map = build_weight_map(config)
        assert set(weight_map) == set(shapes)
        for name, recipes in weight_map.items():
            for recipe in recipes:
                buffer = torch.zeros(shapes[name])
                views = recipe.place(buffer)
                assert [v.numel() for v in views] == [math.prod(s) for _, s in recipe.sources], name
                for view in views:
                    view += 1
                assert bool((buffer == 1).all()), f"{name}: some element covered twice or never"


def test_fused_parameters_hold_their_sources_in_order(tiny_model_dir: Path) -> None:
    stored = {canonical_name(k): v for k, v in load_file(tiny_model_dir / "model.safetensors").items()}
    params = dict(load_model(tiny_model_dir).named_parameters())
    kda = "layers.0.self_attn"
    in_proj = torch.cat([stored[f"{kda}.{n}_proj.weight"] for n in ("q", "k", "v", "f_a", "g_a", "b")])
    assert torch.equal(params["layers.0.attn.in_proj.weight"], in_proj)
    conv = torch.cat([stored[f"{kda}.{n}_conv1d.weight"] for n in "qkv"]).squeeze(1)
    assert torch.equal(params["layers.0.attn.conv_weight"], conv)
    assert torch.equal(params["layers.0.attn.A_log"], stored[f"{kda}.A_log"].flatten())
    moe = "layers.1.mlp.experts"
    for j in (0, 5):
        gate_up = torch.cat([stored[f"{moe}.{j}.w1.weight"], stored[f"{moe}.{j}.w3.weight"]])
        assert torch.equal(params["layers.1.mlp.experts_gate_up"][j], gate_up)
        assert torch.equal(params["layers.1.mlp.experts_down"][j], stored[f"{moe}.{j}.w2.weight"])


def test_a_bf16_checkpoint_loads_exactly_in_any_dtype(bf16_dir: Path) -> None:
    """bf16 stored, bf16 loaded: the same bits; loaded as fp32: the exact upcast. The tensors stored in
    fp32 (``A_log``, ``dt_bias``, as in the release) keep every bit in a bf16 model too."""
    stored = {canonical_name(k): v for k, v in load_file(bf16_dir / "model.safetensors").items()}
    assert stored["layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert stored["layers.0.self_attn.dt_bias"].dtype == torch.float32
    bf16, fp32 = load_model(bf16_dir), load_model(bf16_dir, dtype="float32")
    for (name, p16), (_, p32) in zip(bf16.named_parameters(), fp32.named_parameters(), strict=True):
        assert p16.dtype == parameter_dtype(name, torch.bfloat16), name
        assert p32.dtype == torch.float32, name
        assert torch.equal(p16.float(), p32), name
    assert torch.equal(bf16.layers[0].attn.dt_bias, stored["layers.0.self_attn.dt_bias"])


@pytest.mark.slow
def test_loading_holds_no_second_copy_of_the_weights(tmp_path: Path) -> None:
    """Peak memory of a fresh interpreter loading a bf16 model (70 MiB; ``bench/load_memory.py`` measures
    larger ones) grows by at most 1.3× the weights' bytes over its peak once everything is imported
    (``VmHWM``: ``ru_maxrss`` would carry this test process's own peak into the child). Measured 1.13;
    fusing by concatenation and casting afterwards, as the loader once did, measured 6.3."""
    directory = write_tiny_model(tmp_path / "medium-bf16", dtype="bfloat16", **MEDIUM)
    numbers = measure(directory, "auto")
    assert (numbers["hwm_load"] - numbers["hwm_imports"]) / numbers["weights"] <= 1.3
