"""``met generate``: prompts in, completions out, the JSONL round trip, and clear input errors."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from metrale.cli.main import app

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
