from __future__ import annotations

import pytest

from metrale.gateway.api.prepare.sampling import resolve_max_tokens, session_id_of
from metrale.shared.errors import BadRequest, PromptTooLong


@pytest.mark.parametrize(
    ("budget", "prompt_len", "expected"),
    [
        pytest.param(None, 10, 54, id="unset-takes-the-rest"),
        pytest.param(5, 10, 5, id="within-context"),
        pytest.param(54, 10, 54, id="exactly-fills-context"),
    ],
)
def test_max_tokens_within_the_context(budget: int | None, prompt_len: int, expected: int) -> None:
    assert resolve_max_tokens(budget, prompt_len, 64, prompt_param="prompt") == expected


@pytest.mark.parametrize(
    ("budget", "prompt_len", "needed", "param"),
    [
        pytest.param(None, 64, 64, "prompt", id="prompt-fills-context"),
        pytest.param(55, 10, 65, "max_tokens", id="budget-overflows"),
    ],
)
def test_max_tokens_past_the_context(budget: int | None, prompt_len: int, needed: int, param: str) -> None:
    with pytest.raises(PromptTooLong) as error:
        resolve_max_tokens(budget, prompt_len, 64, prompt_param="prompt")
    assert (error.value.limit, error.value.got, error.value.param) == (64, needed, param)


def test_the_body_session_wins_over_the_header() -> None:
    assert session_id_of("body", "header") == "body"
    assert session_id_of(None, "header") == "header"
    assert session_id_of(None, None) is None
    with pytest.raises(BadRequest):
        session_id_of(None, "has space")
