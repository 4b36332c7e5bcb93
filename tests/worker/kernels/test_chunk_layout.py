from __future__ import annotations

import pytest
import torch

from metrale.worker.kernels.kda.chunk_layout import ChunkLayout


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


CASES = [
    pytest.param([5], 4, id="one-sequence"),
    pytest.param([3, 9, 1, 8], 4, id="mixed-lengths"),
    pytest.param([8, 8, 8], 8, id="equal-full-chunks"),
    pytest.param([1, 1], 16, id="single-tokens"),
]


@pytest.mark.parametrize(("lengths", "chunk"), CASES)
def test_each_step_is_one_contiguous_run_of_the_sequences_still_running(lengths: list[int], chunk: int) -> None:
    layout = ChunkLayout.build(_cu_seqlens(lengths), chunk)

    chunks_of = [-(-n // chunk) for n in lengths]
    sorted_chunks = [chunks_of[s] for s in layout.order.tolist()]
    assert sorted_chunks == sorted(chunks_of, reverse=True)
    expected_first = 0
    for step, (first, count) in enumerate(layout.steps):
        assert first == expected_first
        assert count == sum(n > step for n in chunks_of)
        expected_first += count
    assert layout.num_chunks == sum(chunks_of) == expected_first


@pytest.mark.parametrize(("lengths", "chunk"), CASES)
def test_position_p_of_a_sequence_sits_in_its_chunk_of_step_p_over_chunk(lengths: list[int], chunk: int) -> None:
    layout = ChunkLayout.build(_cu_seqlens(lengths), chunk)
    rank = {sequence: r for r, sequence in enumerate(layout.order.tolist())}
    step_first = [first for first, _ in layout.steps]

    expected = [
        (step_first[p // chunk] + rank[s]) * chunk + p % chunk
        for s, length in enumerate(lengths)
        for p in range(length)
    ]
    assert layout.row_positions.tolist() == expected


@pytest.mark.parametrize(("lengths", "chunk"), CASES)
def test_rows_round_trip_through_chunks_with_zero_padding(lengths: list[int], chunk: int) -> None:
    layout = ChunkLayout.build(_cu_seqlens(lengths), chunk)
    rows = torch.randn(sum(lengths), 2, 3, generator=torch.Generator().manual_seed(0))

    chunks = layout.to_chunks(rows)

    assert chunks.shape == (layout.num_chunks, 2, chunk, 3)
    assert torch.equal(layout.to_rows(chunks), rows)
    padding = torch.ones(layout.num_chunks * chunk, dtype=torch.bool)
    padding[layout.row_positions] = False
    flat = chunks.transpose(1, 2).flatten(0, 1)
    assert int(padding.sum()) == layout.num_chunks * chunk - sum(lengths)
    assert torch.equal(flat[padding], torch.zeros_like(flat[padding]))
