from __future__ import annotations

import os
from pathlib import Path

import pytest

from metrale.worker.cpu_affinity import cgroup_cpu_quota, parse_cpu_list, pin, usable_cpus


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


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_no_quota_anywhere_is_none(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "max 100000\n")
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path, "1:cpu:/\n0::/\n") is None


def test_a_v2_quota_in_a_container_is_read_at_its_root(tmp_path: Path) -> None:
    """In a container the cgroup namespace makes its own cgroup the root: ``0::/``."""
    write(tmp_path / "cpu.max", "250000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/\n") == 2.5


def test_the_smallest_v2_quota_on_the_way_to_the_root_holds(tmp_path: Path) -> None:
    """On a host, the process's own cgroup and every parent may cap it."""
    write(tmp_path / "system.slice" / "cpu.max", "300000 100000\n")
    write(tmp_path / "system.slice" / "docker-1.scope" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/system.slice/docker-1.scope\n") == 3.0
    write(tmp_path / "system.slice" / "docker-1.scope" / "cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/system.slice/docker-1.scope\n") == 1.5


def test_a_v1_quota_is_read_from_the_cpu_controller(tmp_path: Path) -> None:
    """cgroup v1 without a namespace: the path names the host's cgroup, which the container's mount
    does not have; its own quota sits at the mount's root."""
    write(tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us", "200000\n")
    write(tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    membership = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"
    assert cgroup_cpu_quota(tmp_path, membership) == 2.0


def test_unreadable_or_odd_files_mean_no_quota(tmp_path: Path) -> None:
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "garbage\n")
    assert cgroup_cpu_quota(tmp_path, "3:cpu:/\n") is None
    write(tmp_path / "cpu.max", "garbage 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/\n") is None
    assert cgroup_cpu_quota(tmp_path / "absent", "0::/a/b\n") is None


@pytest.mark.parametrize(("quota", "expected"), [("max 100000", None), ("50000 100000", 1), ("150000 100000", 1)])
def test_torch_threads_are_the_cpus_capped_by_the_quota_rounded_down(
    tmp_path: Path, quota: str, expected: int | None
) -> None:
    write(tmp_path / "cgroup" / "cpu.max", quota)
    write(tmp_path / "self-cgroup", "0::/\n")
    cpus = len(os.sched_getaffinity(0))
    threads = usable_cpus(tmp_path / "cgroup", tmp_path / "self-cgroup")
    assert threads == (cpus if expected is None else min(cpus, expected))


def test_without_proc_cgroup_every_cpu_is_usable(tmp_path: Path) -> None:
    assert usable_cpus(tmp_path, tmp_path / "absent") == len(os.sched_getaffinity(0))
