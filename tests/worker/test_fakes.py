"""The recording fake detects what it is there to detect: a state fed out of order, restored into
the wrong place, or continued with the wrong KV blocks."""

from __future__ import annotations

import torch

from metrale.worker.model.interface import ForwardChunk
from tests.worker.fakes import GARBAGE, RecordingModel


def argmax(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


def make_model() -> RecordingModel:
    model = RecordingModel(num_slots=2, num_blocks=8, block_size=2)
    model.register("a", (1, 2, 3))
    model.register("b", (7, 8))
    return model


def test_clean_logits_depend_only_on_the_tokens_consumed() -> None:
    one, other = make_model(), make_model()
    one.forward([ForwardChunk(0, (0, 1), 0, (1, 2))])
    split = argmax(one.forward([ForwardChunk(0, (0, 1), 2, (3,))]))
    whole = argmax(other.forward([ForwardChunk(1, (5, 6), 0, (1, 2, 3))]))
    assert split == whole and GARBAGE not in whole


def test_a_chunk_at_the_wrong_position_corrupts_the_slot_until_a_fresh_start() -> None:
    model = make_model()
    model.forward([ForwardChunk(0, (0, 1), 0, (1, 2))])
    assert argmax(model.forward([ForwardChunk(0, (0, 1), 1, (2,))])) == [GARBAGE]  # re-run position 1
    assert argmax(model.forward([ForwardChunk(0, (0, 1, 2), 3, (9,))])) == [GARBAGE]
    assert argmax(model.forward([ForwardChunk(0, (0, 1), 0, (1, 2))])) != [GARBAGE]


def test_wrong_kv_blocks_corrupt_the_slot() -> None:
    model = make_model()
    model.forward([ForwardChunk(0, (0, 1), 0, (1, 2, 3))])
    assert argmax(model.forward([ForwardChunk(0, (4, 5), 3, (9,))])) == [GARBAGE]


def test_export_import_moves_the_state_by_content() -> None:
    model = make_model()
    model.forward([ForwardChunk(0, (0, 1), 0, (1, 2, 3))])
    state = model.export_state(0, (0, 1), 3)
    assert sum(t.numel() * t.element_size() for t in state.values()) == model.state_nbytes(3)
    model.forward([ForwardChunk(0, (0, 1), 0, (7, 8))])  # slot 0 and its blocks now hold b
    model.import_state(state, 1, (6, 7))
    resumed = argmax(model.forward([ForwardChunk(1, (6, 7, 5), 3, (4,))]))
    straight = argmax(make_model().forward([ForwardChunk(0, (0, 1, 2), 0, (1, 2, 3, 4))]))
    assert resumed == straight != [GARBAGE]
    assert model.forwards[-1][0].owner == "a"


def test_exporting_at_the_wrong_length_yields_a_corrupted_state() -> None:
    model = make_model()
    model.forward([ForwardChunk(0, (0, 1), 0, (1, 2, 3))])
    model.import_state(model.export_state(0, (0, 1), 2), 1, (4, 5))
    assert argmax(model.forward([ForwardChunk(1, (4, 5), 2, (3,))])) == [GARBAGE]


def test_records_name_the_request_the_slot_holds() -> None:
    model = make_model()
    model.forward([ForwardChunk(0, (0, 1), 0, (1, 2)), ForwardChunk(1, (2, 3), 0, (7, 8))])
    model.forward([ForwardChunk(0, (0, 1), 0, (5,))])
    assert [(r.slot, r.start, r.length, r.owner) for f in model.forwards for r in f] == [
        (0, 0, 2, "a"),
        (1, 0, 2, "b"),
        (0, 0, 1, None),
    ]
