"""``met gateway``: the OpenAI-compatible HTTP gateway in front of a Redis-backed worker fleet."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from metrale.cli.options import ReasoningParserOption, ToolCallParserOption


def gateway(
    redis: Annotated[
        str | None, typer.Option("--redis", help="Redis URL, e.g. redis://127.0.0.1:6379/0 (default: MET_REDIS_URL).")
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port to listen on.")] = 8000,
    tool_call_parser: ToolCallParserOption = None,
    reasoning_parser: ReasoningParserOption = None,
) -> None:
    """Serve /v1/chat/completions, /v1/completions and /v1/models for the workers behind Redis.

    API keys come from MET_API_KEYS ("key[:tenant],..."); without them the gateway is open.
    """
    import uvicorn

    from metrale.cli.errors import user_errors
    from metrale.gateway.app import create_app
    from metrale.gateway.edge.http_server import uvicorn_config
    from metrale.shared.settings import load_settings

    with user_errors(ValueError):  # a bad MET_* setting (MET_REDIS_URL among them) is a one-line error
        settings = load_settings().gateway()
    redis_url = redis or settings.redis_url
    if redis_url is None:
        raise typer.BadParameter("no Redis to talk to: pass --redis URL or set MET_REDIS_URL", param_hint="--redis")
    try:
        settings = dataclasses.replace(settings, redis_url=redis_url)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--redis") from None
    try:
        settings = dataclasses.replace(settings, tool_call_parser=tool_call_parser or settings.tool_call_parser)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--tool-call-parser") from None
    try:
        settings = dataclasses.replace(settings, reasoning_parser=reasoning_parser or settings.reasoning_parser)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--reasoning-parser") from None
    uvicorn.Server(uvicorn_config(create_app(settings, precheck_at_start=True), settings, host=host, port=port)).run()
