from __future__ import annotations

import asyncio
import sys
import threading

from fastapi import FastAPI
from fastapi import routing as fastapi_routing

from metrale.gateway.warm_start import OFF_LOOP_THREADS, started_thread_pool, warm_start
from metrale.shared.ids import random_hex


def test_every_thread_of_the_pool_is_running_before_any_work() -> None:
    pool = started_thread_pool(4, "warm-test")
    try:
        names = {thread.name for thread in threading.enumerate() if thread.name.startswith("warm-test")}
        assert len(names) == 4
    finally:
        pool.shutdown()


def test_warm_start_sets_a_started_default_executor_and_loads_what_first_requests_would() -> None:
    app = FastAPI()

    @app.get("/thing")
    def thing() -> dict[str, str]:
        return {}

    async def started() -> None:
        pool = warm_start(app)
        try:
            assert await asyncio.to_thread(threading.current_thread) is not threading.main_thread()
            running = [thread for thread in threading.enumerate() if thread.name.startswith("gateway-off-loop")]
            assert len(running) == OFF_LOOP_THREADS
        finally:
            pool.shutdown()

    asyncio.run(started())
    assert "anyio.streams.memory" in sys.modules  # imported at start, not by a first request
    assert id(thing) in fastapi_routing._endpoint_context_cache


def test_random_ids_are_hex_and_distinct() -> None:
    ids = [random_hex() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    assert all(len(value) == 32 and int(value, 16) >= 0 for value in ids)
    assert len(random_hex(12)) == 24
