"""``met generate --input`` with OpenAI batch lines: the output lines of ``POST /v1/batches``, made
offline; one format per file; bad lines named before anything runs. (Equal to the online batch's
answers: ``tests/integration/test_batch_cli.py``.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from metrale.cli.main import app

runner = CliRunner()


def line(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "any", **body}}


def generate(model: Path, source: Path, *extra: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["generate", "--model", str(model), "--input", str(source), *extra])
    return result.exit_code, result.stdout, result.stderr


def write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_completions_lines_come_back_as_the_endpoint_answers(tiny_model_dir: Path, tmp_path: Path) -> None:
    url = "/v1/completions"
    lines = [
        line("greedy", url, prompt="def f(x):", max_tokens=6, temperature=0, ignore_eos=True),
        line("two", url, prompt="import os", max_tokens=4, n=2, seed=7, logprobs=2, ignore_eos=True),
        line("ids", url, prompt=[5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True),
    ]
    target = tmp_path / "out.jsonl"
    code, _, err = generate(tiny_model_dir, write(tmp_path / "in.jsonl", lines), "--output", str(target))
    assert code == 0, err
    answers = [json.loads(text) for text in target.read_text().splitlines()]
    assert [a["custom_id"] for a in answers] == ["greedy", "two", "ids"]
    for answer in answers:
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        assert answer["response"]["request_id"] == answer["response"]["body"]["id"]
        assert answer["response"]["body"]["object"] == "text_completion"
    greedy, two, ids = (a["response"]["body"] for a in answers)
    assert greedy["usage"]["completion_tokens"] == 6 and greedy["choices"][0]["finish_reason"] == "length"
    assert greedy["model"] == "any" and greedy["system_fingerprint"].startswith("met-")
    assert [c["index"] for c in two["choices"]] == [0, 1] and two["usage"]["completion_tokens"] == 8
    assert len(two["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
    assert ids["usage"]["prompt_tokens"] == 3
    again = generate(tiny_model_dir, tmp_path / "in.jsonl")
    assert [json.loads(t)["response"]["body"]["choices"] for t in again[1].splitlines()] == [
        a["response"]["body"]["choices"] for a in answers
    ]  # greedy and seeded: the same again


def test_an_echo_line_gets_its_prompts_logprobs_offline(tiny_model_dir: Path, tmp_path: Path) -> None:
    url = "/v1/completions"
    lines = [line("echo", url, prompt=[5, 6, 7, 8], echo=True, logprobs=1, max_tokens=0, prompt_logprobs=2)]
    target = tmp_path / "out.jsonl"
    code, _, err = generate(tiny_model_dir, write(tmp_path / "in.jsonl", lines), "--output", str(target))
    assert code == 0, err
    (choice,) = json.loads(target.read_text())["response"]["body"]["choices"]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert logprobs[0] is None and len(logprobs) == 4 and all(lp < 0 for lp in logprobs[1:])
    assert choice["finish_reason"] == "length" and choice["prompt_logprobs"][0] is None
    assert [entry["8"]["logprob"] for entry in choice["prompt_logprobs"][3:]] == logprobs[3:]


def test_chat_lines_are_rendered_with_the_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    source = write(tmp_path / "in.jsonl", [line("c", "/v1/chat/completions", messages=messages, max_tokens=5, seed=1)])
    code, out, err = generate(tiny_model_dir, source)
    assert code == 0, err
    body = json.loads(out)["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["prompt_tokens"] > 3


def test_a_file_mixing_formats_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    source = write(tmp_path / "in.jsonl", [line("a", "/v1/completions", prompt="x"), {"prompt": "y"}])
    code, _, err = generate(tiny_model_dir, source)
    assert code == 1
    assert f"{source} mixes two line formats: line 1 is a batch request" in err and "line 2 a prompt" in err


def test_bad_lines_are_named_and_nothing_runs(tiny_model_dir: Path, tmp_path: Path) -> None:
    url = "/v1/completions"
    records = [
        line("a", url, prompt="x", max_tokens=2),
        line("a", url, prompt="y", max_tokens=2),
        line("b", "/v1/chat/completions", messages=[]),
        line("c", url, prompt="z", temperature=-1),
        line("d", url, prompt="z", stream=True),
        '{"custom_id": ',
    ]
    target = tmp_path / "out.jsonl"
    code, _, err = generate(tiny_model_dir, write(tmp_path / "in.jsonl", records), "--output", str(target))
    assert code == 1 and not target.exists()
    assert err.startswith("error: 5 bad lines, nothing was run:")
    for number, code_name in [
        (2, "duplicate_custom_id"),
        (3, "invalid_url"),
        (4, "invalid_request"),
        (6, "invalid_json_line"),
    ]:
        assert f"{source_name(tmp_path)}:{number}: {code_name}: " in err
    assert "temperature must be finite" in err


def source_name(tmp_path: Path) -> str:
    return str(tmp_path / "in.jsonl")


def test_a_line_asking_for_interactive_priority_is_named_and_nothing_runs(tiny_model_dir: Path, tmp_path: Path) -> None:
    url = "/v1/completions"
    records = [
        line("a", url, prompt="x", max_tokens=2, priority="batch"),
        line("b", url, prompt="y", max_tokens=2, priority="interactive"),
    ]
    target = tmp_path / "out.jsonl"
    code, _, err = generate(tiny_model_dir, write(tmp_path / "in.jsonl", records), "--output", str(target))
    assert code == 1 and not target.exists()
    assert err.startswith("error: 1 bad lines, nothing was run:")
    assert f"{source_name(tmp_path)}:2: invalid_request: " in err
    assert "priority 'batch', the line asks for 'interactive'" in err
