"""How long one engine step takes with every slot decoding, measured once at start-up.

Gateways plan a burst's waits on how fast the fleet's slots turn over (``gateway/fleet/slot_turnover.py``).
Before a worker has finished any request nothing says how long a request holds a slot; this probe
gives them a measure from the start: a full batch (one short prompt per slot) is prefilled and then
decoded for a few steps on the worker's own model, and the median of those decode steps is sent in
every heartbeat (``WorkerHeartbeat.full_step_s``) until the worker has taken full steps of its own.
"""

from __future__ import annotations

import statistics
import time

from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Request
from metrale.worker.engine.sampling_params import SamplingParams

PROBE_PROMPT_TOKENS = 8
"""Tokens of each probe prompt (one prefill step for the whole batch)."""
PROBE_DECODE_STEPS = 6
"""Decode steps timed; their median is the answer (the first may include a compilation)."""


def full_step_s(engine: Engine, *, decode_steps: int = PROBE_DECODE_STEPS) -> float:
    """The median seconds of ``decode_steps`` engine steps decoding one sequence per slot (``max_seqs``
    of them), after their prefill. Leaves the engine as it found it: every probe sequence finishes, and
    none is drafted for (the steps timed are plain decode steps, and the speculation counters count
    served requests only)."""
    rows = min(engine.config.max_seqs, engine.config.num_slots)
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True, speculative=False)
    for row in range(rows):
        prompt = tuple((row + position) % 2 + 1 for position in range(PROBE_PROMPT_TOKENS))
        engine.add_request(Request(f"step-probe-{row}", prompt, params))
    full_steps: list[float] = []
    while engine.has_unfinished():
        began = time.perf_counter()
        produced = len(engine.step())
        if produced == rows:
            full_steps.append(time.perf_counter() - began)
    decode = full_steps[1:]  # the first full step is the prefill's
    return statistics.median(decode) if decode else 0.0
