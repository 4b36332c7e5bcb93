"""A session's records in Redis: its newest checkpoint (written by workers) and its last turn's
transcript (written by gateways), both under ``met:session:{tenant}:{sid}``."""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

RETOKENIZED_FIELD = "retokenized"
"""The session hash's count of lookups whose newest checkpoint was not a prefix of the prompt."""


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
    """A conversation's last turn as the model consumed it: the rendered text and its exact token ids
    (prompt plus the reply as generated, stop token included); the first ``prompt_length`` ids are
    the turn's prompt."""

    text: str
    token_ids: tuple[int, ...]
    prompt_length: int = 0

    def to_fields(self) -> dict[str, bytes]:
        return {
            "text": self.text.encode(),
            "token_ids": struct.pack(f"<{len(self.token_ids)}I", *self.token_ids),
            "prompt_length": str(self.prompt_length).encode(),
        }

    @classmethod
    def from_fields(cls, raw: Mapping[bytes | str, bytes | str]) -> Transcript | None:
        fields = {_text(k): v if isinstance(v, bytes) else v.encode() for k, v in raw.items()}
        try:
            packed = fields["token_ids"]
            token_ids = struct.unpack(f"<{len(packed) // 4}I", packed)
            return cls(fields["text"].decode(), token_ids, int(fields.get("prompt_length", b"0")))
        except (KeyError, ValueError, UnicodeDecodeError, struct.error):
            return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
