"""lm-evaluation-harness, unchanged: its ``local-completions`` model runs a local multiple-choice task
(loglikelihood: ``/v1/completions`` with ``echo``, ``logprobs`` and token-id prompts) to an ``acc``,
and a ``generate_until`` task, against the server. The tasks are YAML files in ``data/`` over JSONL
beside them; nothing is downloaded (the Hugging Face libraries run offline, see conftest)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lm_eval
import pytest
import yaml

from metrale.worker.model.builtin import builtin_model_dir
from tests.clients.conftest import Server

DATA = Path(__file__).parent / "data"


def task_config(name: str) -> dict[str, Any]:
    """``data/NAME.yaml`` with its data file made absolute (a task's paths are read from the cwd)."""
    config: dict[str, Any] = yaml.safe_load((DATA / f"{name}.yaml").read_text())
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {split: str(DATA / path) for split, path in files.items()}
    return config


def evaluate(server: Server, name: str, monkeypatch: pytest.MonkeyPatch, *, tokenized: bool = True) -> dict[str, Any]:
    """Run task ``name`` through ``local-completions`` against the server; its metrics. ``tokenized``:
    prompts go as token-id lists (lm-eval's default), else as strings."""
    monkeypatch.setenv("OPENAI_API_KEY", server.api_key)  # where local-completions reads its key
    config = task_config(name)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": server.model,
            "base_url": f"{server.v1}/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(builtin_model_dir()),
            "max_retries": 1,
            "num_concurrent": 2,
            "tokenized_requests": tokenized,
        },
        tasks=[config],
        limit=None,
        log_samples=False,
    )
    assert results is not None
    metrics: dict[str, Any] = results["results"][config["task"]]
    return metrics


@pytest.mark.slow
def test_multiple_choice_task_reports_acc(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = evaluate(server, "multiple_choice", monkeypatch)
    acc = metrics["acc,none"]
    assert 0.0 <= acc <= 1.0 and not math.isnan(acc)


@pytest.mark.slow
@pytest.mark.parametrize("tokenized", [True, False], ids=["token_ids", "strings"])
def test_generate_until_task_reports_exact_match(
    server: Server, monkeypatch: pytest.MonkeyPatch, tokenized: bool
) -> None:
    metrics = evaluate(server, "generate", monkeypatch, tokenized=tokenized)
    assert 0.0 <= metrics["exact_match,none"] <= 1.0
