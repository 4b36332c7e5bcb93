"""``met gateway``: settings from the flags and the environment, uvicorn started with the app."""

from __future__ import annotations

import re
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from typer.testing import CliRunner

from metrale.cli.main import app

runner = CliRunner()


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The config ``uvicorn.Server.run`` was called with (it is not really started)."""
    calls: dict[str, Any] = {}

    def run(server: uvicorn.Server) -> None:
        config = server.config
        calls.update(app=config.app, host=config.host, port=config.port, config=config)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.delenv("MET_REDIS_URL", raising=False)
    return calls


def test_serves_the_gateway_app_on_the_given_address(served: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MET_API_KEYS", "sk-1:acme")
    result = runner.invoke(app, ["gateway", "--redis", "redis://127.0.0.1:6379/3", "--port", "9001"])
    assert result.exit_code == 0, result.output
    assert (served["host"], served["port"]) == ("127.0.0.1", 9001)
    assert isinstance(served["app"], FastAPI)
    settings = served["app"].state.gateway.settings
    assert settings.redis_url == "redis://127.0.0.1:6379/3"
    assert dict(settings.api_keys) == {"sk-1": "acme"}


def test_the_server_has_the_connection_limits(served: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MET_HTTP_KEEP_ALIVE_S", "7")
    monkeypatch.setenv("MET_HTTP_MAX_CONNECTIONS", "300")
    monkeypatch.setenv("MET_HTTP_HEADER_TIMEOUT_S", "2.5")
    result = runner.invoke(app, ["gateway", "--redis", "redis://127.0.0.1:6379/3"])
    assert result.exit_code == 0, result.output
    config = served["config"]
    assert config.timeout_keep_alive == 7
    assert config.http.guard.max_connections == 300
    assert config.http.limits.header_timeout_s == 2.5


def test_the_redis_url_may_come_from_the_environment(served: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MET_REDIS_URL", "redis://redis.internal:6379/0")
    result = runner.invoke(app, ["gateway"])
    assert result.exit_code == 0, result.output
    assert served["app"].state.gateway.settings.redis_url == "redis://redis.internal:6379/0"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param([], "pass --redis URL or set MET_REDIS_URL", id="no-redis"),
        pytest.param(["--redis", "http://nope"], "redis_url: a Redis URL starts with one of", id="not-a-redis-url"),
        pytest.param(["--redis", "redis+sentinel://s1,s2"], "names its service", id="sentinels-without-service"),
    ],
)
def test_a_missing_or_bad_redis_url_is_a_usage_error(served: dict[str, Any], args: list[str], message: str) -> None:
    result = runner.invoke(app, ["gateway", *args])
    assert result.exit_code == 2
    assert message in re.sub(r"[\s│╭╮╰╯─]+", " ", result.output)  # the text without rich's panel
    assert served == {}


def test_the_tool_call_parser_comes_from_the_flag_or_the_environment(
    served: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    result = runner.invoke(app, ["gateway", "--redis", "redis://127.0.0.1:6379/3", "--tool-call-parser", "hermes"])
    assert result.exit_code == 0, result.output
    assert served["app"].state.gateway.settings.tool_call_parser == "hermes"
    monkeypatch.setenv("MET_TOOL_CALL_PARSER", "kimi_k2")
    result = runner.invoke(app, ["gateway", "--redis", "redis://127.0.0.1:6379/3"])
    assert result.exit_code == 0, result.output
    assert served["app"].state.gateway.settings.tool_call_parser == "kimi_k2"


def test_an_unknown_tool_call_parser_is_a_usage_error(served: dict[str, Any]) -> None:
    result = runner.invoke(app, ["gateway", "--redis", "redis://127.0.0.1:6379/3", "--tool-call-parser", "nope"])
    assert result.exit_code == 2
    assert "unknown tool-call parser 'nope'" in result.output and "kimi_k2, hermes" in result.output
    assert served == {}


def test_the_reasoning_parser_comes_from_the_flag_and_an_unknown_one_is_a_usage_error(
    served: dict[str, Any],
) -> None:
    result = runner.invoke(app, ["gateway", "--redis", "redis://127.0.0.1:6379/3", "--reasoning-parser", "qwen3"])
    assert result.exit_code == 0, result.output
    assert served["app"].state.gateway.settings.reasoning_parser == "qwen3"
    served.clear()
    result = runner.invoke(app, ["gateway", "--redis", "redis://127.0.0.1:6379/3", "--reasoning-parser", "nope"])
    assert result.exit_code == 2
    assert "unknown reasoning parser 'nope'" in result.output and "qwen3, deepseek_r1" in result.output
    assert served == {}
