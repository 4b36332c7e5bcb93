"""``met chat``: an interactive terminal chat that streams from a gateway and keeps the history."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from metrale.cli.errors import stderr
from metrale.cli.sse_lines import iter_sse_lines

if TYPE_CHECKING:
    import httpx

# httpx is imported inside the command: ``met --help`` must not load it.

console = Console(highlight=False)


def chat(
    url: Annotated[str, typer.Option(help="Gateway base URL.")] = "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(help="Model name; default: the first the gateway serves.")] = None,
    system: Annotated[str | None, typer.Option(help="A system prompt for the conversation.")] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="MET_API_KEY", help="API key, if the gateway wants one.")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens per reply.")] = 256,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")] = 0.7,
) -> None:
    """Chat with a model in the terminal, each reply streamed.

    The conversation is one session, so the model resumes from its checkpoint instead of re-reading the
    history. An empty line or Ctrl-D ends it.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    session = f"chat-{uuid.uuid4().hex[:12]}"
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(600.0, connect=5.0)) as client:
        name = model or _first_model(client)
        stderr.print(f"chatting with [bold]{name}[/] at {url} (session {session}); empty line to quit")
        while (text := _read_turn()) is not None:
            messages.append({"role": "user", "content": text})
            body = {
                "model": name,
                "messages": messages,
                "stream": True,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "session": session,
            }
            reply = "".join(_print_stream(client, body))
            messages.append({"role": "assistant", "content": reply})


def _read_turn() -> str | None:
    try:
        text = console.input("[bold green]you>[/] ")
    except (EOFError, KeyboardInterrupt):
        return None
    return text or None


def _first_model(client: httpx.Client) -> str:
    import httpx

    try:
        response = client.get("/v1/models")
        response.raise_for_status()
        models = response.json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        stderr.print(f"[bold red]error:[/] cannot list models at {client.base_url}: {exc}")
        raise typer.Exit(1) from None
    if not models:
        stderr.print("[bold red]error:[/] the gateway serves no model (is a worker running?)")
        raise typer.Exit(1)
    return str(models[0]["id"])


def _print_stream(client: httpx.Client, body: dict[str, object]) -> Iterator[str]:
    import httpx

    console.print("[bold blue]model>[/] ", end="")
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                console.print(f"[red]{_error_message(response)}[/]")
                return
            for line in iter_sse_lines(response.iter_text()):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                console.print(delta, end="", markup=False)
                yield delta
    except httpx.HTTPError as exc:
        console.print(f"[red]connection error: {exc}[/]")
    console.print()


def _error_message(response: httpx.Response) -> str:
    try:
        return f"{response.status_code}: {response.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code}: {response.text[:200]}"
