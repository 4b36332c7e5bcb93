"""Hand-packed Redis transactions against redis-py's own packer and pipeline (their reference twin)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.shared.keys import Keys
from metrale.worker.fleet.broker.resp import Transaction, bulk, execute_transaction, pack_command, send_transactions

PROPERTY = settings(derandomize=True, deadline=None, max_examples=100)

arguments = st.one_of(st.binary(max_size=40), st.text(max_size=20), st.integers(-(2**63), 2**63 - 1))


@pytest.fixture
def client(real_redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(real_redis_url)
    yield client
    client.close()


@PROPERTY
@given(name=st.sampled_from(["PUBLISH", "RPUSH", "HSET", b"EXPIRE"]), args=st.lists(arguments, max_size=6))
def test_a_packed_command_is_what_redis_py_sends(name: str | bytes, args: list[Any]) -> None:
    # (redis-py splits a first argument holding spaces into words, as in "CONFIG GET"; a name has none)
    reference = redis.Connection().pack_command(name, *args)
    assert pack_command(name, *args) == b"".join(reference)


def test_a_hand_packed_publish_equals_the_packed_command() -> None:
    by_hand = b"*3\r\n$7\r\nPUBLISH\r\n" + bulk(b"chan") + bulk(b"\x00\xff")
    assert by_hand == pack_command("PUBLISH", "chan", b"\x00\xff")


def test_commands_taken_from_a_pipeline_are_packed_in_order(client: redis.Redis, keys: Keys) -> None:
    transaction = Transaction()
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(keys.run_record("a"), mapping={"status": "running", "worker": "w"})
        pipe.expire(keys.run_record("a"), 60)
        transaction.take_queued(pipe)
        assert not pipe.command_stack
    expected = [
        pack_command("HSET", keys.run_record("a"), "status", "running", "worker", "w"),
        pack_command("EXPIRE", keys.run_record("a"), 60),
    ]
    assert transaction.count == 2
    assert transaction.payload() == b"".join([pack_command("MULTI"), *expected, pack_command("EXEC")])


def test_a_transaction_answers_what_a_redis_py_pipeline_does(client: redis.Redis, keys: Keys) -> None:
    def commands() -> list[tuple[Any, ...]]:
        return [
            ("RPUSH", keys.run_events(name), b"\x01", b"\x02"),
            ("PUBLISH", keys.token_channel(name), b"payload"),
            ("HSET", keys.run_record(name), "status", "running"),
            ("EXPIRE", keys.run_events(name), 60),
            ("LRANGE", keys.run_events(name), 0, -1),
        ]

    name = "hand"
    transaction = Transaction()
    for args in commands():
        transaction.command(*args)
    packed = execute_transaction(client, transaction)
    name = "pipe"
    with client.pipeline(transaction=True) as pipe:
        for args in commands():
            pipe.execute_command(*args)
        raw = pipe.execute()
    assert packed == [2, 0, 1, 1, [b"\x01", b"\x02"]]
    assert packed == raw  # the same replies (raw: no reply callbacks, so EXPIRE's is 1 where redis-py says True)
    assert client.lrange(keys.run_events("hand"), 0, -1) == client.lrange(keys.run_events("pipe"), 0, -1)


def test_a_command_redis_refuses_raises_after_every_reply_is_read(client: redis.Redis, keys: Keys) -> None:
    client.set(keys.run_record("s"), "a string")
    transaction = Transaction()
    transaction.command("RPUSH", keys.run_record("s"), b"x")  # WRONGTYPE at EXEC
    transaction.command("RPUSH", keys.run_events("s"), b"y")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        execute_transaction(client, transaction)
    assert client.lrange(keys.run_events("s"), 0, -1) == [b"y"]  # a transaction is not rolled back
    assert client.ping()  # the connection went back to the pool with nothing left unread


def test_a_malformed_command_aborts_the_whole_transaction(client: redis.Redis, keys: Keys) -> None:
    transaction = Transaction()
    transaction.command("RPUSH", keys.run_events("m"), b"x")
    transaction.command("NOSUCHCOMMAND", "x")
    with pytest.raises(redis.ResponseError, match="unknown command"):
        execute_transaction(client, transaction)
    assert client.llen(keys.run_events("m")) == 0
    assert client.ping()


def test_transactions_sent_back_to_back_answer_each_its_own(client: redis.Redis, keys: Keys) -> None:
    first, refused, last = Transaction(), Transaction(), Transaction()
    first.command("RPUSH", keys.run_events("b1"), b"x")
    refused.command("RPUSH", keys.run_events("b2"), b"y")
    refused.command("NOSUCHCOMMAND", "x")  # aborts its own transaction only
    last.command("RPUSH", keys.run_events("b3"), b"z")
    last.command("LLEN", keys.run_events("b1"))

    answered = send_transactions(client, [first, refused, last]).replies()

    assert answered[0] == [1] and answered[2] == [1, 1]
    assert isinstance(answered[1], redis.ResponseError) and "unknown command" in str(answered[1])
    assert client.llen(keys.run_events("b2")) == 0
    assert client.ping()  # every reply was read: the connection went back clean
