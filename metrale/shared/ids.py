"""Random ids for requests and stored objects, without a system call each.

``uuid.uuid4()`` reads the OS's random source on every call (``os.urandom``), and the call lets go of
the interpreter lock: on a gateway loop that shares the lock with a worker thread (``met serve``) each
id then waits to get it back. ``random_hex`` takes its bytes from a buffer filled from the same
source ``BUFFER_IDS`` ids at a time: the same quality, one system call per ``BUFFER_IDS`` ids.
"""

from __future__ import annotations

import os
import threading

ID_BYTES = 16
BUFFER_IDS = 256

_lock = threading.Lock()
_buffer = b""


def random_hex(nbytes: int = ID_BYTES) -> str:
    """``2 * nbytes`` lowercase hex digits from the OS's random source (as ``uuid4().hex`` for 16, which
    also fixes 6 of its 128 bits)."""
    global _buffer
    with _lock:
        if len(_buffer) < nbytes:
            _buffer = os.urandom(max(nbytes, ID_BYTES * BUFFER_IDS))
        taken, _buffer = _buffer[:nbytes], _buffer[nbytes:]
    return taken.hex()


def _forget_after_fork() -> None:
    """A forked child must not hand out the ids its parent will."""
    global _buffer
    _buffer = b""


os.register_at_fork(after_in_child=_forget_after_fork)
