from __future__ import annotations

from metrale.gateway.fleet.requested_tokens import RequestedTokens


def test_the_mean_of_the_recent_requests_that_set_a_limit() -> None:
    requested = RequestedTokens(window=3)
    assert requested.mean() is None
    for tokens in (10, None, 20, 0, 30):
        requested.note(tokens)
    assert requested.mean() == 20.0
    requested.note(100)  # 10 leaves the window
    assert requested.mean() == 50.0
