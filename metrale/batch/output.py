"""A batch's output and error files, in the input's line order.

Lines answered 200 go to the output file; lines answered with an error go to the error file, as do
lines that never ran because the batch expired (``batch_expired``) or was cancelled
(``batch_cancelled``). A file is only made when it has lines.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import BinaryIO

from metrale.batch.input_lines import BatchLine
from metrale.batch.line_request import unanswered_line
from metrale.gateway.batches.file_store import FileStore
from metrale.gateway.batches.objects import Batch, BatchStatus

UNANSWERED = {
    BatchStatus.EXPIRED: ("batch_expired", "This request could not be executed before the completion window expired."),
    BatchStatus.CANCELLED: ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}


async def write_outputs(
    files: FileStore,
    tenant: str,
    batch: Batch,
    lines: Sequence[BatchLine],
    kept: Mapping[str, str],
    *,
    unanswered: BatchStatus,
) -> dict[str, str]:
    """Write the files; ``{"output_file_id": ..., "error_file_id": ...}`` for those made."""
    code, message = UNANSWERED.get(unanswered, ("batch_failed", "This request was not executed."))
    output: list[str] = []
    errors: list[str] = []
    for line in lines:
        text = kept.get(line.custom_id)
        if text is None:
            errors.append(unanswered_line(batch, line, code=code, message=message))
        elif json.loads(text)["response"]["status_code"] == 200:
            output.append(text)
        else:
            errors.append(text)
    file_ids: dict[str, str] = {}
    for field, name, chosen in (("output_file_id", "output", output), ("error_file_id", "error", errors)):
        if chosen:
            made = await files.create(
                tenant, _writer(chosen), filename=f"{batch.id}_{name}.jsonl", purpose="batch_output"
            )
            file_ids[field] = made.id
    return file_ids


def _writer(lines: Sequence[str]) -> Callable[[BinaryIO], None]:
    def write(out: BinaryIO) -> None:
        for line in lines:
            out.write(line.encode() + b"\n")

    return write
