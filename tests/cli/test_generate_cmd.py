"""``met generate``: prompts in, completions out, the JSONL round trip, --ignore-eos, --dtype, --compile,
and clear input errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.text.tokenizer import Tokenizer
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.loader import load_model
from tests.worker.model.helpers import greedy_continuation

runner = CliRunner()


def _run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["generate", *args])
    return result.exit_code, result.output


def test_json_lines_per_prompt_greedy_is_reproducible(tiny_model_dir: Path) -> None:
    args = [
        "--model",
        str(tiny_model_dir),
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--json",
        "Hello",
        "Hi there",
    ]
    code, out = _run(*args)
    assert code == 0, out
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello", "Hi there"]
    for r in records:
        assert set(r) == {"prompt", "text", "token_ids", "finish_reason"}
        assert r["finish_reason"] in {"stop", "length"}
        assert 1 <= len(r["token_ids"]) <= 8
    assert _run(*args) == (code, out)


def test_input_output_jsonl_keeps_order_and_overrides(tiny_model_dir: Path, tmp_path: Path) -> None:
    requests = [
        {"prompt": "one", "max_tokens": 3},
        {"prompt": "two", "max_tokens": 5, "temperature": 0.7, "seed": 4},
        {"prompt": "three"},
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    code, out = _run(
        "--model",
        str(tiny_model_dir),
        "--max-tokens",
        "2",
        "--temperature",
        "0",
        "--input",
        str(source),
        "--output",
        str(target),
    )
    assert code == 0, out
    results = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["prompt"] for r in results] == ["one", "two", "three"]
    lengths = [len(r["token_ids"]) for r in results]
    assert lengths[0] <= 3 and lengths[1] <= 5 and lengths[2] <= 2
    assert any(r["finish_reason"] == "length" for r in results)


def test_bad_jsonl_line_names_the_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    code, out = _run("--model", str(tiny_model_dir), "--input", str(source))
    assert code == 1
    assert out.strip() == f'error: {source}:2: expected an object with a string "prompt"'


def test_no_prompts_is_an_error() -> None:
    code, out = _run()
    assert code == 1 and "no prompts" in out


def _greedy_records(model: Path, *flags: str) -> list[dict[str, object]]:
    code, out = _run("--model", str(model), "--temperature", "0", "--max-tokens", "12", "--json", *flags, "Hello")
    assert code == 0, out
    return [json.loads(line) for line in out.splitlines()]


def test_ignore_eos_generates_exactly_max_tokens_past_eos(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A copy of the model whose EOS is the first token it generates: it stops at once, unless
    --ignore-eos, which gives all 12 tokens — the same ones the original model gives."""
    (reference,) = _greedy_records(tiny_model_dir, "--ignore-eos")
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = [reference["token_ids"][0]]
    (model / "config.json").write_text(json.dumps(config))
    (stopped,) = _greedy_records(model)
    assert stopped["token_ids"] == reference["token_ids"][:1] and stopped["finish_reason"] == "stop"
    (ignored,) = _greedy_records(model, "--ignore-eos")
    assert ignored["token_ids"] == reference["token_ids"] and ignored["finish_reason"] == "length"
    assert len(ignored["token_ids"]) == 12


def test_dtype_bfloat16_runs_the_engine_on_bf16_weights(tiny_model_dir: Path) -> None:
    """``--dtype bfloat16`` end to end: the engine's greedy tokens are the bf16 model's own."""
    (record,) = _greedy_records(tiny_model_dir, "--dtype", "bfloat16", "--ignore-eos")
    prompt = Tokenizer.from_dir(tiny_model_dir).encode("Hello", add_special_tokens=True)
    executor = ModelExecutor(load_model(tiny_model_dir, dtype=torch.bfloat16), num_slots=1, num_blocks=4)
    assert record["token_ids"] == greedy_continuation(executor, prompt, 12)


def test_an_unsupported_dtype_is_a_one_line_error(tiny_model_dir: Path) -> None:
    code, out = _run("--model", str(tiny_model_dir), "--dtype", "float64", "hi")
    assert code == 1
    assert out.strip() == "error: dtype 'float64' is not supported (use one of auto, float32, bfloat16, float16)"


@pytest.mark.slow
def test_compile_decodes_the_eager_tokens(tiny_model_dir: Path) -> None:
    """``--compile`` end to end (every decode bucket compiled at start): the same greedy tokens as without."""
    (eager,) = _greedy_records(tiny_model_dir, "--ignore-eos")
    (compiled,) = _greedy_records(tiny_model_dir, "--ignore-eos", "--compile")
    assert compiled["token_ids"] == eager["token_ids"]


def test_compile_is_refused_off_the_cpu(tiny_model_dir: Path) -> None:
    from metrale.worker.engine.factory import build_engine

    with pytest.raises(ValueError, match="CPU only"):
        build_engine(tiny_model_dir, device="cuda", compile_decode=True)
