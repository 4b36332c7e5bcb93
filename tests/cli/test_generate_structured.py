"""``met generate --input`` honours ``response_format``: offline batch lines are constrained as online ones."""

from __future__ import annotations

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
