"""A Redis for ``met serve`` when none is given: a private ``redis-server`` if one is installed (fast),
else fakeredis' TCP server in a thread (pure Python, slower, always there)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

import fakeredis
import redis

from metrale.shared.redis_connect import sync_client

log = logging.getLogger(__name__)


@dataclass
class EmbeddedRedis:
    url: str
    kind: str
    _stop: list[object] = field(default_factory=list, repr=False)

    def close(self) -> None:
        for stop in reversed(self._stop):
            stop()  # type: ignore[operator]


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(url: str, timeout_s: float = 10.0) -> bool:
    client = sync_client(url, retries=0, socket_connect_timeout=0.2)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                time.sleep(0.05)
        return False
    finally:
        client.close()


def _redis_server(binary: str) -> EmbeddedRedis | None:
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="met-redis-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
    # Its own session: a Ctrl-C in the terminal must not stop Redis before the worker has drained.
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    if not _wait_ready(url):
        process.kill()
        return None

    def stop() -> None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
        shutil.rmtree(workdir, ignore_errors=True)

    return EmbeddedRedis(url, "redis-server", [stop])


def _fake_server() -> EmbeddedRedis:
    server = fakeredis.TcpFakeServer(("127.0.0.1", 0), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, name="embedded-redis", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    url = f"redis://{host if isinstance(host, str) else host.decode()}:{port}/0"
    _wait_ready(url)

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return EmbeddedRedis(url, "fakeredis", [stop])


def redis_or_embedded(url: str | None) -> tuple[str, EmbeddedRedis | None]:
    """``url`` when given; otherwise a freshly started private Redis (the caller ``close()``s it)."""
    if url is not None:
        return url, None
    embedded = start_embedded_redis()
    return embedded.url, embedded


def start_embedded_redis() -> EmbeddedRedis:
    """Start a private Redis on a free local port; the caller must ``close()`` it."""
    binary = shutil.which("redis-server")
    if binary is not None:
        embedded = _redis_server(binary)
        if embedded is not None:
            return embedded
        log.warning("redis-server did not start; using the embedded fakeredis server")
    return _fake_server()
