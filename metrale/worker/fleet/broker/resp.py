"""Redis commands packed by hand into one buffer and sent as one ``MULTI``/``EXEC`` transaction.

A worker publishes every step: one ``PUBLISH`` per token event and one ``RPUSH`` per request, a few
hundred commands at 64 streams. redis-py's pipeline spends several microseconds of Python per command
(packing each argument through its serializer, a reply parsed through its callback table); here a
command is one bytes join, and the replies are read without callbacks. ``pack_command`` writes exactly
what redis-py's own packer writes for bytes arguments (``tests/worker/fleet/broker/test_resp.py`` compares them).

``Transaction`` collects commands (hand-packed, or taken from a redis-py pipeline used only to build
them, so the helpers of ``shared/record.py`` still queue their writes); ``execute_transaction`` sends
them on a connection of the client's pool with the client's own retry and backoff, raising the first
error a command met, as ``Pipeline.execute`` does. ``send_transaction`` only sends them: its replies
are read later (``SentTransaction.replies``), so the caller works on while Redis answers — without
retries, since a transaction sent once may have run. ``send_transactions`` sends several back to back in
one write on one connection (a Redis Cluster node's, for the transactions of its shards), read as one.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.exceptions import ExecAbortError, ResponseError

_CRLF = b"\r\n"
_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"

Arg = bytes | str | int | float


def bulk(value: bytes) -> bytes:
    """One RESP bulk string: ``$<length>\\r\\n<bytes>\\r\\n``."""
    return b"$%d\r\n%b\r\n" % (len(value), value)


def pack_command(*args: Arg) -> bytes:
    """One command as a RESP array of bulk strings (str as UTF-8, numbers as their decimal text, the
    way redis-py's encoder writes them)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(bulk(_as_bytes(arg)))
    return b"".join(parts)


def _as_bytes(arg: Arg) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, bool):  # redis-py refuses booleans; so do we
        raise TypeError("a bool is not a Redis argument")
    return repr(arg).encode()


class Transaction:
    """Commands to send together inside ``MULTI``/``EXEC``, kept as packed bytes in order."""

    __slots__ = ("_parts", "count")

    def __init__(self) -> None:
        self._parts: list[bytes] = [_MULTI]
        self.count = 0

    def __bool__(self) -> bool:
        return self.count > 0

    def packed(self, command: bytes, count: int = 1) -> None:
        """Append ``count`` commands already packed into ``command`` (``pack_command`` or by hand)."""
        self._parts.append(command)
        self.count += count

    def command(self, *args: Arg) -> None:
        """Append one command."""
        self._parts.append(pack_command(*args))
        self.count += 1

    def take_queued(self, pipe: redis.client.Pipeline) -> None:
        """Append the commands queued on ``pipe`` (which is then left empty and never executed)."""
        for args, _ in pipe.command_stack:
            self.command(*args)
        pipe.command_stack.clear()

    def payload(self) -> bytes:
        """Everything to send: ``MULTI``, the commands, ``EXEC``."""
        return b"".join([*self._parts, _EXEC])


def execute_transaction(client: redis.Redis, transaction: Transaction) -> list[Any]:
    """Send ``transaction`` on one of ``client``'s pooled connections and return ``EXEC``'s replies.

    A connection error is retried (on a fresh connection) by the client's ``Retry``, as redis-py's own
    pipeline does; a command Redis refused raises its ``ResponseError`` once every reply is read.
    """
    if not transaction:
        return []
    payload = transaction.payload()
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        replies: list[Any] = connection.retry.call_with_retry(
            lambda: _send(connection, payload, transaction.count),
            lambda _error: connection.disconnect(),
        )
    finally:
        pool.release(connection)
    return replies


class SentTransaction:
    """A transaction sent on a connection held from the pool until its replies are read."""

    __slots__ = ("_connection", "_count", "_pool")

    def __init__(self, pool: redis.ConnectionPool, connection: Any, count: int) -> None:
        self._pool, self._connection, self._count = pool, connection, count

    def replies(self) -> list[Any]:
        """``EXEC``'s replies (read once); raises as ``execute_transaction`` does. The connection goes
        back to the pool either way (closed first when the transaction's replies were not all read)."""
        connection, self._connection = self._connection, None
        if connection is None:
            raise RuntimeError("the replies of this transaction were read already")
        try:
            return _read_replies(connection, self._count)
        except ResponseError:  # every reply was read: the connection is clean
            raise
        except BaseException:
            connection.disconnect()
            raise
        finally:
            self._pool.release(connection)


def send_transaction(client: redis.Redis, transaction: Transaction) -> SentTransaction:
    """Send ``transaction`` (not empty) on one of ``client``'s pooled connections, held until its
    replies are read."""
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        connection.send_packed_command([transaction.payload()])
    except BaseException:
        connection.disconnect()
        pool.release(connection)
        raise
    return SentTransaction(pool, connection, transaction.count)


class SentBatch:
    """Transactions sent back to back on one connection, held from the pool until their replies are read."""

    __slots__ = ("_connection", "_counts", "_pool")

    def __init__(self, pool: redis.ConnectionPool, connection: Any, counts: list[int]) -> None:
        self._pool, self._connection, self._counts = pool, connection, counts

    def replies(self) -> list[list[Any] | ResponseError]:
        """Each transaction's ``EXEC`` replies, or the ``ResponseError`` that refused it (in its place: its
        replies were all read, so the ones after it are read on). A connection error closes the connection
        and is raised: then none of them is known to have run or not."""
        connection, self._connection = self._connection, None
        if connection is None:
            raise RuntimeError("the replies of these transactions were read already")
        results: list[list[Any] | ResponseError] = []
        try:
            for count in self._counts:
                try:
                    results.append(_read_replies(connection, count))
                except ResponseError as error:
                    results.append(error)
            return results
        except BaseException:
            connection.disconnect()
            raise
        finally:
            self._pool.release(connection)


def send_transactions(client: redis.Redis, transactions: list[Transaction]) -> SentBatch:
    """Send ``transactions`` (none empty) back to back in one write on one of ``client``'s pooled
    connections, held until their replies are read (``SentBatch.replies``)."""
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        connection.send_packed_command([b"".join(transaction.payload() for transaction in transactions)])
    except BaseException:
        connection.disconnect()
        pool.release(connection)
        raise
    return SentBatch(pool, connection, [transaction.count for transaction in transactions])


def _send(connection: Any, payload: bytes, count: int) -> list[Any]:
    connection.send_packed_command([payload])  # a list of buffers (bare bytes would be sent per byte)
    return _read_replies(connection, count)


def _read_replies(connection: Any, count: int) -> list[Any]:
    errors: list[ResponseError] = []
    for _ in range(count + 1):  # MULTI's +OK, then one +QUEUED per command (or the error refusing it)
        try:
            connection.read_response()
        except ResponseError as error:
            errors.append(error)
    try:
        replies = connection.read_response()
    except ExecAbortError:
        if errors:  # the reason Redis refused the transaction
            raise errors[0] from None
        raise
    if not isinstance(replies, list) or len(replies) != count:
        connection.disconnect()
        raise ResponseError(f"EXEC answered {replies!r} to a transaction of {count} commands")
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies
