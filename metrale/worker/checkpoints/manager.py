"""Find the longest checkpointed prefix of a prompt, and save checkpoints, with honest accounting."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from metrale.shared.keys import Keys
from metrale.shared.sessions import SessionEntry
from metrale.worker.checkpoints.format import CheckpointMeta, MissReason, decode_checkpoint, encode_checkpoint
from metrale.worker.checkpoints.hashing import PrefixHasher
from metrale.worker.checkpoints.sessions import SessionIndex
from metrale.worker.checkpoints.store import StoreUnavailable, TieredStore
from metrale.worker.model.interface import SequenceState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Resume:
    """A state to start from: exactly the tokens ``[0, length)`` consumed."""

    length: int
    state: dict[str, torch.Tensor]
    tier: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Lookup:
    """The result of a lookup: a resume point, or the reason there is none."""

    resume: Resume | None
    miss: MissReason | None


@dataclass
class CheckpointCounters:
    """What checkpoints did, counted in-process (the worker publishes them with its heartbeat)."""

    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    saves: int = 0
    retokenized: int = 0
    misses: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        misses = ", ".join(f"{reason} {n}" for reason, n in sorted(self.misses.items())) or "none"
        return (
            f"checkpoints: {self.hits}/{self.lookups} lookups hit, {self.tokens_reused} tokens reused, "
            f"{self.saves} saved ({self.bytes_stored:,} bytes), misses: {misses}"
        )


class CheckpointManager:
    """Checkpoints of one model (``fingerprint``) for every tenant.

    Candidates for a prompt are: the newest checkpoint of its session, every multiple of ``grid``, and
    the boundaries the gateway marked. A checkpoint is used only if it is intact and made for exactly
    the same tokens, tenant and model; at most ``len(prompt) - 1`` tokens are skipped, since the last
    prompt token must still run to give the logits of the first new token.
    """

    def __init__(
        self,
        store: TieredStore,
        sessions: SessionIndex,
        *,
        fingerprint: str,
        dtype: str,
        keys: Keys,
        grid: int = 256,
    ) -> None:
        self.store, self.sessions, self.keys = store, sessions, keys
        self.fingerprint, self.dtype, self.grid = fingerprint, dtype, grid
        self.counters = CheckpointCounters()
        self._lock = threading.Lock()

    def candidates(self, prompt_len: int, marks: Iterable[int], session_length: int | None) -> list[int]:
        """Prefix lengths worth trying, longest first."""
        usable = range(1, prompt_len)
        points = {n for n in (*marks, session_length or 0) if n in usable}
        if self.grid > 0:  # 0: no grid checkpoints
            points.update(range(self.grid, prompt_len, self.grid))
        return sorted(points, reverse=True)

    def find(
        self, tenant: str, prompt: Sequence[int], *, session_id: str | None = None, marks: Iterable[int] = ()
    ) -> Lookup:
        """The longest valid checkpointed prefix of ``prompt``; counts the lookup and its outcome."""
        hasher = PrefixHasher(prompt)
        session = self._session(tenant, session_id)
        if session is not None and session_id is not None and not self._extends(session, prompt, hasher):
            self._count_retokenized(tenant, session_id)
        first_miss: MissReason | None = None
        for n in self.candidates(len(prompt), marks, session.length if session else None):
            outcome = self._load(tenant, n, hasher(n))
            if isinstance(outcome, Resume):
                return self._count(Lookup(outcome, None))
            if outcome is MissReason.NONE and session is not None and n == session.length:
                outcome = MissReason.EVICTED if session.token_hash == hasher(n) else MissReason.TOKEN_MISMATCH
            if first_miss is None or first_miss is MissReason.NONE:
                first_miss = outcome
        if session is not None and session.length >= len(prompt) and first_miss in (None, MissReason.NONE):
            first_miss = MissReason.TOKEN_MISMATCH  # the session moved past this prompt: not a prefix
        return self._count(Lookup(None, first_miss or MissReason.NONE))

    def save(self, tenant: str, consumed: Sequence[int], state: SequenceState, *, session_id: str | None = None) -> int:
        """Store the state after ``consumed`` tokens (and make it the session's newest); returns bytes."""
        token_hash = PrefixHasher(consumed)(len(consumed))
        meta = CheckpointMeta(self.fingerprint, tenant, len(consumed), token_hash, self.dtype)
        data = encode_checkpoint(state, meta)
        key = self.keys.checkpoint(self.fingerprint, tenant, token_hash)
        tier = self.store.put(key, data)
        if session_id is not None:
            try:
                entry = SessionEntry(len(consumed), token_hash, len(data), tier, checkpoint_key=key)
                self.sessions.record(tenant, session_id, entry)
            except StoreUnavailable as exc:
                log.warning("session %s not recorded: %s", session_id, exc)
        with self._lock:
            self.counters.saves += 1
            self.counters.bytes_stored += len(data)
        return len(data)

    def _session(self, tenant: str, session_id: str | None) -> SessionEntry | None:
        if session_id is None:
            return None
        try:
            return self.sessions.get(tenant, session_id)
        except StoreUnavailable as exc:
            log.warning("session %s unavailable: %s", session_id, exc)
            return None

    @staticmethod
    def _extends(session: SessionEntry, prompt: Sequence[int], hasher: PrefixHasher) -> bool:
        """Whether the session's newest checkpoint covers a prefix of ``prompt`` (it cannot be used when
        the prompt re-tokenized the previous reply differently, or the history changed)."""
        return session.length < len(prompt) and session.token_hash == hasher(session.length)

    def _count_retokenized(self, tenant: str, session_id: str) -> None:
        with self._lock:
            self.counters.retokenized += 1
        try:
            self.sessions.count_retokenized(tenant, session_id)
        except StoreUnavailable as exc:
            log.warning("session %s: retokenized not counted: %s", session_id, exc)

    def _load(self, tenant: str, length: int, token_hash: str) -> Resume | MissReason:
        key = self.keys.checkpoint(self.fingerprint, tenant, token_hash)
        try:
            found = self.store.get(key)
        except StoreUnavailable as exc:
            log.warning("checkpoint store unavailable: %s", exc)
            return MissReason.STORE_UNAVAILABLE
        if found is None:
            return MissReason.NONE
        expected = CheckpointMeta(self.fingerprint, tenant, length, token_hash, self.dtype)
        state = decode_checkpoint(found.data, expected)
        if isinstance(state, MissReason):
            log.warning("checkpoint %s ignored: %s", key, state.value)
            self.store.delete(key)
            return state
        return Resume(length, state, found.tier, len(found.data))

    def _count(self, lookup: Lookup) -> Lookup:
        with self._lock:
            self.counters.lookups += 1
            if lookup.resume is not None:
                self.counters.hits += 1
                self.counters.tokens_reused += lookup.resume.length
                self.counters.bytes_loaded += lookup.resume.nbytes
            else:
                assert lookup.miss is not None
                self.counters.misses[lookup.miss.value] += 1
        return lookup
