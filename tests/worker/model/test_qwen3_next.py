"""The Qwen3-Next family's config reading and its checkpoint's fused tensors, as the loader sees them
(numerics against transformers: ``test_qwen3_5_parity.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from metrale.worker.model.config import ModelConfigError
from metrale.worker.model.families.qwen3_5_config import Qwen35MoeConfig
from metrale.worker.model.families.qwen3_next_config import Qwen3NextConfig
from metrale.worker.model.families.qwen3_next_tiny import write_tiny_qwen3_next
from metrale.worker.model.families.registry import family_for
from metrale.worker.model.loader import CheckpointError, load_model, stored_shapes

RELEASE_CONFIG = Path(__file__).parent / "data" / "qwen3-next-80b-a3b-instruct.config.json"
"""The release's ``config.json``, key for key (``../shared/reference/qwen3.5-qwen3-next``)."""


def _release_config() -> dict[str, Any]:
    return dict(json.loads(RELEASE_CONFIG.read_text()))


def test_the_release_config_reads_as_transformers_reads_it() -> None:
    from transformers import Qwen3NextConfig as HFConfig

    data = _release_config()
    assert family_for(data).name == "qwen3_next"
    config = Qwen3NextConfig.from_hf_dict(data)
    hf = HFConfig(**data)
    assert list(config.layer_types) == hf.layer_types  # every 4th layer full attention
    assert config.moe_layers == (True,) * 48 and config.norm_topk_prob
    assert (config.rope_theta, config.rotary_dim) == (hf.rope_parameters["rope_theta"], 64)
    assert config.dtype == "bfloat16" and not config.tie_word_embeddings
    assert config.eos_token_ids == (151645,)
    assert config.state_layout.family == "qwen3_next"  # a state of another family is refused by the pool


def test_mlp_only_layers_and_sparse_step_choose_the_moe_layers_as_transformers() -> None:
    from transformers import Qwen3NextConfig as HFConfig
    from transformers import Qwen3NextForCausalLM

    data = {**_release_config(), "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    config = Qwen3NextConfig.from_hf_dict(data)
    small = {**data, "hidden_size": 16, "num_experts": 2, "num_experts_per_tok": 1, "vocab_size": 8}
    small |= {"linear_num_key_heads": 1, "linear_num_value_heads": 1, "num_attention_heads": 1}
    with torch.device("meta"):
        hf = Qwen3NextForCausalLM(HFConfig(**small))
    assert config.moe_layers == tuple(type(layer.mlp).__name__.endswith("MoeBlock") for layer in hf.model.layers)
    assert config.moe_layers == (False, True, False, False, False, True)


def test_a_model_without_moe_layers_needs_no_expert_fields() -> None:
    data = {**_release_config(), "num_experts": 0}
    for field in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        del data[field]
    config = Qwen3NextConfig.from_hf_dict(data)
    assert not any(config.moe_layers) and config.intermediate_size == 5120


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mlp_only_layers": [48]}, r"mlp_only_layers=\[48\] must list layer indices in 0..47"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be at least 1"),
        ({"mlp_only_layers": [0], "intermediate_size": None}, "missing field 'intermediate_size'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
)
def test_bad_fields_are_refused_naming_them(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        Qwen3NextConfig.from_hf_dict({**_release_config(), **change})


def test_qwen3_5_moe_still_refuses_mlp_only_layers() -> None:
    data = {**_release_config(), "model_type": "qwen3_5_moe_text", "mlp_only_layers": [1]}
    with pytest.raises(ModelConfigError, match="mlp_only_layers is not supported"):
        Qwen35MoeConfig.from_hf_dict(data)


@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-next"), seed=1)


def test_fused_projections_are_presented_as_the_tensors_they_hold(tiny_next: Path) -> None:
    shapes = stored_shapes(tiny_next)
    assert shapes["layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 4 * 16 + 8 * 16, 64)
    assert shapes["layers.0.linear_attn.in_proj_z.weight"] == (8 * 16, 64)
    assert shapes["layers.0.linear_attn.in_proj_b.weight"] == shapes["layers.0.linear_attn.in_proj_a.weight"] == (8, 64)
    assert not any("in_proj_qkvz" in name or "in_proj_ba" in name for name in shapes)


def test_the_loaded_projection_holds_the_rows_transformers_splits_out(tiny_next: Path) -> None:
    """Our fused ``in_proj`` ``[q; k; v; z; b; a]`` rows are what transformers' ``fix_query_key_value_ordering``
    takes from ``in_proj_qkvz`` / ``in_proj_ba`` (checked on an identity input)."""
    from transformers import Qwen3NextForCausalLM

    hf = Qwen3NextForCausalLM.from_pretrained(tiny_next, dtype=torch.float32).eval()
    ours = load_model(tiny_next, dtype=torch.float32)
    theirs = hf.model.layers[0].linear_attn
    eye = torch.eye(64)[None]  # [1, D, D]: row i of each projection's output is column i of its weight
    q, k, v, z, b, a = theirs.fix_query_key_value_ordering(theirs.in_proj_qkvz(eye), theirs.in_proj_ba(eye))
    expected = torch.cat([t.reshape(64, -1) for t in (q, k, v, z, b, a)], dim=1).T
    assert torch.equal(ours.layers[0].attn.in_proj.weight, expected)


def test_a_fused_tensor_of_the_wrong_shape_is_refused_naming_it(tiny_next: Path, tmp_path: Path) -> None:
    for file in tiny_next.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = "model.layers.1.linear_attn.in_proj_ba.weight"
    shard = tmp_path / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name][:-2]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=rf"tensor '{name}' in {shard.name} has shape \[14, 64\], expected \[16, 64\]"
    ):
        load_model(tmp_path, dtype=torch.float32)


def test_fused_experts_load_as_the_per_expert_ones(tiny_next: Path, tmp_path: Path) -> None:
    """A Qwen3-Next checkpoint with experts fused 3-D (transformers' module layout) loads to the same model."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(tiny_next.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix, _, rest = name.partition(".experts.")
        if not rest:
            fused[name] = tensor
            continue
        expert, kind = int(rest.split(".")[0]), rest.split(".")[1]
        if kind == "gate_proj":
            pairs = [
                (tensors[f"{prefix}.experts.{j}.gate_proj.weight"], tensors[f"{prefix}.experts.{j}.up_proj.weight"])
                for j in range(4)
            ]
            fused[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat(p) for p in pairs])
        elif kind == "down_proj" and expert == 0:
            fused[f"{prefix}.experts.down_proj"] = torch.stack(
                [tensors[f"{prefix}.experts.{j}.down_proj.weight"] for j in range(4)]
            )
    save_file(fused, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_next / "config.json").read_text())
    a, b = load_model(tiny_next, dtype=torch.float32), load_model(tmp_path, dtype=torch.float32)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name
