"""The pub/sub replies a redis-py connection has already read, taken at once instead of one call each.

redis-py's asyncio ``PubSub.get_message`` returns one message per call, and every call pays for a
health check, a retry wrapper, an asyncio timeout scope and a push handler that formats a debug line;
meanwhile its socket read (up to 64 KiB) brings in every message Redis had sent, hundreds at once when
64 streams are busy. After a ``get_message`` has returned, ``buffered_replies`` takes the complete
replies its hiredis reader already holds, as raw RESP values (a message is ``[b"message", channel,
data]``), without awaiting anything. The rest of a reply still in flight stays in the reader for the
next ``get_message``.

This reads two redis-py internals: a connection's ``_parser._reader`` (the ``hiredis.Reader``) and the
sentinel it returns when no complete reply is buffered. ``can_drain`` says whether a connection has
both; where it does not (no hiredis, another redis-py), the relay takes messages one at a time, its
reference path.
"""

from __future__ import annotations

from typing import Any

try:
    from redis._parsers.hiredis import NOT_ENOUGH_DATA
except ImportError:  # another redis-py layout: nothing is drained
    NOT_ENOUGH_DATA = None


def _reader(connection: object) -> Any:
    """The connection's hiredis reader, or None."""
    reader = getattr(getattr(connection, "_parser", None), "_reader", None)
    return reader if NOT_ENOUGH_DATA is not None and callable(getattr(reader, "gets", None)) else None


def can_drain(connection: object) -> bool:
    """Whether ``buffered_replies`` can read ``connection``'s buffered replies."""
    return _reader(connection) is not None


def buffered_replies(connection: object) -> list[Any]:
    """Every complete reply ``connection`` has read and not yet handed out, in order (none when it
    cannot be drained). An error reply is returned as its exception object, as hiredis gives it."""
    reader = _reader(connection)
    if reader is None:
        return []
    replies = []
    while (reply := reader.gets()) is not NOT_ENOUGH_DATA:
        replies.append(reply)
    return replies
