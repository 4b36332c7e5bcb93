"""What a gateway's first requests would otherwise pay for on the event loop, paid at start instead.

A cold burst (hundreds of requests in the first second of a fresh server) meets every one-time cost at
once, each on the loop while probes and streams wait: a thread pool that starts its threads on demand
(each start waits for the new thread to take the interpreter lock, which the worker thread of
``met serve`` holds), libraries that import parts of themselves on first use (anyio's public names),
and FastAPI working out each endpoint's source file and line on its first call (it reads the source).
``warm_start(app)`` does all three before the server accepts its first connection.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import anyio
from fastapi import FastAPI
from fastapi import routing as fastapi_routing

OFF_LOOP_THREADS = min(32, (os.cpu_count() or 1) + 4)
"""Threads of the loop's default executor (``asyncio.to_thread``): as many as Python's default pool."""


def started_thread_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads, every one of them started now (a pool starts them on demand)."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    all_started = threading.Barrier(workers)
    # No thread is idle until all have arrived, so each submit starts a new one.
    wait([pool.submit(all_started.wait) for _ in range(workers)])
    return pool


def warm_start(app: FastAPI) -> ThreadPoolExecutor:
    """Pay the gateway's one-time costs now (module docstring); returns the loop's new default executor,
    for the caller to shut down when the app stops."""
    pool = started_thread_pool(OFF_LOOP_THREADS, "gateway-off-loop")
    asyncio.get_running_loop().set_default_executor(pool)
    for name in dir(anyio):  # anyio imports the module behind a public name on its first use
        if not name.startswith("_"):
            getattr(anyio, name)
    endpoint_context = getattr(fastapi_routing, "_extract_endpoint_context", None)  # cached per endpoint
    if endpoint_context is not None:
        for route in app.routes:
            call = getattr(getattr(route, "dependant", None), "call", None)
            if call is not None:
                endpoint_context(call)
    return pool
