"""A Responses API conversation by ``previous_response_id`` on a fleet of real processes: with two
workers taking turns, and with the worker that served each turn killed (``kill -9``) before the next,
every turn equals an offline run fed the same token ids from 0 and resumes past all of the turn before."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from metrale.shared.record import read_record
from metrale.shared.sessions import Transcript
from metrale.shared.settings import DEFAULT_TENANT
from metrale.worker.engine.factory import LoadedModel
from metrale.worker.engine.sampling_params import SamplingParams
from tests.failover.local_fleet import MODEL, LocalFleet
from tests.failover.processes import RedisServer
from tests.gateway.api.test_session_cache import QUESTIONS

pytestmark = [pytest.mark.slow, pytest.mark.redis]

MAX_OUTPUT_TOKENS = 16


@pytest.fixture
def fleet(redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalFleet]:
    fleet = LocalFleet(redis_server.url, tiny_model_dir, tmp_path, max_seqs=4)
    try:
        fleet.start(["worker-1", "worker-2"])
        yield fleet
    finally:
        fleet.close()


def reference_reply(model: LoadedModel, prompt: list[int]) -> list[int]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers (OMP_NUM_THREADS=1): the same float reductions
    try:
        (result,) = model.engine.generate([prompt], SamplingParams(max_tokens=MAX_OUTPUT_TOKENS, temperature=0.0))
    finally:
        torch.set_num_threads(threads)
    return list(result.completions[0].token_ids)


@pytest.mark.parametrize("between_turns", ["alternate", "kill-9"])
def test_a_conversation_survives_its_worker(
    fleet: LocalFleet, reference_model: LoadedModel, between_turns: str
) -> None:
    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    store = redis.Redis.from_url(fleet.redis_url)
    previous_id: str | None = None
    previous_total, previous_tokens = 0, ()
    served_by: list[str] = []
    try:
        for turn, question in enumerate(QUESTIONS):
            paused = None
            if between_turns == "alternate":
                paused = ["worker-1", "worker-2"][(turn + 1) % 2]
                fleet.workers[paused].signal(signal.SIGSTOP)  # the other one takes this turn
            try:
                response = client.responses.create(
                    model=MODEL,
                    input=question,
                    previous_response_id=previous_id if previous_id is not None else openai.omit,
                    max_output_tokens=MAX_OUTPUT_TOKENS,
                    temperature=0.0,
                )
                # Read before the paused worker runs again: a request its blocked read was handed while
                # paused is reclaimed by the other worker, and the paused one may touch the record later.
                record = read_record(store, response.id, keys=fleet.keys)
            finally:
                if paused is not None:
                    fleet.workers[paused].signal(signal.SIGCONT)
            assert response.usage is not None
            transcript = Transcript.from_fields(store.hgetall(fleet.keys.response(DEFAULT_TENANT, response.id)))
            assert transcript is not None
            prompt = list(transcript.token_ids[: transcript.prompt_length])
            reply = list(transcript.token_ids[transcript.prompt_length :])
            assert record is not None and record.worker_id is not None
            served_by.append(record.worker_id)
            assert [t for event in record.events for t in event.token_ids] == reply
            assert reply == reference_reply(reference_model, prompt), f"turn {turn + 1} differs from a run from 0"
            if turn > 0:
                assert tuple(prompt[: len(previous_tokens)]) == previous_tokens
                cached = response.usage.input_tokens_details.cached_tokens
                assert cached >= previous_total, f"turn {turn + 1}: {cached} cached of {previous_total}"
            if between_turns == "kill-9":
                fleet.kill(record.worker_id)
                fleet.add_worker(f"worker-{turn + 3}")
            previous_id, previous_total = response.id, response.usage.total_tokens
            previous_tokens = transcript.token_ids
    except BaseException:
        print(fleet.logs())
        raise
    finally:
        client.close()
        store.close()
    if between_turns == "alternate":
        assert served_by == ["worker-1", "worker-2"] * 3
    else:
        assert len(set(served_by)) == len(QUESTIONS), served_by
