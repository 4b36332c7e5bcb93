"""``met generate --speculative-config``: the same completions as without it (greedy and seeded), and a
config it does not serve refused as a usage error before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from metrale.cli.main import app

runner = CliRunner()
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
PROMPTS = ["def f(x): return x + 1\ndef f(x): return x + 1\ndef f(", "one two three one two three one two"]


def _completions(model: Path, *extra: str) -> list[dict[str, object]]:
    result = runner.invoke(app, ["generate", "--model", str(model), "--max-tokens", "12", "--json", *extra, *PROMPTS])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("sampling", [["--temperature", "0"], ["--temperature", "0.8", "--seed", "5"]])
def test_speculation_changes_no_completion(tiny_model_dir: Path, sampling: list[str], method: str) -> None:
    """The n-gram method, and a draft model (the tiny model drafting for itself)."""
    config = NGRAM if method == "ngram" else json.dumps({"model": str(tiny_model_dir), "num_speculative_tokens": 4})
    plain = _completions(tiny_model_dir, *sampling)
    assert _completions(tiny_model_dir, *sampling, "--speculative-config", config) == plain


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from metrale.worker.model.families.qwen3_5_tiny import write_tiny_qwen3_5

    draft = write_tiny_qwen3_5(tmp_path / "qwen")
    config = json.dumps({"model": str(draft)})
    result = runner.invoke(app, ["generate", "--model", str(tiny_model_dir), "--speculative-config", config, "hi"])
    assert result.exit_code != 0
    assert "has another tokenizer than the target's" in " ".join(result.output.split())


def test_an_unserved_config_is_a_usage_error(tiny_model_dir: Path) -> None:
    """Every command's refusals are in ``test_speculative_config_option.py``; here, that generate has the option."""
    config = '{"method": "medusa"}'
    result = runner.invoke(app, ["generate", "--model", str(tiny_model_dir), "--speculative-config", config, "hi"])
    assert result.exit_code == 2
    assert "Invalid value for '--speculative-config'" in result.output


def test_compile_with_speculation_is_refused_before_compiling(tiny_model_dir: Path) -> None:
    """The compiled decode step and the eager verify step differ in their logits' last bits: mixed, they would
    change answers, so the pair is refused with the reason (and nothing is compiled first)."""
    args = ["generate", "--model", str(tiny_model_dir), "--compile", "--speculative-config", NGRAM, "hi"]
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert "--compile and --speculative-config cannot be combined" in result.output
