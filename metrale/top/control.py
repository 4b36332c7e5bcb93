"""Orders ``met top`` sends a worker: drain (what SIGTERM does)."""

from __future__ import annotations

import redis

from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import ControlAction, WorkerControl

DRAIN_REASON = "drain ordered from met top"


def order_drain(client: redis.Redis, keys: Keys, worker_id: str, reason: str = DRAIN_REASON) -> int:
    """Ask ``worker_id`` to drain; how many listeners heard it (0: that worker is not listening)."""
    order = WorkerControl(worker_id, ControlAction.DRAIN, reason)
    return int(client.publish(keys.control_channel(worker_id), encode(order)))
