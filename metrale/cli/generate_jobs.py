"""Offline generation jobs: prompts from the command line or a JSONL file, results as text or JSONL."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from metrale.text.tokenizer import Tokenizer
from metrale.worker.engine.request import GenerationResult
from metrale.worker.engine.sampling_params import SamplingParams

_OVERRIDES = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}


class JobFileError(ValueError):
    """A JSONL input line that cannot be run; the message names the file and line."""


@dataclass(frozen=True)
class GenerateJob:
    """One prompt to complete, with its sampling settings and stop strings."""

    prompt: str
    params: SamplingParams
    stop: tuple[str, ...] = ()


BATCH_LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})
"""The keys of an OpenAI batch line; a prompt line has none of them."""


def line_format(path: Path) -> Literal["prompts", "batch"]:
    """Which format the file's lines are in: ``{"prompt", ...}`` or OpenAI batch requests. A file holds
    one format; a mixed one raises ``JobFileError`` naming a line of each. Lines that are not JSON are
    left to the reader of the format to report."""
    first: dict[str, int] = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            try:
                record = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                continue
            if record is not None:
                batch = isinstance(record, dict) and not BATCH_LINE_KEYS.isdisjoint(record)
                first.setdefault("batch" if batch else "prompts", number)
    if len(first) > 1:
        raise JobFileError(
            f"{path} mixes two line formats: line {first['batch']} is a batch request "
            f'({{"custom_id", "method", "url", "body"}}), line {first["prompts"]} a prompt ({{"prompt", ...}}); '
            "use one format per file"
        )
    return "batch" if "batch" in first else "prompts"


def jobs_from_file(path: Path, defaults: SamplingParams) -> list[GenerateJob]:
    """One job per non-blank line of ``path``: ``{"prompt": ..., optional overrides and "stop"}``."""
    jobs = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                jobs.append(_job_from_record(line, defaults, f"{path}:{number}"))
    if not jobs:
        raise JobFileError(f"{path}: no requests in the file")
    return jobs


def _job_from_record(line: str, defaults: SamplingParams, where: str) -> GenerateJob:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise JobFileError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise JobFileError(f'{where}: expected an object with a string "prompt"')
    overrides: dict[str, Any] = {}
    for key, kind in _OVERRIDES.items():
        if record.get(key) is not None:
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
                raise JobFileError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}")
            overrides[key] = kind(value)
    stop = record.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise JobFileError(f'{where}: "stop" must be a string or a list of non-empty strings')
    try:
        params = replace(defaults, **overrides)
    except ValueError as exc:
        raise JobFileError(f"{where}: {exc}") from None
    return GenerateJob(record["prompt"], params, tuple(stop))


def encode_job(tokenizer: Tokenizer, job: GenerateJob, chat: bool) -> list[int]:
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": job.prompt}])
    return tokenizer.encode(job.prompt, add_special_tokens=True)


def result_record(tokenizer: Tokenizer, job: GenerateJob, result: GenerationResult) -> dict[str, Any]:
    """The output record of one job: its first completion, cut at the first stop string."""
    completion = result.completions[0]
    text = tokenizer.decode(completion.token_ids)
    finish_reason = str(completion.finish_reason)
    cut = min((i for i in (text.find(s) for s in job.stop) if i >= 0), default=-1)
    if cut >= 0:
        text, finish_reason = text[:cut], "stop"
    return {
        "prompt": job.prompt,
        "text": text,
        "token_ids": completion.token_ids,
        "finish_reason": finish_reason,
    }
