"""RedisTransport on a real server whose data vanishes under it (FLUSHDB, a restart without
persistence) while a read is blocked: fakeredis does not unblock readers as Redis does."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from metrale.shared.codec import encode
from metrale.shared.keys import Keys
from metrale.shared.messages import GenerateRequest, Priority
from metrale.worker.fleet.broker.redis_transport import RedisTransport, redis_client

pytestmark = pytest.mark.redis


def test_a_stream_deleted_under_a_blocked_read_is_made_again(real_redis_url: str) -> None:
    keys = Keys(f"met-test-{uuid.uuid4().hex}")
    client = redis_client(real_redis_url)
    transport = RedisTransport(client, worker_id="worker-a", keys=keys)
    transport.receive(1, 0)  # the groups exist
    stream = keys.request_stream(Priority.INTERACTIVE)
    deleter = threading.Thread(target=lambda: (time.sleep(0.3), client.delete(stream)))
    deleter.start()

    assert transport.receive(1, block_ms=3000) == []  # UNBLOCKED: the stream key no longer exists
    deleter.join()
    request = GenerateRequest("cmpl-1", "tiny", "default", [1, 2, 3], max_tokens=4)
    transport.receive(1, 0)  # makes the groups again
    client.xadd(stream, {"msg": encode(request)})
    assert [r.request_id for r in transport.receive(1, 0) if isinstance(r, GenerateRequest)] == ["cmpl-1"]
    client.close()
