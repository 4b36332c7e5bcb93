"""Worker threads speaking the fleet protocol over Redis: fakeredis for the protocol details, and one
run of the built-in tiny model against the real test server."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from metrale.shared.codec import decode, encode
from metrale.shared.keys import WORKER_GROUP, Keys
from metrale.shared.messages import (
    CancelRequest,
    ControlAction,
    FinishReason,
    GenerateRequest,
    Priority,
    TokenEvent,
    WorkerControl,
    WorkerHeartbeat,
    WorkerState,
)
from metrale.shared.record import RunningEntry, RunRecord, RunStatus, read_record, set_status
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.factory import EngineLimits, build_engine
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.fleet.announcement import model_announcement
from metrale.worker.fleet.broker.redis_transport import RedisTransport, redis_client
from metrale.worker.fleet.service import Worker
from tests.worker.worker_helpers import (
    MODEL,
    announcement,
    expected_choice,
    generate_request,
    join_worker,
    make_engine,
    start_worker,
    tokens_of,
    wait_for,
    worker_settings,
)


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def client(server: fakeredis.FakeServer) -> Iterator[redis.Redis]:
    client = fakeredis.FakeRedis(server=server)
    yield client
    client.close()


def submit(client: redis.Redis, keys: Keys, payload: GenerateRequest | bytes) -> None:
    """Queue a request as a gateway does: status QUEUED and the stream entry in one transaction."""
    with client.pipeline(transaction=True) as pipe:
        if isinstance(payload, GenerateRequest):
            set_status(pipe, payload.request_id, RunStatus.QUEUED, keys=keys)
            pipe.xadd(keys.request_stream(payload.priority), {"msg": encode(payload)})
        else:
            pipe.xadd(keys.request_stream(Priority.INTERACTIVE), {"msg": payload})
        pipe.execute()


def received_events(listener: redis.client.PubSub) -> list[object]:
    """Every message the listener has received so far, decoded (subscription notices skipped)."""
    messages = iter(lambda: listener.get_message(timeout=0.2), None)
    return [decode(message["data"]) for message in messages if message["type"] == "message"]


def finished_record(client: redis.Redis, keys: Keys, request_id: str) -> RunRecord:
    wait_for(lambda: _status(client, keys, request_id) is RunStatus.FINISHED, f"{request_id} to finish")
    record = read_record(client, request_id, keys=keys)
    assert record is not None
    return record


def _status(client: redis.Redis, keys: Keys, request_id: str) -> RunStatus | None:
    record = read_record(client, request_id, keys=keys)
    return record.status if record is not None else None


def fake_worker(
    server: fakeredis.FakeServer, keys: Keys, worker_id: str, engine: Engine, max_model_len: int
) -> tuple[Worker, threading.Event, threading.Thread]:
    transport = RedisTransport(fakeredis.FakeRedis(server=server), worker_id=worker_id, keys=keys, heartbeat_ttl_s=3)
    settings = worker_settings(heartbeat_ttl_s=3)
    worker = Worker(engine, transport, settings, worker_id=worker_id, model=announcement(max_model_len))
    stop = threading.Event()
    return worker, stop, start_worker(worker, stop)


def test_the_worker_serves_the_protocol_end_to_end(
    server: fakeredis.FakeServer, client: redis.Redis, keys: Keys
) -> None:
    message = generate_request("chatcmpl-1", n=2, max_tokens=8)
    listener = client.pubsub()
    listener.subscribe(keys.token_channel(message.request_id))
    submit(client, keys, b"\x00 not a request")
    submit(client, keys, message)

    engine, _ = make_engine()
    _, stop, thread = fake_worker(server, keys, "w1", engine, max_model_len=64)
    record = finished_record(client, keys, message.request_id)
    heartbeat = decode(client.hget(keys.worker("w1"), "msg"))
    heartbeat_ttl = client.ttl(keys.worker("w1"))
    stop.set()
    join_worker(thread, stop)

    published = received_events(listener)
    assert published == list(record.events) and record.is_contiguous
    assert all(isinstance(event, TokenEvent) for event in published)
    for choice in range(message.n):
        assert record.token_ids(choice) == expected_choice(message, choice)[0]
    assert (record.worker_id, record.finish_reason) == ("w1", expected_choice(message, 0)[1])
    stream = keys.request_stream(Priority.INTERACTIVE)
    assert client.xlen(stream) == 0 and client.xpending(stream, WORKER_GROUP)["pending"] == 0
    ((_, dead),) = client.xrange(keys.dead_letter())
    assert dead[b"raw"] == b"\x00 not a request" and dead[b"stream"] == stream.encode()
    assert isinstance(heartbeat, WorkerHeartbeat) and heartbeat.model == MODEL and 0 < heartbeat_ttl <= 3
    assert not client.exists(keys.worker("w1"))
    assert decode(client.hget(keys.model(MODEL), "msg")) == announcement(64)


def test_a_busy_worker_leaves_new_requests_to_an_idle_one(
    server: fakeredis.FakeServer, client: redis.Redis, keys: Keys
) -> None:
    long_len = 8192  # far more steps than the idle worker needs to start
    busy_engine, _ = make_engine(max_seqs=1, max_model_len=long_len)
    _, busy_stop, busy_thread = fake_worker(server, keys, "busy", busy_engine, long_len)
    submit(client, keys, generate_request("long", max_tokens=long_len - 8, ignore_eos=True))
    wait_for(lambda: _status(client, keys, "long") is RunStatus.RUNNING, "the busy worker to take 'long'")
    idle_engine, _ = make_engine(max_seqs=1, max_model_len=long_len)
    _, idle_stop, idle_thread = fake_worker(server, keys, "idle", idle_engine, long_len)

    submit(client, keys, generate_request("short"))
    short = finished_record(client, keys, "short")
    still_running = _status(client, keys, "long")
    client.publish(keys.cancel_channel(), encode(CancelRequest("long", "client disconnected")))
    long = finished_record(client, keys, "long")
    busy_stop.set()
    idle_stop.set()
    join_worker(busy_thread, busy_stop)
    join_worker(idle_thread, idle_stop)

    assert short.worker_id == "idle" and still_running is RunStatus.RUNNING
    assert (long.worker_id, long.finish_reason) == ("busy", FinishReason.ABORT)
    assert long.events[-1].usage is not None and long.events[-1].usage.completion_tokens == len(long.token_ids())


@pytest.mark.redis
def test_a_worker_thread_serves_the_tiny_model_over_a_real_redis(real_redis_url: str, tiny_model_dir: Path) -> None:
    keys = Keys(f"met-test-{uuid.uuid4().hex}")
    limits = EngineLimits(max_seqs=4, max_batch_tokens=64, num_blocks=64)
    loaded = build_engine(tiny_model_dir, limits)
    model = model_announcement(loaded, "metrale-tiny")
    client = redis_client(real_redis_url)
    transport = RedisTransport(redis_client(real_redis_url), worker_id="real-1", keys=keys, heartbeat_ttl_s=5)
    worker = Worker(loaded.engine, transport, worker_settings(heartbeat_ttl_s=5), worker_id="real-1", model=model)
    message = GenerateRequest("chatcmpl-real", "metrale-tiny", "default", [5, 6, 7, 8], max_tokens=6, seed=42, n=2)
    listener = client.pubsub()
    listener.subscribe(keys.token_channel(message.request_id))

    stop = threading.Event()
    thread = start_worker(worker, stop)
    submit(client, keys, message)
    record = finished_record(client, keys, message.request_id)
    stop.set()
    join_worker(thread, stop)

    reference = build_engine(tiny_model_dir, limits).engine.generate(
        [message.prompt_token_ids], SamplingParams(max_tokens=6, seed=42, n=2)
    )[0]
    published = received_events(listener)
    assert published == list(record.events) and record.is_contiguous
    assert [tokens_of(record.events, choice) for choice in range(2)] == [c.token_ids for c in reference.completions]
    assert record.finish_reason is not None and reference.completions[0].finish_reason is not None
    assert record.finish_reason.value == reference.completions[0].finish_reason.value
    assert decode(client.hget(keys.model("metrale-tiny"), "msg")) == model
    assert not client.exists(keys.worker("real-1"))
    assert client.xlen(keys.request_stream(Priority.INTERACTIVE)) == 0
    client.delete(*client.scan_iter(f"{keys.namespace}:*"))
    client.close()


def test_a_drain_order_on_the_control_channel_hands_back_and_exits_and_the_indexes_follow(
    server: fakeredis.FakeServer, client: redis.Redis, keys: Keys
) -> None:
    """What ``met top`` relies on: a taken request is in the running index with what top shows of it,
    the worker in the worker index; a drain order hands the request back and withdraws both."""
    message = generate_request("long-1", max_tokens=4000, ignore_eos=True)
    submit(client, keys, message)
    engine, _ = make_engine(max_model_len=4096)
    transport = RedisTransport(fakeredis.FakeRedis(server=server), worker_id="w1", keys=keys, heartbeat_ttl_s=3)
    settings = dataclasses.replace(worker_settings(heartbeat_ttl_s=3), drain_handoff=True)
    worker = Worker(engine, transport, settings, worker_id="w1", model=announcement(4096), device="cpu")
    stop = threading.Event()
    thread = start_worker(worker, stop)

    wait_for(lambda: client.zscore(keys.running_index(), "long-1") is not None, "the request in the running index")
    (taken_at,) = [score for _, score in client.zrange(keys.running_index(), 0, -1, withscores=True)]
    entry = RunningEntry.parse("long-1", client.hget(keys.running_info(), "long-1"))
    assert entry == RunningEntry("long-1", MODEL, "default", "interactive", "w1", message.created_at, taken_at)
    assert client.zscore(keys.worker_index(), "w1") is not None
    beat = decode(client.hget(keys.worker("w1"), "msg"))
    assert isinstance(beat, WorkerHeartbeat) and (beat.device, beat.state) == ("cpu", WorkerState.TAKING)

    receivers = client.publish(keys.control_channel("w1"), encode(WorkerControl("w1", ControlAction.DRAIN, "test")))
    join_worker(thread, stop)  # returns by itself

    assert receivers == 1 and stop.is_set()
    assert not client.exists(keys.worker("w1")) and client.zscore(keys.worker_index(), "w1") is None
    assert client.zcard(keys.running_index()) == 0 and client.hlen(keys.running_info()) == 0
    assert read_record(client, "long-1", keys=keys).status is RunStatus.QUEUED  # type: ignore[union-attr]
    assert client.xlen(keys.request_stream(Priority.INTERACTIVE)) == 1  # queued again for another worker
