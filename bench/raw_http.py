"""A burst of HTTP/1.1 requests with as little client in the timing as possible.

Every connection is opened before the burst; then each request is written whole in one loop pass (no
client work between the writes but the write itself), and a timestamp is taken per write and when the
status line and headers of its response have arrived. A reader does nothing but wait for bytes, so its
stamp is when the server's answer reached this process, give or take one wake-up of an otherwise idle
event loop. This measures the server; a full client library (httpx, openai) adds its own event-loop
work for hundreds of connections to every figure.

Each request is ``POST`` with ``Connection: close``; a 200 stream is read to its end (EOF) and counts
as complete when it holds ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RawAttempt:
    """One request: its status, seconds from its write to its response headers, the ``Retry-After`` of
    a refusal, and whether a 200 stream reached ``[DONE]``."""

    status: int
    headers_s: float
    retry_after: str | None
    completed: bool


def request_bytes(host: str, port: int, path: str, body: dict[str, object], headers: dict[str, str]) -> bytes:
    """The whole HTTP/1.1 request, ready to write."""
    payload = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json"]
    lines += [f"Content-Length: {len(payload)}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def _answer(reader: asyncio.StreamReader, written_at: list[float]) -> RawAttempt:
    head = await reader.readuntil(b"\r\n\r\n")
    arrived = time.perf_counter()
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    fields = dict(line.split(": ", 1) for line in header_lines if ": " in line)
    retry_after = next((value for name, value in fields.items() if name.lower() == "retry-after"), None)
    rest = await reader.read()
    return RawAttempt(status, arrived - written_at[0], retry_after, status == 200 and b"data: [DONE]" in rest)


async def burst(
    host: str, port: int, path: str, body: dict[str, object], headers: dict[str, str], count: int
) -> list[RawAttempt]:
    """``count`` copies of one request, each on its own connection, written together."""
    raw = request_bytes(host, port, path, body, headers)
    connections = [await asyncio.open_connection(host, port) for _ in range(count)]
    written_at = [[0.0] for _ in range(count)]
    answers = [
        asyncio.ensure_future(_answer(reader, stamp))
        for (reader, _), stamp in zip(connections, written_at, strict=True)
    ]
    await asyncio.sleep(0)  # every reader is waiting before the first write
    for (_, writer), stamp in zip(connections, written_at, strict=True):
        writer.write(raw)
        stamp[0] = time.perf_counter()
    try:
        return list(await asyncio.gather(*answers))
    finally:
        for _, writer in connections:
            writer.close()


async def refusing_app(scope: dict[str, object], receive: object, send: object) -> None:
    """An ASGI app that answers every request at once with a 429 and ``Retry-After`` — the floor of a
    refusal's latency for a server on this machine (``uvicorn bench.raw_http:refusing_app``)."""
    if scope["type"] != "http":
        return
    body = b'{"error": {"message": "busy", "type": "rate_limit_error", "param": null, "code": "rate_limit_exceeded"}}'
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
    await send({"type": "http.response.start", "status": 429, "headers": headers})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": body})  # type: ignore[operator]
