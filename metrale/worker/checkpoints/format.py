"""A checkpoint on the wire and on disk: safetensors bytes with metadata and a checksum.

The metadata names the model (fingerprint), the tenant, the number of tokens consumed, the hash of
exactly those tokens, and the dtype; the checksum covers the metadata and every tensor's bytes. Any
mismatch or damage makes :func:`decode_checkpoint` return a :class:`MissReason`, never a state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import StrEnum

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from metrale.worker.model.interface import SequenceState

FORMAT = "metrale-checkpoint-1"


class MissReason(StrEnum):
    """Why a lookup did not resume from a checkpoint (Prometheus label values)."""

    NONE = "none"  # nothing stored for any candidate prefix
    TOKEN_MISMATCH = "token_mismatch"  # stored for other tokens than this prompt's
    CHECKSUM = "checksum"  # damaged bytes
    MODEL_CHANGED = "model_changed"  # made by another model or weights
    EVICTED = "evicted"  # the session named one that is gone
    STORE_UNAVAILABLE = "store_unavailable"  # a tier could not be read


@dataclass(frozen=True, slots=True)
class CheckpointMeta:
    """Identity of a checkpoint: the state after ``length`` tokens hashing to ``token_hash``."""

    fingerprint: str
    tenant: str
    length: int
    token_hash: str
    dtype: str


def _checksum(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode() + str(tensor.dtype).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _metadata(meta: CheckpointMeta) -> dict[str, str]:
    return {"format": FORMAT, **{k: str(v) for k, v in asdict(meta).items()}}


def encode_checkpoint(state: SequenceState, meta: CheckpointMeta) -> bytes:
    """Serialize a state (from ``StatefulModel.export_state``) with its identity and checksum."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    metadata = _metadata(meta)
    return save(tensors, metadata={**metadata, "checksum": _checksum(metadata, tensors)})


def decode_checkpoint(data: bytes, expected: CheckpointMeta) -> dict[str, torch.Tensor] | MissReason:
    """The state in ``data`` if it is intact and exactly ``expected``; otherwise why not."""
    try:
        tensors = load(data)
        metadata = _read_metadata(data)
    except (SafetensorError, ValueError, UnicodeDecodeError, json.JSONDecodeError):
        return MissReason.CHECKSUM
    checksum = metadata.pop("checksum", None)
    if metadata.get("format") != FORMAT or checksum != _checksum(metadata, tensors):
        return MissReason.CHECKSUM
    if metadata["fingerprint"] != expected.fingerprint or metadata["dtype"] != expected.dtype:
        return MissReason.MODEL_CHANGED
    if (metadata["tenant"], metadata["length"], metadata["token_hash"]) != (
        expected.tenant,
        str(expected.length),
        expected.token_hash,
    ):
        return MissReason.TOKEN_MISMATCH
    return tensors


def _read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (its JSON header)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size].decode("utf-8"))
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict):
        raise ValueError("no metadata")
    return dict(metadata)
