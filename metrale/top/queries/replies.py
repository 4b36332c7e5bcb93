"""Small helpers for Redis replies read by the queries."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def text(value: bytes | str | None) -> str | None:
    """A reply as text (None stays None)."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


def int_fields(raw: Mapping[Any, Any] | Exception | None) -> dict[str, int]:
    """A counters hash as ``name -> int`` (fields that are not integers are left out)."""
    if not isinstance(raw, Mapping):
        return {}
    fields = {}
    for name, value in raw.items():
        try:
            fields[str(text(name))] = int(value)
        except (TypeError, ValueError):
            continue
    return fields


def as_float(value: bytes | str | None, default: float = 0.0) -> float:
    try:
        return float(value) if value is not None else default
    except ValueError:
        return default


def as_int(value: Any, default: int = 0) -> int:
    if isinstance(value, Exception) or value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default
