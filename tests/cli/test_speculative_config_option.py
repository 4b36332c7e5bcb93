"""``--speculative-config`` on ``met serve``, ``met worker``, ``met fleet up`` and ``met generate``: one
option, checked as it is parsed (a usage error, exit 2, in ``SpeculativeConfig``'s words, before any model
or Redis is touched), and the config it names reaches the worker's engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.worker.engine.speculation import SpeculativeConfig

runner = CliRunner()
NO_REDIS = "redis://127.0.0.1:1/15"
COMMANDS = {
    "serve": ["serve", "--redis", NO_REDIS],
    "worker": ["worker", "--redis", NO_REDIS],
    "fleet-up": ["fleet", "up", "--redis", NO_REDIS],
    "generate": ["generate", "hi"],
}
BAD_CONFIGS = {
    "not-json": ("{method: ngram}", "speculative-config is not JSON"),
    "not-an-object": ('["ngram"]', "speculative-config must be a JSON object"),
    "unknown-key": ('{"method": "ngram", "draft_model_dtype": "x"}', "unknown speculative-config keys"),
    "ngram-with-model": ('{"method": "ngram", "model": "draft"}', "model is the draft_model method's"),
    "no-draft-folder": ('{"model": "/nonexistent/draft"}', "/nonexistent/draft is not a model folder"),
    "no-method": ('{"num_speculative_tokens": 4}', "speculative-config needs a method"),
    "unserved-method": ('{"method": "eagle"}', "speculative method 'eagle' is not served"),
    "zero-tokens": ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be >= 1"),
    "string-tokens": ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer"),
    "min-above-max": ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "1 <= min <= max"),
}


def _one_line(output: str) -> str:
    """The CLI's boxed usage error, its lines joined (rich wraps it to the terminal's width)."""
    return " ".join(line.strip(" │╭╮╰╯─") for line in output.splitlines())


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
@pytest.mark.parametrize(("config", "says"), BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_a_config_it_cannot_serve_is_a_usage_error(command: list[str], config: str, says: str) -> None:
    result = runner.invoke(app, [*command, "--speculative-config", config])
    assert result.exit_code == 2, result.output
    text = " ".join(_one_line(result.output).split())
    assert "Invalid value for '--speculative-config'" in text
    assert says in text


class _Built(Exception):
    """Raised by the recording ``build_worker`` once it has seen its arguments: the command stops there."""


@pytest.mark.parametrize("command", ["serve", "worker"])
@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ([], None),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'],
            SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2),
        ),
        (
            ["--speculative-config", '{"model": "TINY", "num_speculative_tokens": 2}'],
            SpeculativeConfig("draft_model", 2, model="TINY"),
        ),
    ],
    ids=["off-by-default", "ngram", "draft-model"],
)
def test_the_config_reaches_the_workers_engine(
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    command: str,
    flag: list[str],
    expected: SpeculativeConfig | None,
) -> None:
    seen: dict[str, Any] = {}
    flag = [part.replace("TINY", str(tiny_model_dir)) for part in flag]
    if expected is not None and expected.model is not None:  # the draft model's folder: a real one
        expected = SpeculativeConfig("draft_model", expected.num_speculative_tokens, model=str(tiny_model_dir))

    def recording_build_worker(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Built

    monkeypatch.setattr("metrale.worker.fleet.assembly.build_worker", recording_build_worker)
    monkeypatch.setattr("metrale.cli.serve_cmd.worker_threads", lambda *args: None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # met worker leaves this process's torch threads alone
    result = runner.invoke(app, [*COMMANDS[command], "--model", str(tiny_model_dir), *flag])
    assert isinstance(result.exception, _Built), result.output
    assert seen["speculation"] == expected
