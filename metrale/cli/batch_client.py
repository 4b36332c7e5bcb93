"""A gateway's Files and Batches API, as ``met batch`` uses it: plain httpx, batch objects as JSON
values, and every failure a ``GatewayError`` whose message fits on one line."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import httpx

TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
"""Statuses a batch never leaves."""
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")

Batch = dict[str, Any]
"""A batch object as the gateway answers it (OpenAI's ``batch``)."""


class GatewayError(Exception):
    """The gateway is unreachable or answered an error; the message says which, in one line."""


class BatchClient:
    """One gateway's ``/v1/files`` and ``/v1/batches``, with the API key's tenant."""

    def __init__(self, url: str, api_key: str | None, *, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=5.0))

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *_: object) -> None:
        self._http.close()

    def upload(self, path: Path) -> dict[str, Any]:
        """Upload ``path`` with ``purpose=batch`` (streamed, never read whole); its file object."""
        with path.open("rb") as source:
            files = {"file": (path.name, source, "application/jsonl")}
            return self._json("POST", "/v1/files", files=files, data={"purpose": "batch"})

    def create(self, input_file_id: str, endpoint: str) -> Batch:
        """A new batch of the uploaded file's lines."""
        body = {"input_file_id": input_file_id, "endpoint": endpoint, "completion_window": "24h"}
        return self._json("POST", "/v1/batches", json=body)

    def retrieve(self, batch_id: str) -> Batch:
        return self._json("GET", f"/v1/batches/{batch_id}")

    def list(self, limit: int) -> list[Batch]:
        """The tenant's newest ``limit`` batches."""
        answer = self._json("GET", "/v1/batches", params={"limit": limit})
        return list(answer["data"])

    def cancel(self, batch_id: str) -> Batch:
        return self._json("POST", f"/v1/batches/{batch_id}/cancel")

    def download(self, file_id: str, out: BinaryIO) -> int:
        """Copy a file's bytes to ``out``, chunk by chunk; how many."""
        written = 0
        with self._guard(), self._http.stream("GET", f"/v1/files/{file_id}/content") as response:
            if response.status_code != 200:
                response.read()
                raise GatewayError(_error_message(response))
            for chunk in response.iter_bytes():
                written += out.write(chunk)
        return written

    def wait(self, batch_id: str, on_update: Callable[[Batch], None], *, poll_s: float) -> Batch:
        """Poll the batch until it is final, calling ``on_update`` with every state seen; the last one."""
        while True:
            batch = self.retrieve(batch_id)
            on_update(batch)
            if batch["status"] in TERMINAL_STATUSES:
                return batch
            time.sleep(poll_s)

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        with self._guard():
            response = self._http.request(method, path, **kwargs)
        if response.status_code != 200:
            raise GatewayError(_error_message(response))
        try:
            answer: dict[str, Any] = response.json()
        except ValueError:
            raise GatewayError(f"{self.url}{path} answered something that is not JSON") from None
        return answer

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn a transport failure into ``GatewayError``."""
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise GatewayError(f"cannot reach the gateway at {self.url} (is it running? see --url)") from None
        except httpx.TransportError as error:
            raise GatewayError(f"the gateway at {self.url} did not answer: {error}") from None


def _error_message(response: httpx.Response) -> str:
    """``HTTP 404: No such batch: 'x'.`` — the OpenAI error's message when there is one."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:200] or response.reason_phrase
    return f"HTTP {response.status_code}: {message}"


def endpoint_of(path: Path) -> str | None:
    """The ``url`` of the file's first line, if it is a batch endpoint (the batch's endpoint, then)."""
    with path.open("rb") as lines:
        for raw in lines:
            if not raw.strip():
                continue
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                return None
            return url if url in ENDPOINTS else None
    return None
