"""A uvicorn server run in a thread of the test process, on a free loopback port."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

STARTUP_S = 20.0


@contextlib.contextmanager
def running_in_thread(config: uvicorn.Config, name: str = "server under test") -> Iterator[uvicorn.Server]:
    """Start a server of ``config`` (give it ``port=0``) in a thread, wait until it listens, yield it
    (its port: ``port_of``), and stop it at the end."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=STARTUP_S)


def port_of(server: uvicorn.Server) -> int:
    """The loopback port a started server listens on."""
    return int(server.servers[0].sockets[0].getsockname()[1])
