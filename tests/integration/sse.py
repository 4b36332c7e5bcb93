"""Reading an OpenAI-style SSE stream the way a client does, keeping every chunk in arrival order."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

DONE = "[DONE]"


@dataclass(frozen=True)
class StreamedCompletion:
    """Every chunk of one streamed ``/v1/completions`` response, in the order received."""

    chunks: list[dict[str, Any]]
    done: bool
    """Whether the stream ended with ``data: [DONE]``."""

    @property
    def request_id(self) -> str:
        """The response id, which is also the request's id in Redis; checked to be the same in every chunk."""
        (request_id,) = {chunk["id"] for chunk in self.chunks}
        return str(request_id)

    def choice_chunks(self, index: int = 0) -> list[dict[str, Any]]:
        """The choice objects of choice ``index``, one per chunk that carried it."""
        return [choice for chunk in self.chunks for choice in chunk["choices"] if choice["index"] == index]

    def token_texts(self, index: int = 0) -> list[list[str]]:
        """Per chunk of choice ``index``: the texts of the tokens it carried (from its logprobs)."""
        return [choice["logprobs"]["tokens"] for choice in self.choice_chunks(index)]

    def finish_reasons(self, index: int = 0) -> list[str]:
        """Every finish reason choice ``index`` reported (exactly one when the stream is well formed)."""
        return [choice["finish_reason"] for choice in self.choice_chunks(index) if choice["finish_reason"]]

    @property
    def usage(self) -> dict[str, Any] | None:
        """The usage of the last chunk, if it carried one."""
        return self.chunks[-1].get("usage") if self.chunks else None


async def stream_completion(client: httpx.AsyncClient, body: dict[str, Any]) -> StreamedCompletion:
    """POST ``body`` (with ``stream`` on) to ``/v1/completions`` and read the stream to its end."""
    chunks: list[dict[str, Any]] = []
    done = False
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            raise AssertionError(f"HTTP {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            assert not done, "an event after [DONE]"
            if payload == DONE:
                done = True
            else:
                chunks.append(json.loads(payload))
    return StreamedCompletion(chunks, done)
