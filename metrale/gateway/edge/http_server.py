"""The gateway's HTTP server: ``uvicorn_config(app, settings, host=..., port=...)``, used by every command
that serves the gateway (``met gateway``, ``met serve``; ``met fleet up`` and the compose file run
``met gateway``).

It raises the process's open-file limit (``RLIMIT_NOFILE``) to its hard limit, caps the open connections
below what the process can open (``connection_guard.py``: its Redis connections and, in ``met serve``,
the worker's files keep ``FD_RESERVE`` descriptors), times out slow headers and stalled bodies
(``guarded_protocol.py``) and idle keep-alive connections (uvicorn's ``timeout_keep_alive``), and logs
these limits once at start.
"""

from __future__ import annotations

import logging
import resource

import uvicorn
from starlette.types import ASGIApp

from metrale.gateway.edge.connection_guard import ConnectionGuard
from metrale.gateway.edge.guarded_protocol import guarded_protocol
from metrale.shared.settings import GatewaySettings

logger = logging.getLogger(__name__)

FD_RESERVE = 2048
"""Descriptors kept out of the connection cap: the gateway's Redis pool (up to 1,024), the pub/sub
connection, and in ``met serve`` the worker's and batch runner's Redis connections, model files and
torch's."""
MIN_CONNECTIONS = 64


def uvicorn_config(app: ASGIApp, settings: GatewaySettings, *, host: str, port: int) -> uvicorn.Config:
    """A uvicorn config serving ``app`` on ``host``:``port`` within ``settings.http``'s limits."""
    open_files = raise_open_file_limit()
    limits = settings.http
    cap = connection_cap(limits.max_connections, open_files)
    logger.info(
        "HTTP limits: %d connections (%d open files), headers within %g s, bodies stalled at most %g s, "
        "keep-alive %d s",
        cap,
        open_files,
        limits.header_timeout_s,
        limits.body_timeout_s,
        limits.keep_alive_s,
    )
    if cap < limits.max_connections:
        logger.warning(
            "MET_HTTP_MAX_CONNECTIONS=%d is more than this process can open (%d files, %d kept for Redis and "
            "the rest): capped at %d",
            limits.max_connections,
            open_files,
            FD_RESERVE,
            cap,
        )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(ConnectionGuard(cap), limits),
        timeout_keep_alive=limits.keep_alive_s,
        log_level=settings.log_level.lower(),
        access_log=False,  # the app logs its own (``gateway/edge/access_log.py``)
    )


def connection_cap(wanted: int, open_files: int) -> int:
    """``wanted`` connections, or fewer when the process cannot open that many files beside ``FD_RESERVE``."""
    return min(wanted, max(MIN_CONNECTIONS, open_files - FD_RESERVE))


def raise_open_file_limit() -> int:
    """Raise ``RLIMIT_NOFILE``'s soft limit to the hard one (where the OS allows); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, error)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20
