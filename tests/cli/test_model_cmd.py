"""``met model`` and the one-line errors every command gives for a bad checkpoint."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from metrale.cli.main import app

runner = CliRunner()
RELEASE_CONFIG = Path(__file__).parents[1] / "worker" / "model" / "data" / "kimi-linear-48b-a3b-instruct.config.json"


def _copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target)
    return target


def test_init_tiny_is_deterministic_and_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    for name in ("a", "b"):
        result = runner.invoke(app, ["model", "init-tiny", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
    for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    kinds = {type(layer.self_attn).__name__ for layer in hf.model.layers}
    mlps = {type(layer.mlp).__name__ for layer in hf.model.layers}
    assert kinds == {"KimiLinearAttention", "KimiLinearDeltaAttention"}
    assert "KimiLinearMoE" in mlps
    assert hf(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, hf.config.vocab_size)


def test_inspect_reports_params_and_state_bytes(tiny_model_dir: Path) -> None:
    result = runner.invoke(app, ["model", "inspect", str(tiny_model_dir)])
    assert result.exit_code == 0, result.output
    assert "kda/dense kda/moe mla/moe kda/moe" in result.output
    # 3 KDA layers × (2 heads × 32 × 32 fp32 + 3·64 channels × 3 conv taps fp32); 1 MLA layer × (32 + 8) fp32.
    assert f"{3 * (2 * 32 * 32 * 4 + 3 * 64 * 3 * 4):,} bytes" in result.output
    assert f"{(32 + 8) * 4:,} bytes" in result.output


def test_inspect_sizes_the_release_from_its_config_alone(tmp_path: Path) -> None:
    """A folder with nothing but the release's config.json: parameters, state bytes, and how many 32k
    sequences fit on a 141 GB GPU beside the bf16 weights."""
    if not RELEASE_CONFIG.is_file():
        pytest.skip(f"{RELEASE_CONFIG} is not on this machine")
    (tmp_path / "config.json").write_text(RELEASE_CONFIG.read_text())
    result = runner.invoke(app, ["model", "inspect", str(tmp_path), "--memory", "141GB", "--context", "32k"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "(49.1B)" in out and "(3.5B;" in out
    assert "44,892,160 bytes" in out  # 20 KDA layers × (32·128·128 + 3·4096·3) fp32
    assert "8,064 bytes" in out  # 7 MLA layers × (512 + 64) bf16
    assert "sequences │ 138 (" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--memory", "lots"], "cannot read the memory size 'lots'"), (["--dtype", "int4"], "dtype 'int4' is not")],
    ids=["memory", "dtype"],
)
def test_inspect_bad_option_is_a_one_line_error(tiny_model_dir: Path, flags: list[str], message: str) -> None:
    result = runner.invoke(app, ["model", "inspect", str(tiny_model_dir), *flags])
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and len(result.output.strip().splitlines()) == 1
    assert message in result.output


def _drop_tensor(model: Path) -> str:
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    save_file(tensors, model / "model.safetensors")
    return "missing tensor 'layers.2.self_attn.kv_b_proj.weight'"


def _wrong_shape(model: Path) -> str:
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, model / "model.safetensors")
    return "tensor 'model.layers.0.self_attn.q_proj.weight' in model.safetensors has shape [3, 3], expected [64, 64]"


def _extra_tensor(model: Path) -> str:
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.0.surprise"] = torch.zeros(2)
    save_file(tensors, model / "model.safetensors")
    return "unexpected tensor 'model.layers.0.surprise' in model.safetensors"


def _corrupt_file(model: Path) -> str:
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    return "model.safetensors: not a valid safetensors file"


def _unknown_architecture(model: Path) -> str:
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "llama"
    (model / "config.json").write_text(json.dumps(config))
    return "model_type 'llama' is not supported"


def _unsupported_value(model: Path) -> str:
    config = json.loads((model / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (model / "config.json").write_text(json.dumps(config))
    return "hidden_act='gelu' is not supported"


BREAKAGES: dict[str, Callable[[Path], str]] = {
    "missing-tensor": _drop_tensor,
    "wrong-shape": _wrong_shape,
    "extra-tensor": _extra_tensor,
    "corrupt-safetensors": _corrupt_file,
    "unknown-architecture": _unknown_architecture,
    "unsupported-value": _unsupported_value,
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_bad_checkpoint_is_a_one_line_error(tiny_model_dir: Path, tmp_path: Path, breakage: str) -> None:
    model = _copy(tiny_model_dir, tmp_path)
    expected = BREAKAGES[breakage](model)
    result = runner.invoke(app, ["generate", "--model", str(model), "--max-tokens", "2", "hi"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert expected in " ".join(lines), result.output
    assert "Traceback" not in result.output


def test_sharded_checkpoint_loads_like_single_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    from metrale.worker.model.loader import load_model

    model = _copy(tiny_model_dir, tmp_path)
    tensors = load_file(model / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, model / file)
    (model / "model.safetensors").unlink()
    weight_map = {n: file for file, part in shards.items() for n in part}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded, single = load_model(model).state_dict(), load_model(tiny_model_dir).state_dict()
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


RELEASE_FILES = [
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tiktoken.model",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def release_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("release") / "model"
    result = runner.invoke(app, ["model", "init-tiny", str(directory), "--layout", "release"])
    assert result.exit_code == 0, result.output
    return directory


def test_init_tiny_release_layout_writes_the_release_files_deterministically(
    release_model_dir: Path, tmp_path: Path
) -> None:
    result = runner.invoke(app, ["model", "init-tiny", str(tmp_path / "again"), "--layout", "release"])
    assert result.exit_code == 0, result.output
    assert "release layout" in result.output
    assert sorted(path.name for path in release_model_dir.iterdir()) == RELEASE_FILES
    for file in RELEASE_FILES:
        assert (tmp_path / "again" / file).read_bytes() == (release_model_dir / file).read_bytes(), file


def test_a_release_shaped_folder_inspects_and_generates(release_model_dir: Path) -> None:
    result = runner.invoke(app, ["model", "inspect", str(release_model_dir)])
    assert result.exit_code == 0, result.output
    assert "kda/dense kda/moe kda/moe mla/moe" in result.output
    args = ["generate", "--model", str(release_model_dir), "--max-tokens", "3", "--temperature", "0", "--json"]
    result = runner.invoke(app, [*args, "--chat", "你好, it's me"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.output)["token_ids"]) == 3


def _edit_tokenizer_config(model: Path, change: Callable[[dict[str, object]], None]) -> None:
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def _unknown_tiktoken_class(model: Path) -> str:
    def change(config: dict[str, object]) -> None:
        config["auto_map"] = {"AutoTokenizer": ["tokenization_other.OtherTokenizer", None]}

    _edit_tokenizer_config(model, change)
    return f"{model / 'tokenizer_config.json'}: names tiktoken tokenizer class 'tokenization_other.OtherTokenizer'"


def _special_id_in_base_vocab(model: Path) -> str:
    def change(config: dict[str, object]) -> None:
        added = config["added_tokens_decoder"]
        assert isinstance(added, dict)
        added["7"] = {"content": "<|im_user|>", "special": True}

    _edit_tokenizer_config(model, change)
    return f"{model / 'tokenizer_config.json'}: added_tokens_decoder id 7 ('<|im_user|>') collides with the base"


def _missing_shard(model: Path) -> str:
    (model / "model-00002-of-00002.safetensors").unlink()
    return f"{model / 'model-00002-of-00002.safetensors'}: shard named in model.safetensors.index.json does not exist"


RELEASE_BREAKAGES: dict[str, tuple[Callable[[Path], str], list[str]]] = {
    "unknown-tiktoken-class": (_unknown_tiktoken_class, ["generate"]),
    "special-id-in-base-vocab": (_special_id_in_base_vocab, ["generate"]),
    "missing-shard": (_missing_shard, ["generate", "inspect"]),
}


@pytest.mark.parametrize(
    ("breakage", "command"),
    [(name, command) for name, (_, commands) in sorted(RELEASE_BREAKAGES.items()) for command in commands],
)
def test_bad_release_folder_is_a_one_line_error_naming_the_file(
    release_model_dir: Path, tmp_path: Path, breakage: str, command: str
) -> None:
    model = Path(shutil.copytree(release_model_dir, tmp_path / "model"))
    expected = RELEASE_BREAKAGES[breakage][0](model)
    args = ["model", "inspect", str(model)] if command == "inspect" else ["generate", "--model", str(model), "hi"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert expected in lines[0], result.output
