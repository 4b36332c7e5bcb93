"""Refusing requests the fleet cannot start in time before doing any work on them.

While the fleet is full, a burst's excess would otherwise queue in the gateway behind the requests it
admitted (each parsed, rendered, tokenized and submitted), and its 429s would come only once the
gateway reached them. ``LoadShedding`` is the outermost layer of the app (``GatewayApp``), in front of
the generation routes: it asks admission control for the refusal any request arriving now would get
(``FleetAdmission.refusal_now``: judged without waiting on Redis, behind the requests that arrived
before it and are not judged yet, and the backlog estimated from the newest read of the streams) and,
when there is one and the request carries a valid key, answers it at once, before its body is read,
counting it in ``metrale_requests_total`` and ``queue_full_rejections``.

Every other request goes on to its route, which judges it on a read of its own (``fleet_place``);
until then it counts as ahead of later arrivals (``arrivals.py``), and it waits for the arrivals at
the door to be judged first (``Arrivals.settled``): a burst's refusals go out before the gateway
spends its time on what it admitted.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from metrale.gateway.edge.access_log import AccessLog, AccessLogged
from metrale.gateway.edge.auth import authorization_header
from metrale.gateway.edge.health_first import HealthFirst
from metrale.gateway.errors import error_response
from metrale.gateway.state import Gateway
from metrale.shared.errors import BadRequest, Unauthorized


class LoadShedding:
    """Answers 429 (with ``Retry-After``) to ``POST`` s on ``endpoints`` (path -> metrics label) while
    the fleet is full."""

    def __init__(self, app: ASGIApp, *, gateway: Gateway, endpoints: Mapping[str, str]) -> None:
        self._app = app
        self._gateway = gateway
        self._endpoints = dict(endpoints)
        self._refusals: dict[float, ASGIApp] = {}  # by Retry-After: the same answer each time

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self._endpoints.get(scope["path"]) if scope["type"] == "http" else None
        if scope["type"] == "http" and self._gateway.auth.required:
            try:
                authorization_header(scope["headers"])
            except BadRequest as error:  # every route, before anything else: no tenant to serve
                if endpoint is not None:
                    self._gateway.metrics.requests.labels(endpoint=endpoint, status=str(error.status)).inc()
                await error_response(error)(scope, receive, send)
                return
        if endpoint is None or scope["method"] != "POST":
            await self._app(scope, receive, send)
            return
        fleet = self._gateway.admission.fleet
        refusal = fleet.refusal_now()
        if refusal is not None and self._authorized(scope):
            self._gateway.admission.count_fleet_refusal(refusal)
            self._gateway.metrics.requests.labels(endpoint=endpoint, status=str(refusal.status)).inc()
            answer = self._refusals.get(refusal.retry_after_s)
            if answer is None:
                answer = self._refusals[refusal.retry_after_s] = error_response(refusal)
            await answer(scope, receive, send)
            return
        with fleet.arrivals.arrived():
            await fleet.arrivals.settled()
            await self._app(scope, receive, send)  # (a missing or wrong key gets its 401 there)

    def _authorized(self, scope: Scope) -> bool:
        try:
            self._gateway.auth.tenant_for(authorization_header(scope["headers"]))
        except Unauthorized:
            return False
        return True


class GatewayApp(FastAPI):
    """The gateway's FastAPI app, with ``LoadShedding`` around its whole middleware stack (a refusal on
    arrival costs only the server's own parsing of the request line and headers) and the access log
    around that (``access_log.py``); ``GET /health`` is answered before load shedding (``health_first.py``)."""

    def __init__(
        self, *, gateway: Gateway, endpoints: Mapping[str, str], access_log: AccessLog, **kwargs: object
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._shed_for = (gateway, dict(endpoints))
        self._access_log = access_log

    def build_middleware_stack(self) -> ASGIApp:
        gateway, endpoints = self._shed_for
        shedding = LoadShedding(super().build_middleware_stack(), gateway=gateway, endpoints=endpoints)
        return AccessLogged(HealthFirst(shedding), log=self._access_log)
