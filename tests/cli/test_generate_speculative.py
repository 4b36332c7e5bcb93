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


@pytest.mark.parametrize("sampling", [["--temperature", "0"], ["--temperature", "0.8", "--seed", "5"]])
def test_speculation_changes_no_completion(tiny_model_dir: Path, sampling: list[str]) -> None:
    plain = _completions(tiny_model_dir, *sampling)
    assert _completions(tiny_model_dir, *sampling, "--speculative-config", NGRAM) == plain


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
