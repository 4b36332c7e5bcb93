"""``GET /health`` is answered by the outermost layer, without the app behind it."""

from __future__ import annotations

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from metrale.gateway.health_first import HealthFirst

pytestmark = pytest.mark.anyio


async def stuck_app(scope: Scope, receive: Receive, send: Send) -> None:
    """An app busy elsewhere: anything that reaches it fails."""
    raise AssertionError(f"{scope['method']} {scope['path']} reached the app")


async def test_health_is_answered_without_the_app() -> None:
    transport = httpx.ASGITransport(app=HealthFirst(stuck_app))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        response = await client.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert response.headers["content-type"] == "application/json"


async def test_every_other_request_goes_to_the_app() -> None:
    transport = httpx.ASGITransport(app=HealthFirst(stuck_app))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        for method, path in [("POST", "/health"), ("GET", "/ready"), ("GET", "/healthz")]:
            with pytest.raises(AssertionError, match="reached the app"):
                await client.request(method, path)
