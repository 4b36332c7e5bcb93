"""Hypothesis strategies for random schedules: pool sizes small enough to force both kinds of
preemption, and requests arriving, stopping and being cancelled at random steps; sampled with any of
the sampling knobs, some continuing tokens generated elsewhere or resuming from a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from metrale.worker.scheduler.config import SchedulerConfig, blocks_for
from metrale.worker.scheduler.sequence import Priority

TOKEN_RANGE = 30
"""Prompt and stop tokens lie in ``[0, TOKEN_RANGE)``, below the fake's GARBAGE id."""

MAX_REQUESTS = 6


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a scenario; its prompt starts with its own index, so prompts are distinct."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    priority: Priority
    stop_token_ids: tuple[int, ...]
    include_stop_token: bool
    greedy: bool
    ignore_eos: bool
    seed: int
    arrival_step: int
    abort_step: int | None
    sampling: tuple[tuple[str, object], ...] = ()
    """Further ``SamplingParams`` keywords (temperature, top-k/p, min-p, penalties, logit bias)."""
    continued: int = 0
    """How many of its tokens (``n == 1``) were generated elsewhere: it arrives with them, as a request
    moved from another worker (clipped below its whole output, so one token is always left to sample)."""
    grammar: str | None = None
    """A Lark grammar over ``tests.worker.fakes.FAKE_TEXT`` its choices are constrained to."""
    checkpoint_at: int | None = None
    """It arrives with the exact state after this many of its known tokens (prompt, then the continued
    ones), as resumed from a checkpoint (clipped below the tokens known, so at least one is fed)."""


@dataclass(frozen=True, slots=True)
class Scenario:
    config: SchedulerConfig
    requests: tuple[RequestSpec, ...]


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(4, 20))
    watermark = draw(st.integers(0, 2))
    fewest_blocks = blocks_for(max_model_len, block_size) + watermark
    num_slots = draw(st.integers(1, 4))
    max_seqs = draw(st.integers(1, num_slots + 1))
    return SchedulerConfig(
        max_batch_tokens=draw(st.integers(max_seqs, max_seqs + 12)),
        max_seqs=max_seqs,
        num_slots=num_slots,
        num_blocks=draw(st.integers(fewest_blocks, fewest_blocks + 4)),
        block_size=block_size,
        watermark=watermark,
        swap_space_bytes=draw(st.sampled_from([0, 80, 200, 400, 100_000])),
        max_model_len=max_model_len,
        checkpoint_grid=draw(st.none() | st.integers(2, 6)),
    )


@st.composite
def sampling_knobs(draw: st.DrawFn, greedy: bool) -> tuple[tuple[str, object], ...]:
    """``SamplingParams`` keywords beyond the seed: filters (sampled requests) and penalties each on
    for about one request in three, a logit bias for one in two."""
    knobs: dict[str, object] = {}
    if not greedy and draw(st.integers(0, 2)) == 0:
        knobs["temperature"] = draw(st.sampled_from([0.5, 1.7]))
        knobs["top_k"] = draw(st.sampled_from([0, 4]))
        knobs["top_p"] = draw(st.sampled_from([1.0, 0.8]))
        knobs["min_p"] = draw(st.sampled_from([0.0, 0.05]))
    if draw(st.integers(0, 2)) == 0:
        knobs["presence_penalty"] = draw(st.sampled_from([0.0, 0.8, -0.5]))
        knobs["frequency_penalty"] = draw(st.sampled_from([0.0, 0.6]))
        knobs["repetition_penalty"] = draw(st.sampled_from([1.0, 1.3]))
    bias = draw(st.dictionaries(st.integers(0, TOKEN_RANGE - 1), st.sampled_from([-100.0, -2.0, 3.0]), max_size=2))
    knobs["logit_bias"] = tuple(bias.items())
    return tuple(knobs.items())


GRAMMARS = {
    'start: ("ab" | "cd")+ "z"': r"(ab|cd)+z",
    'start: /[a-f]{1,3}/ ("[" /[g-z]+/ "]")*': r"[a-f]{1,3}(\[[g-z]+\])*",
}
"""Lark grammars over the fake tokenizer's text, each masking differently from one token to the next, and
the regular expression of the same sentences."""


@st.composite
def request_specs(draw: st.DrawFn, index: int, max_model_len: int, constrained: bool = False) -> RequestSpec:
    """One request; with ``constrained``, maybe a grammar (only where it has a stop token to end on, and
    never continuing tokens generated elsewhere, whose isolated run knows no grammar)."""
    prompt_len = draw(st.integers(1, max_model_len // 2) | st.integers(1, max_model_len))
    rest = draw(st.lists(st.integers(0, TOKEN_RANGE - 1), min_size=prompt_len - 1, max_size=prompt_len - 1))
    n = draw(st.integers(1, 3))
    greedy = draw(st.booleans())
    stop_token_ids = tuple(draw(st.sets(st.integers(0, TOKEN_RANGE - 1), max_size=2)))
    ignore_eos = draw(st.booleans())
    has_stop = bool(stop_token_ids) or not ignore_eos
    grammar = draw(st.none() | st.sampled_from(sorted(GRAMMARS))) if constrained and has_stop else None
    return RequestSpec(
        request_id=f"r{index}",
        prompt=(index, *rest),
        max_tokens=draw(st.integers(1, 12)),
        n=n,
        priority=draw(st.sampled_from(Priority)),
        stop_token_ids=stop_token_ids,
        include_stop_token=draw(st.booleans()),
        greedy=greedy,
        ignore_eos=ignore_eos,
        seed=draw(st.integers(0, 2**16)),
        arrival_step=draw(st.integers(0, 6)),
        abort_step=draw(st.none() | st.none() | st.integers(0, 15)),
        sampling=draw(sampling_knobs(greedy)),
        continued=draw(st.sampled_from([0, 1, 3])) if n == 1 and grammar is None else 0,
        grammar=grammar,
        checkpoint_at=draw(st.none() | st.integers(1, max_model_len)) if n == 1 else None,
    )


@st.composite
def scenarios(draw: st.DrawFn, constrained: bool = False) -> Scenario:
    """A random schedule; with ``constrained``, some requests have a grammar (``GRAMMARS``)."""
    config = draw(configs())
    count = draw(st.integers(1, MAX_REQUESTS))
    requests = tuple(draw(request_specs(index, config.max_model_len, constrained)) for index in range(count))
    return Scenario(config, requests)
