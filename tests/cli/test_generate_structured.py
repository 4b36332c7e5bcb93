"""``met generate --input`` honours ``response_format``: offline batch lines are constrained as online ones."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema

from tests.cli.test_generate_batch import generate, line, write

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def test_offline_lines_with_a_json_schema_answer_valid_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    lines = [
        line(
            f"q{i}",
            "/v1/chat/completions",
            messages=[{"role": "user", "content": f"item {i}"}],
            seed=i,
            max_tokens=48,
            response_format=response_format,
        )
        for i in range(4)
    ]
    target = tmp_path / "out.jsonl"
    code, _, err = generate(tiny_model_dir, write(tmp_path / "in.jsonl", lines), "-o", str(target))
    assert code == 0, err
    for answer in map(json.loads, target.read_text().splitlines()):
        (choice,) = answer["response"]["body"]["choices"]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_an_offline_line_whose_grammar_reaches_a_dead_end_is_answered_400(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The worker's backstop offline: a line whose grammar the static check let through but that
    allows no token (here put in after the check) is a 400 line, never a ``stop`` answer."""
    from metrale.cli.offline_batch import read_batch_file, run_batch_file, served_model
    from metrale.text.grammars import json_schema_grammar
    from metrale.worker.engine.factory import build_engine

    loaded = build_engine(tiny_model_dir)
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    records = [
        line(f"q{i}", "/v1/completions", prompt="x", max_tokens=16, response_format=response_format) for i in (0, 1)
    ]
    ready = read_batch_file(write(tmp_path / "in.jsonl", records), served_model(loaded, "tiny"))
    cycle = json_schema_grammar(
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    )
    request = dataclasses.replace(ready[1].prepared.submission.request, grammar=cycle)
    ready[1] = dataclasses.replace(
        ready[1],
        prepared=dataclasses.replace(
            ready[1].prepared, submission=dataclasses.replace(ready[1].prepared.submission, request=request)
        ),
    )
    good, dead = map(json.loads, run_batch_file(loaded, ready, seed=0))
    assert good["response"]["status_code"] == 200
    assert dead["response"]["status_code"] == 400
    message = dead["response"]["body"]["error"]["message"]
    assert message.startswith("The worker refused the request: the constrained output reached a dead end")
