from __future__ import annotations

from collections import Counter

from metrale.gateway.fleet.unseen_admissions import STALE_S, UnseenAdmissions
from metrale.shared.messages import Priority


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_admission_counts_until_a_read_begun_after_its_xadd() -> None:
    clock = Clock()
    unseen = UnseenAdmissions(clock)
    unseen.admit("r1", Priority.INTERACTIVE)
    unseen.admit("r2", Priority.BATCH)
    read_began = clock.now
    clock.now += 0.01
    unseen.submitted("r1")  # after that read began: it may not show r1
    assert unseen.unseen_by(read_began) == Counter({Priority.INTERACTIVE: 1, Priority.BATCH: 1})
    clock.now += 0.01
    assert unseen.unseen_by(clock.now) == Counter({Priority.BATCH: 1})  # a later read shows r1
    assert len(unseen) == 1


def test_withdrawn_and_stale_admissions_stop_counting() -> None:
    clock = Clock()
    unseen = UnseenAdmissions(clock)
    unseen.admit("refused-later", Priority.INTERACTIVE)
    unseen.admit("lost", Priority.INTERACTIVE)
    unseen.withdraw("refused-later")
    assert unseen.unseen_by(clock.now) == Counter({Priority.INTERACTIVE: 1})
    clock.now += STALE_S + 1
    assert unseen.unseen_by(clock.now) == Counter()


def test_withdrawing_a_submitted_request_changes_nothing() -> None:
    clock = Clock()
    unseen = UnseenAdmissions(clock)
    unseen.admit("r1", Priority.INTERACTIVE)
    unseen.submitted("r1")
    unseen.withdraw("r1")  # it is on the stream: reads that began before its XADD still miss it
    assert unseen.unseen_by(clock.now - 1) == Counter({Priority.INTERACTIVE: 1})
    unseen.submitted("never-admitted")
    assert len(unseen) == 1
