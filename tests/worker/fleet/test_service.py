"""The worker loop on the recording fake model: events, errors, cancellation, capacity, drain, outages.

The reference for every token is ``isolated_run``: one choice alone on a fresh fake, so whatever the
worker's batching did, each choice must read exactly the same.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest

from metrale.shared.messages import ControlAction, FinishReason, Priority, TokenEvent, WorkerControl, WorkerState
from metrale.worker.engine.request import Request
from metrale.worker.fleet.admission import seed_for
from metrale.worker.fleet.service import Worker
from metrale.worker.fleet.transport import FinishedRequest, InMemoryTransport, Received, TransportError
from tests.worker.fakes import VOCAB_SIZE
from tests.worker.worker_helpers import (
    MODEL,
    announcement,
    expected_choice,
    generate_request,
    make_engine,
    run_worker,
    tokens_of,
    worker_settings,
)


class ScriptedTransport(InMemoryTransport):
    """Sets ``stop`` once ``finish_after`` requests have finished; calls ``on_publish`` after each
    publish (on the worker's publishing thread); logs every ``receive`` as ``(max_new, taken, requests
    in flight before it)``, counting as finished what ``finished_count`` says (default: those published)."""

    def __init__(self, stop: threading.Event, finish_after: int | None = None) -> None:
        super().__init__()
        self.stop = stop
        self.finish_after = finish_after
        self.on_publish: Callable[[ScriptedTransport], None] | None = None
        self.finished_count: Callable[[], int] = lambda: len(self.finished)
        self.receives: list[tuple[int, int, int]] = []

    def receive(self, max_new: int, block_ms: int, *, max_interactive: int | None = None) -> list[Received]:
        in_flight = sum(taken for _, taken, _ in self.receives) - self.finished_count()
        taken = super().receive(max_new, block_ms, max_interactive=max_interactive)
        self.receives.append((max_new, len(taken), in_flight))
        return taken

    def publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> None:
        super().publish(events, finished)
        if self.on_publish is not None:
            self.on_publish(self)
        if self.finish_after is not None and len(self.finished) >= self.finish_after:
            self.stop.set()

    def events_of(self, request_id: str) -> list[TokenEvent]:
        return [event for event in self.events if event.request_id == request_id]

    def finished_of(self, request_id: str) -> FinishedRequest:
        (done,) = [done for done in self.finished if done.request_id == request_id]
        return done


# --- what a request's events carry ----------------------------------------------------------------


def test_events_match_an_isolated_run_and_seq_counts_across_choices() -> None:
    engine, _ = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=2)
    messages = [generate_request("two-choices", n=2, max_tokens=8, seed=11), generate_request("one", (4, 5), seed=3)]
    for message in messages:
        transport.submit(message)

    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    for message in messages:
        events = transport.events_of(message.request_id)
        assert [event.seq for event in events] == list(range(len(events)))
        for choice in range(message.n):
            tokens, reason = expected_choice(message, choice)
            (final,) = [event for event in events if event.index == choice and event.finished]
            assert tokens_of(events, choice) == tokens
            assert final.finish_reason is reason
            assert final.usage is not None
            assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (
                len(message.prompt_token_ids),
                len(tokens),
            )
        assert transport.finished_of(message.request_id).finish_reason is expected_choice(message, 0)[1]
    assert transport.closed


def test_each_step_is_published_once_with_one_event_per_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=3)
    steps_with_output = []
    step = engine.step

    def counted_step() -> Any:
        outputs = step()
        steps_with_output.append(any(o.token_ids or o.finished for o in outputs))
        return outputs

    monkeypatch.setattr(engine, "step", counted_step)
    for i in range(3):
        transport.submit(generate_request(f"r{i}", (i + 1, 2), n=2))

    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    assert len(transport.publishes) == sum(steps_with_output)
    for events, _ in transport.publishes:
        choices = [(event.request_id, event.index) for event in events]
        assert len(choices) == len(set(choices))


def test_prompt_logprobs_go_out_before_the_first_token_each_position_once() -> None:
    engine, model = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=1)
    prompt = (1, 2, 3, 4, 5)
    transport.submit(generate_request("r", prompt, prompt_logprobs=2, n=2))

    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    events = transport.events_of("r")
    scored = [event for event in events if event.prompt_logprobs is not None]
    assert scored and all(event.index == 0 and not event.token_ids for event in scored)
    assert max(event.seq for event in scored) < min(event.seq for event in events if event.token_ids)
    logprobs = [lp for event in scored for lp in event.prompt_logprobs or []]
    expected = [float(model.clean_logits(prompt[:p]).log_softmax(-1)[prompt[p]]) for p in range(1, len(prompt))]
    assert logprobs == pytest.approx(expected, abs=1e-6)
    assert all(len(top) == 2 for event in scored for top in event.prompt_top_logprobs or [])


@pytest.mark.parametrize("logprobs", [None, 0, 2], ids=["no-logprobs", "chosen-only", "top-2"])
def test_logprobs_ride_on_events_only_when_asked(logprobs: int | None) -> None:
    engine, _ = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=1)
    transport.submit(generate_request("r", logprobs=logprobs))

    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    for event in transport.events_of("r"):
        assert (event.logprobs is None) == (logprobs is None)
        assert (event.top_logprobs is None) == (not logprobs)
        if logprobs:
            assert event.top_logprobs is not None
            assert all(len(alternatives) == logprobs for alternatives in event.top_logprobs)


def test_a_request_without_seed_gets_one_kept_in_its_engine_request(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=1)
    added: list[Request] = []
    add_request = engine.add_request

    def recording_add_request(request: Request) -> None:
        added.append(request)
        add_request(request)

    monkeypatch.setattr(engine, "add_request", recording_add_request)
    transport.submit(generate_request("r", seed=None))

    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    (request,) = added
    assert request.params.seed == seed_for("r")  # what any other worker running "r" would take
    expected, _ = expected_choice(generate_request("r", seed=request.params.seed), 0)
    assert tokens_of(transport.events_of("r"), 0) == expected


# --- refusals and bad entries ----------------------------------------------------------------------

REFUSALS = {
    "prompt-too-long": ({"prompt": list(range(1, 20)) * 4}, "the limit is"),
    "bad-sampling-params": ({"presence_penalty": 3.0}, "presence_penalty"),
    "token-outside-vocab": ({"prompt": [1, VOCAB_SIZE]}, "outside the vocabulary"),
    "other-model": ({"model": "another-model"}, "not served by this worker"),
    "deadline-passed": ({"deadline": time.time() - 1}, "deadline passed"),
    "grammar-without-a-compiler": ({"grammar": 'start: "a"'}, "without a grammar compiler"),
}


@pytest.mark.parametrize(("fields", "message"), REFUSALS.values(), ids=REFUSALS.keys())
def test_a_refused_request_ends_at_once_with_an_error_per_choice(fields: dict[str, Any], message: str) -> None:
    engine, _ = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=2)
    transport.submit(generate_request("refused", n=2, **fields))
    transport.submit(generate_request("fine"))

    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    events = transport.events_of("refused")
    assert [(e.seq, e.index, e.token_ids, e.finish_reason) for e in events] == [
        (0, 0, [], FinishReason.REFUSED),
        (1, 1, [], FinishReason.REFUSED),
    ]
    assert all(e.error is not None and message in e.error for e in events)
    done = transport.finished_of("refused")
    assert done.finish_reason is FinishReason.REFUSED and done.error == events[0].error
    assert tokens_of(transport.events_of("fine"), 0) == expected_choice(generate_request("fine"), 0)[0]


def test_a_garbage_entry_is_set_aside_and_serving_continues() -> None:
    engine, _ = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=1)
    transport.submit_raw(b"\x92garbage")
    transport.submit(generate_request("after-garbage"))

    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    assert [dead.raw for dead in transport.dead_letters] == [b"\x92garbage"]
    assert transport.finished_of("after-garbage").finish_reason is expected_choice(generate_request("x"), 0)[1]


# --- cancellation ---------------------------------------------------------------------------------


def test_a_cancelled_request_stops_within_one_step() -> None:
    """Cancels are applied before each step. One sent as a batch with the request's tokens is written
    (the loop writes a step's batch before its next step) is applied before the next step: no more of
    its tokens, only the abort, and no later forward has the request."""
    engine, model = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=2)
    cancelled, other = (
        generate_request("cancelled", (1, 2, 3), max_tokens=40, ignore_eos=True),
        generate_request("other", (9, 8), max_tokens=20, ignore_eos=True),
    )
    for message in (cancelled, other):
        model.register(message.request_id, message.prompt_token_ids)
        transport.submit(message)
    forwards_at_cancel: list[int] = []
    publishes_at_cancel: list[int] = []

    def cancel_after_first_tokens(t: ScriptedTransport) -> None:
        if not forwards_at_cancel and t.events_of("cancelled"):
            forwards_at_cancel.append(len(model.forwards))
            publishes_at_cancel.append(len(t.publishes))
            t.cancel("cancelled")

    transport.on_publish = cancel_after_first_tokens
    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    later_events = [
        event for events, _ in transport.publishes[publishes_at_cancel[0] :] for event in events
        if event.request_id == "cancelled"
    ]  # fmt: skip
    assert [e.finish_reason for e in later_events][-1:] == [FinishReason.ABORT]
    assert len(later_events) == 1  # the abort
    assert later_events[-1].token_ids == []
    later_forwards = model.forwards[forwards_at_cancel[0] :]
    assert later_forwards and all(row.owner != "cancelled" for forward in later_forwards[1:] for row in forward)
    assert transport.finished_of("cancelled").finish_reason is FinishReason.ABORT
    assert transport.finished_of("other").finish_reason is FinishReason.LENGTH


def test_a_request_taken_over_by_another_worker_is_dropped_without_another_event() -> None:
    """Once the transport says another worker took a request over (this one's heartbeat had lapsed),
    the worker neither runs nor publishes it again: its seqs belong to the new worker."""
    engine, model = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=1)
    lost, other = (
        generate_request("lost", (1, 2, 3), max_tokens=40, ignore_eos=True),
        generate_request("other", (9, 8), max_tokens=20, ignore_eos=True),
    )
    for message in (lost, other):
        model.register(message.request_id, message.prompt_token_ids)
        transport.submit(message)
    told: list[int] = []  # the model's forwards when the takeover is told, then the publishes
    transport.taken_over = lambda: ["lost"] if told else []  # type: ignore[method-assign]

    def take_over_after_first_tokens(t: ScriptedTransport) -> None:
        if not told and t.events_of("lost"):
            told.extend((len(model.forwards), len(t.publishes)))

    transport.on_publish = take_over_after_first_tokens
    worker = Worker(engine, transport, worker_settings(), worker_id="w", model=announcement())
    run_worker(worker, stop)

    later_events = [e for events, _ in transport.publishes[told[1] + 1 :] for e in events if e.request_id == "lost"]
    assert later_events == []  # the step running when it was told may still publish; none after it
    assert all(row.owner != "lost" for forward in model.forwards[told[0] + 1 :] for row in forward)
    assert [done.request_id for done in transport.finished] == ["other"]
    assert worker.failover.taken_over_requests == 1


def test_a_request_cancelled_before_it_arrives_is_never_run() -> None:
    engine, model = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=1)
    transport.cancel("early")
    worker = Worker(engine, transport, worker_settings(), worker_id="w", model=announcement())
    threading.Timer(0.2, transport.submit, [generate_request("early")]).start()

    run_worker(worker, stop)

    assert [(e.token_ids, e.finish_reason) for e in transport.events_of("early")] == [([], FinishReason.ABORT)]
    assert model.forwards == []


# --- capacity, liveness, shutdown, failures -------------------------------------------------------


def test_the_worker_takes_no_more_requests_than_it_has_free_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = make_engine(max_seqs=2)
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=5)
    ended: list[str] = []  # by the engine, whether published yet or not
    step = engine.step

    def counted_step() -> Any:
        outputs = step()
        ended.extend(output.request_id for output in outputs if output.finished)
        return outputs

    monkeypatch.setattr(engine, "step", counted_step)
    transport.finished_count = lambda: len(ended)
    for i in range(5):
        transport.submit(generate_request(f"r{i}", (i + 1,), max_tokens=8, ignore_eos=True))

    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    assert all(max_new == 2 - in_flight for max_new, _, in_flight in transport.receives)
    assert all(taken <= max_new for max_new, taken, _ in transport.receives)
    assert any(max_new == 0 for max_new, _, _ in transport.receives)  # it was full at times
    assert len(transport.finished) == 5


def test_an_interactive_request_is_taken_and_served_while_batch_requests_fill_every_slot() -> None:
    engine, _ = make_engine(max_seqs=2)
    stop = threading.Event()
    transport = ScriptedTransport(stop, finish_after=3)
    batch = [
        generate_request(f"b{i}", (i + 1,), max_tokens=40, ignore_eos=True, priority=Priority.BATCH) for i in (0, 1)
    ]
    interactive = generate_request("i", (7,), max_tokens=4, ignore_eos=True)
    for message in batch:
        transport.submit(message)

    sent: list[str] = []

    def submit_interactive_once_both_run(transport: ScriptedTransport) -> None:
        if len(transport.started) == 2 and not sent:
            sent.append(interactive.request_id)
            transport.submit(interactive)

    transport.on_publish = submit_interactive_once_both_run
    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    assert transport.finished[0].request_id == "i"  # it did not wait for a free slot
    assert engine.stats().swap_outs + engine.stats().restarts >= 1
    for message in [*batch, interactive]:
        tokens, _ = expected_choice(message, 0)
        assert tokens_of([e for e in transport.events if e.request_id == message.request_id], 0) == tokens


def test_heartbeats_repeat_every_third_of_the_ttl_with_the_worker_load_and_at_once_when_draining() -> None:
    engine, _ = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop)
    transport.submit(generate_request("r", max_tokens=30, ignore_eos=True))
    threading.Timer(1.2, stop.set).start()

    run_worker(Worker(engine, transport, worker_settings(heartbeat_ttl_s=1), worker_id="w", model=announcement()), stop)

    beats = transport.heartbeats
    taking = [b for b in beats if b.state is WorkerState.TAKING]
    assert len(taking) >= 3
    assert all(b.worker_id == "w" and b.model == MODEL for b in beats)
    gaps = [later.sent_at - earlier.sent_at for earlier, later in itertools.pairwise(taking)]
    assert min(gaps) >= 1 / 3 - 0.02
    assert taking[-1].tokens_per_s > 0 and taking[-1].step_time_s > 0
    assert (taking[-1].total_slots, taking[-1].total_blocks) == (engine.config.num_slots, engine.config.num_blocks)
    assert beats[-1].state is WorkerState.DRAINING  # sent as soon as the stop was seen
    counters = dict(beats[-1].counters)  # for gateways' admission control: how long a request holds a slot
    assert counters["requests_finished"] == 1 and 0 < counters["request_slot_ms"] < 1200


@pytest.mark.parametrize("handoff", [True, False], ids=["hands-back", "finishes"])
def test_a_drain_order_is_obeyed_like_sigterm(handoff: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``met top``'s ``d``: the worker takes nothing new, hands back (or finishes) what runs, says it
    drains, and returns by itself."""
    engine, _ = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop)
    step, ordered = engine.step, threading.Event()

    def order_after_first_step() -> Any:
        outputs = step()
        if not ordered.is_set():
            ordered.set()
            transport.order(WorkerControl("w", ControlAction.DRAIN, "from a test"))
            transport.submit(generate_request("after-order"))
        return outputs

    monkeypatch.setattr(engine, "step", order_after_first_step)
    transport.submit(generate_request("running", max_tokens=20, ignore_eos=True))
    settings = replace(worker_settings(), drain_handoff=handoff)

    run_worker(Worker(engine, transport, settings, worker_id="w", model=announcement()), stop)

    assert stop.is_set() and transport.closed
    assert transport.heartbeats[-1].state is WorkerState.DRAINING
    assert transport.handed_back == (["running"] if handoff else [])
    assert [done.request_id for done in transport.finished] == ([] if handoff else ["running"])
    assert transport.queued(Priority.INTERACTIVE) == (2 if handoff else 1)  # for another worker


@pytest.mark.parametrize(
    ("drain_timeout_s", "reason"),
    [(30.0, FinishReason.LENGTH), (0.0, FinishReason.ABORT)],
    ids=["drained", "timed-out"],
)
def test_stop_finishes_running_requests_within_the_drain_timeout(
    drain_timeout_s: float, reason: FinishReason, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _ = make_engine()
    stop = threading.Event()
    transport = ScriptedTransport(stop)
    step = engine.step

    def stop_after_first_step() -> Any:
        outputs = step()
        if not stop.is_set():
            stop.set()
            transport.submit(generate_request("after-stop"))
        return outputs

    monkeypatch.setattr(engine, "step", stop_after_first_step)
    transport.submit(generate_request("running", max_tokens=20, ignore_eos=True))
    settings = worker_settings(drain_timeout_s=drain_timeout_s)

    run_worker(Worker(engine, transport, settings, worker_id="w", model=announcement()), stop)

    assert transport.events_of("running")[-1].finish_reason is reason
    assert [done.request_id for done in transport.finished] == ["running"]
    assert transport.queued(Priority.INTERACTIVE) == 1  # taken by no one: another worker will
    assert transport.closed


class FlakyTransport(ScriptedTransport):
    """Fails the first ``failures`` publishes as an unreachable Redis would."""

    def __init__(self, stop: threading.Event, finish_after: int, failures: int) -> None:
        super().__init__(stop, finish_after)
        self.failures = failures

    def publish(self, events: Sequence[TokenEvent], finished: Sequence[FinishedRequest]) -> None:
        if self.failures:
            self.failures -= 1
            raise TransportError("connection refused")
        super().publish(events, finished)


def test_events_survive_a_transport_outage_and_the_model_is_announced_again() -> None:
    engine, _ = make_engine()
    stop = threading.Event()
    transport = FlakyTransport(stop, finish_after=1, failures=2)
    message = generate_request("r", max_tokens=10)
    transport.submit(message)

    run_worker(Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()), stop)

    events = transport.events_of("r")
    assert [event.seq for event in events] == list(range(len(events)))
    assert tokens_of(events, 0) == expected_choice(message, 0)[0]
    assert len(transport.announcements) == 3


def test_an_engine_failure_fails_the_requests_in_flight_and_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = make_engine()
    transport = ScriptedTransport(threading.Event())
    transport.submit(generate_request("r", n=2))

    def broken_step() -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", broken_step)
    with pytest.raises(RuntimeError, match="device lost"):
        Worker(engine, transport, worker_settings(), worker_id="w", model=announcement()).run()

    assert [(e.index, e.finish_reason) for e in transport.events_of("r")] == [
        (0, FinishReason.ERROR),
        (1, FinishReason.ERROR),
    ]
    assert transport.finished_of("r").finish_reason is FinishReason.ERROR
    assert transport.closed
