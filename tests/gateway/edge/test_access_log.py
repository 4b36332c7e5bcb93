"""The gateway's access log: a line per response, 429s counted; served by a real uvicorn server."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from metrale.gateway.edge.access_log import AccessLog, AccessLogged, access_logger, written_by_a_thread
from metrale.shared.messages import Priority
from tests.gateway.api.test_admission import beat, chat
from tests.gateway.harness import gateway_harness
from tests.integration.processes import free_port

pytestmark = pytest.mark.anyio


def logged_app(log: AccessLog) -> AccessLogged:
    async def busy(_: Request) -> PlainTextResponse:
        return PlainTextResponse("busy", status_code=429, headers={"Retry-After": "1"})

    async def ok(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        reports = asyncio.create_task(log.report())
        try:
            yield
        finally:
            await log.stop(reports)

    return AccessLogged(Starlette(routes=[Route("/busy", busy), Route("/ok", ok)], lifespan=lifespan), log=log)


async def test_a_servers_429s_are_counted_in_one_line_and_its_other_responses_logged_one_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=access_logger.name)
    port = free_port()
    config = uvicorn.Config(logged_app(AccessLog()), host="127.0.0.1", port=port, log_config=None, access_log=False)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.01)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        statuses = [(await client.get(path)).status_code for path in ["/busy"] * 5 + ["/ok?x=1", "/nowhere"]]
        lines_while_serving = [record.getMessage() for record in caplog.records]
    server.should_exit = True
    await serving

    assert statuses == [429] * 5 + [200, 404]
    assert len(lines_while_serving) == 2, lines_while_serving
    assert lines_while_serving[0].startswith("127.0.0.1:") and '"GET /ok?x=1 HTTP/1.1" 200' in lines_while_serving[0]
    assert '"GET /nowhere HTTP/1.1" 404' in lines_while_serving[1]
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3 and lines[2].startswith("answered 5 requests with 429"), lines


async def test_reports_come_while_refusals_last_and_stop_when_they_do(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=access_logger.name)
    log = AccessLog()
    reports = asyncio.create_task(log.report(every_s=0.05))
    for _ in range(3):
        log.refused()
    await asyncio.sleep(0.12)  # two report intervals: one line for the three, none for the quiet one
    await log.stop(reports)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("answered 3 requests with 429"), lines


async def test_the_gateway_logs_its_load_shedding_refusals_as_a_count(caplog: pytest.LogCaptureFixture) -> None:

    caplog.set_level(logging.INFO, logger=access_logger.name)
    async with gateway_harness(worker_running=False, max_queue_wait_s=5.0) as h:
        await beat(h, slots=2, finished=10, slot_ms=10_000)
        for _ in range(20):
            await h.redis.xadd(h.keys.request_stream(Priority.INTERACTIVE), {"msg": b"waiting"})
        statuses = [(await h.http.post("/v1/chat/completions", json=chat())).status_code for _ in range(3)]
        health = await h.http.get("/health")
    assert statuses == [429, 429, 429] and health.status_code == 200
    lines = [record.getMessage() for record in caplog.records if record.name == access_logger.name]
    assert len(lines) == 2 and '"GET /health HTTP/1.1" 200' in lines[0], lines
    assert lines[1].startswith("answered 3 requests with 429"), lines


class ThreadsSeen(logging.Handler):
    """Records each line with the name of the thread that wrote it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.getMessage(), threading.current_thread().name))


def test_while_written_by_a_thread_every_line_reaches_the_handlers_from_another_thread() -> None:
    seen = ThreadsSeen()
    root = logging.getLogger()
    root.addHandler(seen)
    level = access_logger.level
    access_logger.setLevel(logging.INFO)
    try:
        with written_by_a_thread():
            for n in range(200):
                access_logger.info("line %d", n)
        access_logger.info("after")
    finally:
        access_logger.setLevel(level)
        root.removeHandler(seen)
    assert [line for line, _ in seen.lines] == [f"line {n}" for n in range(200)] + ["after"]
    here = threading.current_thread().name
    assert all(thread != here for _, thread in seen.lines[:-1])
    assert seen.lines[-1][1] == here  # closed: the logger propagates as before
