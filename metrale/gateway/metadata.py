"""OpenAI's limits on the ``metadata`` an object carries (responses, batches): at most 16 pairs, keys
of at most 64 characters, string values of at most 512 — checked at the edge, before anything is kept."""

from __future__ import annotations

from collections.abc import Mapping

from metrale.shared.errors import BadRequest

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def check_metadata(metadata: Mapping[str, object] | None, param: str = "metadata") -> None:
    """Raise a 400 naming the limit if ``metadata`` breaks one of OpenAI's."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise BadRequest(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}.", param=param)
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise BadRequest(
                f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters, got one of {len(key)}.", param=param
            )
        if not isinstance(value, str):
            raise BadRequest(f"metadata values must be strings; {key!r} is not.", param=f"{param}.{key}")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise BadRequest(
                f"metadata values are at most {MAX_METADATA_VALUE_CHARS} characters; {key!r} has {len(value)}.",
                param=f"{param}.{key}",
            )
