"""``met serve``'s worker threads: every CPU but one by default, so the gateway in the same process
keeps a CPU; ``--threads`` and ``OMP_NUM_THREADS`` decide when given."""

from __future__ import annotations

import pytest

from metrale.cli.serve_cmd import worker_threads


@pytest.mark.parametrize(
    ("requested", "environ", "cpus", "threads"),
    [
        (None, {}, 2, 1),
        (None, {}, 16, 15),
        (None, {}, 1, 1),
        (None, {"OMP_NUM_THREADS": "4"}, 16, None),  # torch's own choice honours it
        (3, {"OMP_NUM_THREADS": "4"}, 16, 3),
        (2, {}, 2, 2),
    ],
)
def test_worker_threads(requested: int | None, environ: dict[str, str], cpus: int, threads: int | None) -> None:
    assert worker_threads(requested, environ, cpus) == threads
