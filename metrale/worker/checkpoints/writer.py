"""Saves checkpoints off the engine's step loop, and says when a request's checkpoint is stored.

The worker holds back a request's final token events until its final checkpoint is stored, so a
client that sends the next turn after seeing the end of this one always finds it (on any worker);
a stopping worker hands a request back only once the checkpoint of its current state is stored.
Decode checkpoints serve only to resume their own request: the writer keeps the newest one of each
request and deletes the one before, and deletes the last once the request ends here.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from metrale.worker.checkpoints.hashing import PrefixHasher
from metrale.worker.checkpoints.manager import CheckpointManager
from metrale.worker.checkpoints.store import StoreUnavailable
from metrale.worker.engine.snapshots import Snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SaveJob:
    """Snapshots of one request; ``release`` names the request to report once they are stored."""

    tenant: str
    session_id: str | None
    snapshots: Sequence[Snapshot]
    release: str | None


@dataclass(frozen=True, slots=True)
class _Forget:
    """Delete a request's newest decode checkpoint: it ended here without a final snapshot."""

    tenant: str
    request_id: str


class CheckpointWriter:
    """One background thread running ``manager.save`` for each submitted snapshot, in order."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager
        self._jobs: queue.Queue[SaveJob | _Forget | None] = queue.Queue()
        self._released: queue.Queue[str] = queue.Queue()
        self._released_signal = threading.Event()  # set whenever ``_released`` may hold something
        self._decode_keys: dict[str, str] = {}  # request -> key of its newest decode checkpoint
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> None:
        self._jobs.put(job)

    def forget(self, tenant: str, request_id: str) -> None:
        """The request was aborted or refused here: drop its decode checkpoint (after queued saves)."""
        self._jobs.put(_Forget(tenant, request_id))

    def released(self) -> list[str]:
        """Requests whose ``release`` job has been stored (or failed to be) since the last call."""
        self._released_signal.clear()  # before draining: a release put after this sets it again
        done = []
        while True:
            try:
                done.append(self._released.get_nowait())
            except queue.Empty:
                return done

    def wait_released(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a ``release`` job to be stored; True when ``released`` has news."""
        return self._released_signal.wait(timeout_s)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued saves (up to ``timeout`` seconds) and stop the thread."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, _Forget):
                self._drop_decode_checkpoint(job.request_id)
                continue
            for snapshot in job.snapshots:
                self._save(job, snapshot)
            if job.release is not None:
                self._released.put(job.release)
                self._released_signal.set()

    def _save(self, job: SaveJob, snapshot: Snapshot) -> None:
        session = job.session_id if snapshot.final else None
        try:
            self.manager.save(job.tenant, snapshot.consumed, snapshot.state, session_id=session)
        except Exception:  # a failed save only costs speed later; never lose the request
            log.exception("checkpoint of %s at %d tokens not saved", snapshot.request_id, len(snapshot.consumed))
            return
        if snapshot.decode or snapshot.final:
            key = self._key(job.tenant, snapshot.consumed)
            self._drop_decode_checkpoint(snapshot.request_id, keep=key)
            if snapshot.decode:
                self._decode_keys[snapshot.request_id] = key

    def _drop_decode_checkpoint(self, request_id: str, keep: str | None = None) -> None:
        key = self._decode_keys.pop(request_id, None)
        if key is None or key == keep:
            return
        try:
            self.manager.store.delete(key)
        except StoreUnavailable as exc:  # it expires with its TTL
            log.warning("decode checkpoint %s not deleted: %s", key, exc)

    def _key(self, tenant: str, consumed: Sequence[int]) -> str:
        token_hash = PrefixHasher(consumed)(len(consumed))
        return self.manager.keys.checkpoint(self.manager.fingerprint, tenant, token_hash)
