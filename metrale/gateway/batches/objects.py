"""The OpenAI objects of the Files and Batches APIs, and how a batch is kept in its Redis hash."""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, Field


class BatchStatus(StrEnum):
    """Where a batch is in its life (OpenAI's statuses); written to the batch hash."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """Whether the batch will never change again."""
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
"""The endpoints a batch may run."""


class FileObject(BaseModel):
    """``file``: an uploaded input or a batch's output, owned by one tenant."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class BatchError(BaseModel):
    """One reason a batch failed validation; ``line`` counts from 1."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    """Lines in the input (``total``), answered 2xx (``completed``) and answered with an error (``failed``)."""

    total: int = 0
    completed: int = 0
    failed: int = 0


_TIMES = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
_STRINGS = ("endpoint", "input_file_id", "completion_window", "output_file_id", "error_file_id")


class Batch(BaseModel):
    """``batch``: a file of requests run offline."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None

    def to_fields(self) -> dict[str, str]:
        """The batch as its Redis hash (absent values left out)."""
        fields = {"id": self.id, "status": self.status.value}
        fields |= {name: str(getattr(self, name)) for name in (*_TIMES, *_STRINGS) if getattr(self, name) is not None}
        counts = self.request_counts
        fields |= {"total": str(counts.total), "completed": str(counts.completed), "failed": str(counts.failed)}
        if self.errors is not None:
            fields["errors"] = self.errors.model_dump_json()
        if self.metadata is not None:
            fields["metadata"] = json.dumps(self.metadata)
        return fields

    @classmethod
    def from_fields(cls, raw: Mapping[Any, Any]) -> Batch:
        """The batch from its Redis hash (bytes or text)."""
        text = {text_of(name): text_of(value) for name, value in raw.items()}
        values: dict[str, Any] = {name: text[name] for name in ("id", "status", *_STRINGS) if name in text}
        values |= {name: int(text[name]) for name in _TIMES if name in text}
        values["request_counts"] = RequestCounts(
            total=int(text.get("total", 0)), completed=int(text.get("completed", 0)), failed=int(text.get("failed", 0))
        )
        if "errors" in text:
            values["errors"] = BatchErrors.model_validate_json(text["errors"])
        if "metadata" in text:
            values["metadata"] = json.loads(text["metadata"])
        return cls.model_validate(values)


def text_of(value: bytes | str) -> str:
    """A Redis reply as text."""
    return value.decode() if isinstance(value, bytes) else value
