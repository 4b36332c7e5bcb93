"""A session's records in Redis: its newest checkpoint (written by workers) and its transcript
(written by gateways), both under ``met:session:{tenant}:{sid}``."""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SessionEntry:
    """The session's newest checkpoint: ``length`` tokens hashing to ``token_hash``, ``nbytes`` big,
    stored under ``checkpoint_key`` in ``tier`` at ``last_use`` (unix seconds)."""

    length: int
    token_hash: str
    nbytes: int
    tier: str
    checkpoint_key: str = ""
    last_use: float = field(default_factory=time.time)

    def to_fields(self) -> dict[str, str]:
        return {name: str(getattr(self, name)) for name in self.__dataclass_fields__}

    @classmethod
    def from_fields(cls, raw: Mapping[bytes | str, bytes | str]) -> SessionEntry | None:
        """Parse a stored hash; None when it is missing fields or damaged."""
        fields = {_text(k): _text(v) for k, v in raw.items()}
        try:
            return cls(
                int(fields["length"]),
                fields["token_hash"],
                int(fields["nbytes"]),
                fields["tier"],
                fields.get("checkpoint_key", ""),
                float(fields["last_use"]),
            )
        except (KeyError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class Transcript:
    """The conversation so far as the model consumed it: the rendered text and its exact token ids
    (prompt plus the reply as generated, stop token included)."""

    text: str
    token_ids: tuple[int, ...]

    def to_fields(self) -> dict[str, bytes]:
        return {"text": self.text.encode(), "token_ids": struct.pack(f"<{len(self.token_ids)}I", *self.token_ids)}

    @classmethod
    def from_fields(cls, raw: Mapping[bytes | str, bytes | str]) -> Transcript | None:
        fields = {_text(k): v if isinstance(v, bytes) else v.encode() for k, v in raw.items()}
        try:
            packed = fields["token_ids"]
            return cls(fields["text"].decode(), struct.unpack(f"<{len(packed) // 4}I", packed))
        except (KeyError, UnicodeDecodeError, struct.error):
            return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
