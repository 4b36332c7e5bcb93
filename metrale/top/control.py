"""Orders ``met top`` sends a worker: drain (what SIGTERM does)."""

from __future__ import annotations

from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import ControlAction, WorkerControl
from metrale.shared.redis_connect import SyncClient, is_cluster

DRAIN_REASON = "drain ordered from met top"


def order_drain(client: SyncClient, keys: Keys, worker_id: str, reason: str = DRAIN_REASON) -> int:
    """Ask ``worker_id`` to drain; how many listeners heard it (0: that worker is not listening). On a
    Redis Cluster the order is a sharded message (``SPUBLISH``), as the worker listens there."""
    order = WorkerControl(worker_id, ControlAction.DRAIN, reason)
    channel, payload = keys.control_channel(worker_id), encode(order)
    if is_cluster(client):
        return int(client.spublish(channel, payload))
    return int(client.publish(channel, payload))
