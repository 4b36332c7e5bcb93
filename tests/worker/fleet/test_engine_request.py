"""``engine_request``: a ``GenerateRequest``'s per-request switches reach the engine's ``SamplingParams``."""

from __future__ import annotations

import pytest

from metrale.shared.messages import GenerateRequest
from metrale.worker.fleet.admission import engine_request


@pytest.mark.parametrize("speculative", [True, False])
def test_speculative_reaches_the_sampling_params(speculative: bool) -> None:
    message = GenerateRequest("r-1", "tiny", "acme", [1, 2, 3], max_tokens=4, speculative=speculative)
    assert engine_request(message).params.speculative is speculative
