"""Refusing requests the fleet cannot start in time before doing any work on them.

While the fleet is full, a burst's excess would otherwise queue in the gateway behind the requests it
admitted (each parsed, rendered, tokenized and submitted), and its 429s would come only once the
gateway reached them. ``LoadShedding`` sits in front of the generation routes: it asks admission
control for the refusal any request arriving now would get (``FleetAdmission.refusal_now``: judged
without waiting on Redis, behind the requests that arrived before it and are not judged yet, and a
recent read of the streams if there is one) and, when there is one and the request carries a valid
key, answers it at once, before its body is read. Every other request goes on to its route, which
judges it on a read of its own (``fleet_place``); until then it counts as ahead of later arrivals
(``arrivals.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from metrale.gateway.errors import error_response
from metrale.gateway.state import Gateway
from metrale.shared.errors import Unauthorized


class LoadShedding:
    """Answers 429 (with ``Retry-After``) to ``POST`` s on ``paths`` while the fleet is full."""

    def __init__(self, app: ASGIApp, *, gateway: Gateway, paths: Collection[str]) -> None:
        self._app = app
        self._gateway = gateway
        self._paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self._paths:
            await self._app(scope, receive, send)
            return
        fleet = self._gateway.admission.fleet
        refusal = fleet.refusal_now()
        if refusal is not None and self._authorized(scope):
            self._gateway.admission.count_fleet_refusal()
            await error_response(refusal)(scope, receive, send)
            return
        with fleet.arrivals.arrived():  # until its route judges it, it is ahead of every later arrival
            # The arrivals behind it are judged here before it is worked on: a burst's excess is
            # refused before the gateway spends its time on what it admitted.
            await asyncio.sleep(0)
            await self._app(scope, receive, send)  # (a missing or wrong key gets its 401 there)

    def _authorized(self, scope: Scope) -> bool:
        authorization = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        try:
            self._gateway.auth.tenant_for(authorization.decode("latin-1") if authorization is not None else None)
        except Unauthorized:
            return False
        return True
