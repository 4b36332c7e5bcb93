"""Saves checkpoints off the engine's step loop, and says when a request's final state is stored.

The worker holds back a request's final token events until its final checkpoint is stored, so a
client that sends the next turn after seeing the end of this one always finds it (on any worker).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from metrale.worker.checkpoints.manager import CheckpointManager
from metrale.worker.snapshots import Snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SaveJob:
    """Snapshots of one request; ``release`` names the request to report once they are stored."""

    tenant: str
    session_id: str | None
    snapshots: Sequence[Snapshot]
    release: str | None


class CheckpointWriter:
    """One background thread running ``manager.save`` for each submitted snapshot, in order."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager
        self._jobs: queue.Queue[SaveJob | None] = queue.Queue()
        self._released: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> None:
        self._jobs.put(job)

    def released(self) -> list[str]:
        """Requests whose final checkpoint has been stored (or failed to be) since the last call."""
        done = []
        while True:
            try:
                done.append(self._released.get_nowait())
            except queue.Empty:
                return done

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued saves (up to ``timeout`` seconds) and stop the thread."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            for snapshot in job.snapshots:
                session = job.session_id if snapshot.final else None
                try:
                    self.manager.save(job.tenant, snapshot.consumed, snapshot.state, session_id=session)
                except Exception:  # a failed save only costs speed later; never lose the request
                    log.exception(
                        "checkpoint of %s at %d tokens not saved", snapshot.request_id, len(snapshot.consumed)
                    )
            if job.release is not None:
                self._released.put(job.release)
