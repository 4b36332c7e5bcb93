from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from metrale.gateway.fleet.retry_promises import RetryPromises


def test_a_promise_counts_until_its_time_has_come() -> None:
    promises = RetryPromises()
    promises.promise(3.0, now=100.0)
    promises.promise(1.0, now=100.5)  # told to come back before the first one
    assert promises.outstanding(now=100.9) == 2
    assert promises.outstanding(now=101.5) == 1  # the second is due
    assert promises.outstanding(now=103.0) == 0  # the first too
    assert promises.outstanding(now=99.0) == 0  # what lapsed stays gone


@given(st.lists(st.tuples(st.floats(0, 100), st.integers(1, 60)), max_size=50), st.floats(0, 200))
def test_outstanding_is_the_promises_due_after_now(promised: list[tuple[float, int]], now: float) -> None:
    promises = RetryPromises()
    for at, retry_after_s in sorted(promised):
        promises.promise(retry_after_s, now=at)
    assert promises.outstanding(now=now) == sum(at + retry_after_s > now for at, retry_after_s in promised)
