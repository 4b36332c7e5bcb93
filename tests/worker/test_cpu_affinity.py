from __future__ import annotations

import os

import pytest

from metrale.worker.cpu_affinity import parse_cpu_list, pin


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-1,4", {0, 1, 4}), (" 2 , 5-6 ", {2, 5, 6}), ("3-3", {3})],
)
def test_a_linux_cpu_list_is_read(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3-1", "0,,1", "0-1-2", "1.5"])
def test_anything_else_is_refused_saying_how_to_write_it(text: str) -> None:
    with pytest.raises(ValueError, match="CPU"):
        parse_cpu_list(text)


def test_cpus_this_process_cannot_use_are_refused_naming_them() -> None:
    available = os.sched_getaffinity(0)
    absent = max(available) + 100
    with pytest.raises(ValueError, match=f"CPUs {absent} are not available here"):
        pin(frozenset({absent}))
    assert os.sched_getaffinity(0) == available


def test_a_process_started_on_some_cpus_can_move_to_others() -> None:
    available = os.sched_getaffinity(0)
    first, last = min(available), max(available)
    try:
        os.sched_setaffinity(0, {last})
        pin(frozenset({first}))
        assert os.sched_getaffinity(0) == {first}
    finally:
        os.sched_setaffinity(0, available)
