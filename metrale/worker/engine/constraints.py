"""Grammar-constrained decoding: which tokens each constrained choice may sample next.

A request's grammar (llguidance Lark text, ``metrale.text.grammars``) is compiled once per worker
(``GrammarCompiler`` caches by text); each choice then gets its own ``ChoiceConstraint``, an
llguidance matcher that has consumed exactly that choice's output tokens.

The constraint is part of the choice's exact state, and a pure function of its output: before each
sample, ``ChoiceConstraint.follow`` brings the matcher to the output the scheduler holds, and
whenever what it consumed is not a prefix of that output (a new matcher, a forked choice, a request
resumed from a checkpoint or continued from another worker's tokens) it rebuilds the matcher by
replaying the output from the grammar's start. A replayed choice therefore masks exactly as an
undisturbed one would, and with the same logits and seed samples the same tokens.

Stop tokens belong to the request, not the grammar: a stop token is allowed exactly when the
grammar is complete (accepting), and once the grammar can take nothing more, only stop tokens are.
Stop tokens in an output are never fed to the matcher (they end the choice).

A choice whose grammar allows no token while it is not complete (a schema no finite output
satisfies, a parser that gave up, an output that left the grammar) is at a *dead end*: its mask
allows only stop tokens, and ``ChoiceConstraint.dead_end`` says why, so the engine ends the choice
with an error instead of a ``stop`` over a broken output. Being computed from the mask, a dead end is
a function of the output too: a replayed choice reaches it at the same token.

``allowed_tokens`` has llguidance write the masks of a batch into one bitmask (on its threads for
large vocabularies) and unpacks it with numpy; ``allowed_tokens_reference`` is its plain twin, one
row at a time, unpacked with integer shifts.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import llguidance
import numpy as np
import torch

from metrale.text.grammars import GrammarError, grammar_error_summary, llguidance_tokenizer
from metrale.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)

PARALLEL_MASKS_FROM_VOCAB = 32_768
"""From this vocabulary size on, a batch's masks are computed on llguidance's threads: below it a
row's mask takes microseconds and handing rows to threads costs more than it saves (measured with
``bench/grammar.py`` on the 4,101-token built-in model: 3x the CPU time of one thread)."""


class CompiledGrammar:
    """A grammar compiled for one tokenizer; ``start()`` hands out matchers at its beginning."""

    def __init__(self, pristine: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._pristine = pristine
        self.vocab_size = vocab_size
        """Width of the masks: the model's logits."""
        self.eos_token_ids = eos_token_ids
        """The tokenizer's EOS ids, which llguidance allows when the grammar is complete (the mask
        replaces them by the request's stop tokens)."""

    def start(self) -> llguidance.LLMatcher:
        """A fresh matcher that has consumed nothing (a copy: compiling is the expensive part)."""
        return self._pristine.deep_copy()


class GrammarCompiler:
    """Compiles grammars for one tokenizer, keeping the ``cache_size`` most recently used."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, *, cache_size: int = 64) -> None:
        self._ll_tokenizer = llguidance_tokenizer(tokenizer, vocab_size)
        self.vocab_size = int(self._ll_tokenizer.vocab_size)
        self._eos_token_ids = frozenset(int(t) for t in self._ll_tokenizer.eos_tokens)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size

    def compile(self, grammar: str) -> CompiledGrammar:
        """The compiled ``grammar``; raises ``GrammarError`` (a ``ValueError``) naming what is wrong."""
        cached = self._cache.get(grammar)
        if cached is not None:
            self._cache.move_to_end(grammar)
            return cached
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(grammar_error_summary(matcher.get_error()))
        compiled = CompiledGrammar(matcher, self.vocab_size, self._eos_token_ids)
        self._cache[grammar] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    @property
    def cached(self) -> int:
        """How many compiled grammars the cache holds."""
        return len(self._cache)


class ChoiceConstraint:
    """The grammar state of one choice: a matcher that has consumed ``consumed``, the choice's
    output without its stop tokens."""

    def __init__(self, grammar: CompiledGrammar, stop_token_ids: Iterable[int]) -> None:
        self.grammar = grammar
        self.stop_token_ids = frozenset(t for t in stop_token_ids if t < grammar.vocab_size)
        if not self.stop_token_ids:
            raise ValueError("a constrained choice needs a stop token (within the vocabulary) to end on")
        self._stop_index = torch.tensor(sorted(self.stop_token_ids), dtype=torch.long)
        self._ending_index = torch.tensor(sorted(grammar.eos_token_ids | self.stop_token_ids), dtype=torch.long)
        self._matcher = grammar.start()
        self._output: list[int] = []
        self._consumed: list[int] = []
        self.replays = 0
        """How many times the matcher was rebuilt from the grammar's start (for tests and metrics)."""
        self.dead_end: str | None = None
        """Why the last mask computed allowed no token of the grammar though it was not complete;
        None when it allowed one (or the grammar was complete)."""

    @property
    def consumed(self) -> tuple[int, ...]:
        return tuple(self._consumed)

    def follow(self, output_ids: Sequence[int]) -> None:
        """Bring the matcher to ``output_ids``: consume what is new, or rebuild and replay when the
        output is not a continuation of what was consumed."""
        known = len(self._output)
        if len(output_ids) < known or list(output_ids[:known]) != self._output:
            self._matcher = self.grammar.start()
            self._output, self._consumed, known = [], [], 0
            self.replays += 1
        appended = list(output_ids[known:])
        if not appended:
            return
        self._output += appended
        new = [t for t in appended if t not in self.stop_token_ids]
        self._consumed += new
        if new and not self._matcher.consume_tokens(new):
            logger.warning("a constrained output left its grammar: %s", self._matcher.get_error())

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return bool(self._matcher.is_accepting())

    @property
    def is_error(self) -> bool:
        """The output left the grammar (only a corrupted continuation can do that); only stop
        tokens are allowed then."""
        return bool(self._matcher.is_error())

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    @property
    def stop_index(self) -> torch.Tensor:
        """The stop token ids, sorted, as a long tensor (for masks)."""
        return self._stop_index

    @property
    def ending_index(self) -> torch.Tensor:
        """The stop token ids and the tokenizer's EOS ids, sorted, as a long tensor (for masks)."""
        return self._ending_index


