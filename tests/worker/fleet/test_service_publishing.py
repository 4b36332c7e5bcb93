"""The worker loop steps on while a step's events are on their way to Redis, and still hands a request
back, and exits, only once everything it produced for it is written."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

from metrale.shared.messages import FinishReason, TokenEvent
from metrale.worker.fleet.service import Worker
from metrale.worker.fleet.transport import FinishedRequest, InMemoryTransport
from tests.worker.worker_helpers import (
    announcement,
    expected_choice,
    generate_request,
    join_worker,
    make_engine,
    run_worker,
    start_worker,
    tokens_of,
    wait_for,
    worker_settings,
)

PUBLISH_S = 0.03
"""How long each write takes here, from its start: far longer than a step of the fake model."""


class SlowTransport(InMemoryTransport):
    """Each write started by ``start_publish`` is done ``PUBLISH_S`` after its start; logs the forwards
    run meanwhile, what was published of each request when it was handed back, and what was published
    when the worker closed."""

    def __init__(self, forwards: list[object], stop: threading.Event, finish_after: int | None = None) -> None:
        super().__init__()
        self._forwards = forwards
        self.stop = stop
        self.finish_after = finish_after
        self.forwards_during_publish: list[int] = []
        self.published_at_hand_back: dict[str, int] = {}
        self.published_at_close: int | None = None

    def start_publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> Callable[[], None]:
        started, before = time.monotonic(), len(self._forwards)

        def written() -> None:
            time.sleep(max(0.0, started + PUBLISH_S - time.monotonic()))
            self.publish(events, finished)
            self.forwards_during_publish.append(len(self._forwards) - before)

        return written

    def publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> None:
        super().publish(events, finished)
        if self.finish_after is not None and len(self.finished) >= self.finish_after:
            self.stop.set()

    def hand_back(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.published_at_hand_back[request_id] = len(self.events_of(request_id))
        super().hand_back(request_ids)

    def close(self) -> None:
        self.published_at_close = len(self.events)
        super().close()

    def events_of(self, request_id: str) -> list[TokenEvent]:
        return [event for event in self.events if event.request_id == request_id]


def test_the_loop_steps_on_while_a_step_is_published() -> None:
    engine, model = make_engine()
    stop = threading.Event()
    transport = SlowTransport(model.forwards, stop, finish_after=1)
    message = generate_request("r", max_tokens=20, ignore_eos=True)
    transport.submit(message)

    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    assert max(transport.forwards_during_publish) >= 1  # the next step ran while this one was written
    events = transport.events_of("r")
    assert [event.seq for event in events] == list(range(len(events)))
    assert tokens_of(events, 0) == expected_choice(message, 0)[0]
    assert events[-1].finish_reason is FinishReason.LENGTH


def test_a_request_is_handed_back_only_once_all_its_events_are_published() -> None:
    engine, model = make_engine()
    stop = threading.Event()
    transport = SlowTransport(model.forwards, stop)
    transport.submit(generate_request("r", max_tokens=60, ignore_eos=True))
    settings = dataclasses.replace(worker_settings(), drain_handoff=True)
    worker = Worker(engine, transport, settings, worker_id="w", model=announcement())
    thread = start_worker(worker, stop)
    wait_for(lambda: len(transport.events_of("r")) >= 3, "the first events")
    stop.set()  # a write is in flight: the loop has produced more than it has written
    join_worker(thread, stop)

    events = transport.events_of("r")
    assert transport.handed_back == ["r"]
    assert transport.published_at_hand_back == {"r": len(events)}  # none written after the hand-back
    assert [event.seq for event in events] == list(range(len(events)))
    assert not any(event.finished for event in events) and transport.finished == []
    assert worker.failover.handed_back_requests == 1


def test_the_worker_exits_only_once_everything_it_produced_is_published() -> None:
    engine, model = make_engine()
    stop = threading.Event()
    transport = SlowTransport(model.forwards, stop)
    messages = [generate_request(f"r{i}", (i + 1, 2), max_tokens=8, ignore_eos=True) for i in range(3)]
    for message in messages:
        transport.submit(message)
    worker = Worker(engine, transport, worker_settings(), worker_id="w", model=announcement())
    thread = start_worker(worker, stop)
    wait_for(lambda: bool(transport.events), "the first events")
    stop.set()  # drain: finish all three, publish everything, then exit
    join_worker(thread, stop)

    assert transport.published_at_close == len(transport.events)
    for message in messages:
        events = transport.events_of(message.request_id)
        assert [event.seq for event in events] == list(range(len(events)))
        assert tokens_of(events, 0) == expected_choice(message, 0)[0]
    assert sorted(done.request_id for done in transport.finished) == ["r0", "r1", "r2"]
