"""Memory sizes and token counts as typed on the command line."""

from __future__ import annotations

import pytest

from metrale.cli.units import UnitError, parse_bytes, parse_tokens


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("141GB", 141 * 10**9),
        ("141GiB", 141 * 2**30),
        ("80G", 80 * 10**9),
        ("80gi", 80 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5TB", 15 * 10**11),
        ("4096", 4096),
        (" 24 GB ", 24 * 10**9),
    ],
)
def test_memory_sizes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"), [("32k", 32768), ("128K", 131072), ("1M", 1048576), ("4096", 4096), ("0.5k", 512)]
)
def test_token_counts(text: str, expected: int) -> None:
    assert parse_tokens(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "12 XB", "-3GB", "1e9"])
def test_unreadable_memory_sizes_say_what_is_accepted(text: str) -> None:
    with pytest.raises(UnitError, match="examples: 141GB"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["", "32kB", "1G", "0"])
def test_unreadable_token_counts_are_refused(text: str) -> None:
    with pytest.raises(UnitError):
        parse_tokens(text)