def allowed_tokens(
    constraints: Sequence[ChoiceConstraint], executor: llguidance.LLExecutor | None = None
) -> torch.Tensor:
    """Which tokens each choice may sample next: bool ``[len(constraints), vocab_size]`` on the CPU.

    llguidance writes every row's mask straight into one bitmask, on ``executor``'s threads when
    given (worth it for large vocabularies, see ``PARALLEL_MASKS_FROM_VOCAB``), else row by row
    in this thread."""
    # Imported here, not with this module: llguidance.torch applies torch.compile when imported, which
    # loads dynamo and inductor — seconds of every worker's start, for a request that may never come.
    import llguidance.torch

    if not constraints:
        raise ValueError("no constraints to mask")
    vocab_size = _one_vocab_size(constraints)
    words = llguidance.torch.allocate_token_bitmask(len(constraints), vocab_size)
    computing = [(c.matcher, i) for i, c in enumerate(constraints) if not c.is_error]
    if executor is not None and len(computing) > 1:
        llguidance.torch.fill_next_token_bitmask_par(executor, computing, words)
    else:
        for matcher, i in computing:
            llguidance.torch.fill_next_token_bitmask(matcher, words, i)
    return _with_stop_tokens(unpack_bitmask(words, vocab_size), constraints)


def allowed_tokens_reference(constraints: Sequence[ChoiceConstraint]) -> torch.Tensor:
    """``allowed_tokens`` one row at a time, from each matcher's own bitmask (the plain twin)."""
    vocab_size = _one_vocab_size(constraints)
    rows = torch.zeros(len(constraints), vocab_size, dtype=torch.bool)
    for i, constraint in enumerate(constraints):
        if constraint.is_error:
            continue
        mask = constraint.matcher.compute_bitmask()
        words = torch.frombuffer(bytearray(mask), dtype=torch.int32)[None, :]
        rows[i] = unpack_bitmask_reference(words, vocab_size)[0]
    return _with_stop_tokens(rows, constraints)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask, int32 ``[R, ceil(V / 32)]`` on the CPU (bit ``j % 32`` of word ``j // 32``
    allows token ``j``), as bool ``[R, vocab_size]``.

    Reads the words as little-endian bytes (bit ``j % 8`` of byte ``j // 8``), as llguidance writes
    them; ``unpack_bitmask_reference`` is the plain twin, one shift per bit."""
    as_bytes = words.contiguous().numpy().view(np.uint8)
    bits = np.ascontiguousarray(np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size])
    return torch.from_numpy(bits).view(torch.bool)


def unpack_bitmask_reference(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``unpack_bitmask`` with integer shifts: bit ``j % 32`` of word ``j // 32``."""
    bits = (words[:, :, None] >> _BITS) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def _with_stop_tokens(allowed: torch.Tensor, constraints: Sequence[ChoiceConstraint]) -> torch.Tensor:
    """In place on ``allowed``: replace llguidance's EOS by each choice's stop tokens, allowed iff its
    grammar is complete (or broken); a broken grammar allows nothing else."""
    for i, constraint in enumerate(constraints):
        row = allowed[i]
        row.index_fill_(0, constraint.ending_index, False)
        if constraint.is_error:
            row.fill_(False)
        accepting = constraint.is_accepting
        constraint.dead_end = None if accepting or bool(row.any()) else _dead_end_reason(constraint)
        if constraint.is_error or accepting or constraint.dead_end is not None:
            row.index_fill_(0, constraint.stop_index, True)
    return allowed


def _dead_end_reason(constraint: ChoiceConstraint) -> str:
    """Why ``constraint`` allows no token: llguidance's error line, if it has one."""
    where = f"after {len(constraint.consumed)} tokens"
    if not constraint.is_error:
        return f"no token continues the grammar {where}"
    lines = [line.strip() for line in constraint.matcher.get_error().splitlines()]
    reasons = [line.split(":", 1)[1].strip() for line in lines if line.startswith(("Error:", "Stop:"))]
    reason = next((r for r in reasons if r and r != "None"), "no reason given")
    return f"the grammar's parser stopped {where}: {reason[:200]}"


def _one_vocab_size(constraints: Sequence[ChoiceConstraint]) -> int:
    sizes = {c.grammar.vocab_size for c in constraints}
    if len(sizes) != 1:
        raise ValueError(f"constraints of different vocabularies in one batch: {sorted(sizes)}")
    return sizes.pop()
