"""A batch's input file, line by line: the structural checks every line must pass before anything runs.

Each line is a JSON object ``{"custom_id", "method": "POST", "url", "body"}``; ``url`` must be the
batch's endpoint, ``custom_id`` unique, and ``body`` must not ask for a stream, nor for a ``priority``
other than ``batch`` (every line runs at batch priority: one asking for another fails, rather than run
otherwise than it asked). Blank lines are skipped. Line numbers count from 1, as an editor shows them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale.gateway.batches.objects import BatchError
from metrale.shared.messages import Priority

BATCH_PRIORITY = Priority.BATCH.value


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of a batch: where it stands in the file, its ``custom_id`` and its body's JSON."""

    number: int
    custom_id: str
    body_json: str


class LineError(Exception):
    """A line that cannot run; becomes a ``BatchError``."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def read_lines(path: Path, endpoint: str) -> tuple[list[BatchLine], list[BatchError]]:
    """Every line of the file at ``path``, and the errors of those that fail the structural checks."""
    lines: list[BatchLine] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    with path.open("rb") as source:
        for number, raw in enumerate(source, start=1):
            if not raw.strip():
                continue
            try:
                line = parse_line(number, raw, endpoint)
                if line.custom_id in seen:
                    raise LineError("duplicate_custom_id", f"custom_id {line.custom_id!r} appears twice", "custom_id")
            except LineError as error:
                errors.append(BatchError(code=error.code, message=error.message, param=error.param, line=number))
                continue
            seen.add(line.custom_id)
            lines.append(line)
    return lines, errors


def parse_line(number: int, raw: bytes, endpoint: str) -> BatchLine:
    """One line, checked; raises ``LineError``."""
    try:
        value: Any = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LineError("invalid_json_line", f"line {number} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise LineError("invalid_request", f"line {number} is not a JSON object")
    custom_id, method, url, body = (value.get(name) for name in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_required_parameter", "custom_id must be a non-empty string", "custom_id")
    if method != "POST":
        raise LineError("invalid_method", f"method must be POST, got {method!r}", "method")
    if url != endpoint:
        raise LineError("invalid_url", f"url must be the batch's endpoint {endpoint!r}, got {url!r}", "url")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body must be a JSON object", "body")
    if body.get("stream"):
        raise LineError("invalid_request", "a batch line cannot stream: remove 'stream'", "body.stream")
    priority = body.get("priority", BATCH_PRIORITY)
    if priority != BATCH_PRIORITY:
        raise LineError(
            "invalid_request",
            f"a batch line runs at priority {BATCH_PRIORITY!r}, the line asks for {priority!r}: remove 'priority'",
            "body.priority",
        )
    return BatchLine(number, custom_id, json.dumps(body))
