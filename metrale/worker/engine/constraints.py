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

``allowed_tokens`` computes the masks of a batch in parallel on llguidance's threads;
``allowed_tokens_reference`` is its plain twin, one row at a time.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import llguidance
import llguidance.torch
import torch

from metrale.text.grammars import GrammarError, grammar_error_summary, llguidance_tokenizer
from metrale.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)


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
        self._matcher = grammar.start()
        self._output: list[int] = []
        self._consumed: list[int] = []
        self.replays = 0
        """How many times the matcher was rebuilt from the grammar's start (for tests and metrics)."""

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


def allowed_tokens(constraints: Sequence[ChoiceConstraint], executor: llguidance.LLExecutor) -> torch.Tensor:
    """Which tokens each choice may sample next: bool ``[len(constraints), vocab_size]`` on the CPU.

    The grammar masks of the whole batch are computed at once on ``executor``'s threads."""
    if not constraints:
        raise ValueError("no constraints to mask")
    vocab_size = _one_vocab_size(constraints)
    words = llguidance.torch.allocate_token_bitmask(len(constraints), vocab_size)
    computing = [(c.matcher, i) for i, c in enumerate(constraints) if not c.is_error]
    if computing:
        llguidance.torch.fill_next_token_bitmask_par(executor, computing, words)
    return _with_stop_tokens(unpack_bitmask(words, vocab_size), constraints)


def allowed_tokens_reference(constraints: Sequence[ChoiceConstraint]) -> torch.Tensor:
    """``allowed_tokens`` one row at a time, from each matcher's own bitmask (the plain twin)."""
    vocab_size = _one_vocab_size(constraints)
    rows = torch.zeros(len(constraints), vocab_size, dtype=torch.bool)
    for i, constraint in enumerate(constraints):
        if constraint.is_error:
            continue
        mask = constraint.matcher.compute_bitmask()
        bits = [(mask[j // 8] >> (j % 8)) & 1 for j in range(vocab_size)]
        rows[i] = torch.tensor(bits, dtype=torch.bool)
    return _with_stop_tokens(rows, constraints)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask, int32 ``[R, ceil(V / 32)]`` (bit ``j % 32`` of word ``j // 32`` allows
    token ``j``), as bool ``[R, vocab_size]``."""
    bits = (words[:, :, None] >> _BITS) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def _with_stop_tokens(allowed: torch.Tensor, constraints: Sequence[ChoiceConstraint]) -> torch.Tensor:
    """Replace llguidance's EOS by each choice's stop tokens: allowed iff its grammar is complete
    (or broken); a broken grammar allows nothing else."""
    for i, constraint in enumerate(constraints):
        ending = sorted(constraint.grammar.eos_token_ids | constraint.stop_token_ids)
        allowed[i, ending] = False
        if constraint.is_error:
            allowed[i] = False
        if constraint.is_error or constraint.is_accepting:
            allowed[i, sorted(constraint.stop_token_ids)] = True
    return allowed


def _one_vocab_size(constraints: Sequence[ChoiceConstraint]) -> int:
    sizes = {c.grammar.vocab_size for c in constraints}
    if len(sizes) != 1:
        raise ValueError(f"constraints of different vocabularies in one batch: {sorted(sizes)}")
    return sizes.pop()
