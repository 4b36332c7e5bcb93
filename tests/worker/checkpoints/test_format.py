"""Checkpoint bytes: exact round trip, and every kind of damage or mismatch detected."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from metrale.worker.checkpoints.format import CheckpointMeta, MissReason, decode_checkpoint, encode_checkpoint
from metrale.worker.checkpoints.hashing import CHAIN_BLOCK, PrefixHasher, prefix_hash


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "kda.0.recurrent": torch.randn(2, 4, 4, generator=g),
        "kda.0.conv": torch.randn(12, 3, generator=g).to(torch.bfloat16),
        "mla.1.kv": torch.randn(7, 5, generator=g),
    }


META = CheckpointMeta("f" * 16, "acme", 7, "a" * 32, "float32")


def test_round_trip_is_bit_exact() -> None:
    state = _state()
    decoded = decode_checkpoint(encode_checkpoint(state, META), META)
    assert isinstance(decoded, dict)
    assert decoded.keys() == state.keys()
    assert all(torch.equal(decoded[k], state[k]) and decoded[k].dtype == state[k].dtype for k in state)


@pytest.mark.parametrize("offset", [-1, -200, 60, 9], ids=["last-byte", "tensor-data", "header", "header-start"])
def test_flipped_byte_is_a_checksum_miss(offset: int) -> None:
    data = bytearray(encode_checkpoint(_state(), META))
    data[offset] ^= 0x01
    assert decode_checkpoint(bytes(data), META) is MissReason.CHECKSUM


def test_truncated_or_garbage_is_a_checksum_miss() -> None:
    data = encode_checkpoint(_state(), META)
    assert decode_checkpoint(data[: len(data) // 2], META) is MissReason.CHECKSUM
    assert decode_checkpoint(b"garbage", META) is MissReason.CHECKSUM


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("fingerprint", "0" * 16, MissReason.MODEL_CHANGED),
        ("dtype", "bfloat16", MissReason.MODEL_CHANGED),
        ("tenant", "other", MissReason.TOKEN_MISMATCH),
        ("length", 8, MissReason.TOKEN_MISMATCH),
        ("token_hash", "b" * 32, MissReason.TOKEN_MISMATCH),
    ],
)
def test_identity_mismatch_is_refused(field: str, value: object, reason: MissReason) -> None:
    expected = replace(META, **{field: value})
    assert decode_checkpoint(encode_checkpoint(_state(), META), expected) is reason


def test_prefix_hashes_identify_exact_prefixes() -> None:
    tokens = list(range(1000, 1000 + 3 * CHAIN_BLOCK + 5))
    hasher = PrefixHasher(tokens)
    hashes = [hasher(n) for n in range(len(tokens) + 1)]
    assert len(set(hashes)) == len(hashes)
    assert all(prefix_hash(tokens[:n]) == hashes[n] for n in (0, 1, CHAIN_BLOCK, CHAIN_BLOCK + 1, len(tokens)))
    changed = [*tokens[:10], tokens[10] + 1, *tokens[11:]]
    assert PrefixHasher(changed)(10) == hashes[10]
    assert PrefixHasher(changed)(11) != hashes[11]
