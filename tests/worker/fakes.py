"""A recording fake of ``StatefulModel`` whose state, like a KDA state, cannot be rewound.

Each slot holds the tokens its state consumed and a corrupted flag. A chunk that starts anywhere but
the slot's position, or whose KV blocks do not hold the slot's earlier tokens, corrupts the slot for
good (a start of 0 resets it fresh). Clean logits are a fixed function of the consumed tokens; a
corrupted slot yields only ``GARBAGE``. ``export_state`` / ``import_state`` move that content as
tensors, so a state restored into the wrong slot or with another request's tokens shows up in the
outputs. ``isolated_run`` is the trivial reference loop: one request alone on a fresh fake.

A ``verify`` chunk gives each row the logits of its prefix and leaves the slot unsettled: the state
after every row is kept until ``settle_verified`` picks one; any feed, export or import of an unsettled
slot raises. ``verify_chunks`` counts verify chunks, ``verify_rows`` their rows and ``settled_rows``
the rows kept. ``misplaced_feeds`` lists every chunk that did not start where its slot's state stood
(at 0, a fresh state): a position consumed twice, or one skipped.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from metrale.text.tokenizer import Tokenizer
from metrale.worker.engine.sampler import Sampler, SamplingRow
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.model.interface import ForwardChunk, SequenceState
from metrale.worker.scheduler.sequence import FinishReason

VOCAB_SIZE = 32
GARBAGE = VOCAB_SIZE - 1
"""The only token a corrupted slot ever produces; clean logits never allow it."""

FAKE_TEXT = string.ascii_lowercase + "{}[]"
"""The text of ids ``0`` to ``29`` in ``fake_tokenizer``: one character each."""

_TABLE_ROWS = 4096
_LOGIT_SPREAD = 2.0


@functools.cache
def _logits_table(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(_TABLE_ROWS, VOCAB_SIZE, generator=generator) * _LOGIT_SPREAD
    table[:, GARBAGE] = -torch.inf
    return table


_GARBAGE_LOGITS = torch.full((VOCAB_SIZE,), -torch.inf)
_GARBAGE_LOGITS[GARBAGE] = 0.0


@dataclass(frozen=True, slots=True)
class ForwardRecord:
    """One row of a forward as the fake saw it; ``owner`` is the request whose prompt the slot's
    tokens match (None: none or several)."""

    slot: int
    start: int
    length: int
    owner: str | None


@dataclass(frozen=True, slots=True)
class _SlotState:
    tokens: tuple[int, ...] = ()
    corrupted: bool = False


class RecordingModel:
    """Implements ``StatefulModel`` at trivial cost and records every forward in ``forwards``."""

    def __init__(self, num_slots: int, num_blocks: int, block_size: int, table_seed: int = 0) -> None:
        self._num_slots, self._num_blocks, self._block_size = num_slots, num_blocks, block_size
        self._table = _logits_table(table_seed)
        self._slots = [_SlotState() for _ in range(num_slots)]
        self._kv = [[-1] * block_size for _ in range(num_blocks)]
        self._prompts: dict[str, tuple[int, ...]] = {}
        self.forwards: list[list[ForwardRecord]] = []
        self._unsettled: dict[int, tuple[_SlotState, int]] = {}
        self.verify_chunks = 0
        self.verify_rows = 0
        self.settled_rows = 0
        self.misplaced_feeds: list[ForwardRecord] = []

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def register(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        """Let records name the request whose tokens a slot holds."""
        self._prompts[request_id] = tuple(prompt_ids)

    def forward(self, chunks: Sequence[ForwardChunk]) -> torch.Tensor:
        if self._unsettled:
            raise AssertionError(f"a forward while slots {sorted(self._unsettled)} are unsettled")
        records, rows = [], []
        for chunk in chunks:
            held = len(self._slots[chunk.slot].tokens)
            state = self._advance(chunk)
            self._slots[chunk.slot] = state
            records.append(ForwardRecord(chunk.slot, chunk.start, len(chunk.token_ids), self._owner(state)))
            if chunk.start not in (0, held):
                self.misplaced_feeds.append(records[-1])
            if chunk.verify:
                self._unsettled[chunk.slot] = (state, chunk.start)
                self.verify_chunks += 1
                self.verify_rows += len(chunk.token_ids)
            if chunk.every_row or chunk.verify:  # the logits after each prefix of the chunk
                for length in range(chunk.start + 1, chunk.end):
                    rows.append(self._logits(_SlotState(state.tokens[:length], state.corrupted)))
            rows.append(self._logits(state))
        self.forwards.append(records)
        return torch.stack(rows)

    def settle_verified(self, slot: int, rows: int) -> None:
        state, start = self._unsettled.pop(slot)
        if not 1 <= rows <= len(state.tokens) - start:
            raise AssertionError(f"{rows} rows kept of a verify chunk of {len(state.tokens) - start}")
        self._slots[slot] = _SlotState(state.tokens[: start + rows], state.corrupted)
        self.settled_rows += rows

    def clean_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """The logits ``[V]`` of an uncorrupted state that consumed ``tokens`` (the reference)."""
        return self._logits(_SlotState(tuple(tokens)))

    @staticmethod
    def checkpoint(tokens: Sequence[int]) -> SequenceState:
        """The exact state of a slot that consumed ``tokens``, as ``export_state`` gives it."""
        held = torch.tensor(tuple(tokens), dtype=torch.int64)
        return {"tokens": held, "kv": held.clone(), "corrupted": torch.tensor([0], dtype=torch.int64)}

    def export_state(self, slot: int, block_ids: Sequence[int], length: int) -> SequenceState:
        assert slot not in self._unsettled, f"slot {slot} exported while unsettled"
        state = self._slots[slot]
        kv = self._read_kv(block_ids, length)
        corrupted = state.corrupted or len(state.tokens) != length or kv != state.tokens
        return {
            "tokens": torch.tensor(state.tokens[:length], dtype=torch.int64),
            "kv": torch.tensor(kv, dtype=torch.int64),
            "corrupted": torch.tensor([int(corrupted)], dtype=torch.int64),
        }

    def import_state(self, state: SequenceState, slot: int, block_ids: Sequence[int]) -> None:
        assert slot not in self._unsettled, f"slot {slot} imported into while unsettled"
        tokens = tuple(state["tokens"].tolist())
        kv = tuple(state["kv"].tolist())
        self._write_kv(block_ids, 0, kv)
        self._slots[slot] = _SlotState(tokens, bool(state["corrupted"].item()) or kv != tokens)

    def state_nbytes(self, length: int) -> int:
        return 16 * length + 8

    def _advance(self, chunk: ForwardChunk) -> _SlotState:
        state = _SlotState() if chunk.start == 0 else self._slots[chunk.slot]
        corrupted = state.corrupted or chunk.start != len(state.tokens)
        corrupted = corrupted or self._read_kv(chunk.block_ids, chunk.start) != state.tokens[: chunk.start]
        self._write_kv(chunk.block_ids, chunk.start, chunk.token_ids)
        return _SlotState((*state.tokens, *chunk.token_ids), corrupted)

    def _logits(self, state: _SlotState) -> torch.Tensor:
        if state.corrupted:
            return _GARBAGE_LOGITS
        return self._table[hash(state.tokens) % _TABLE_ROWS]

    def _owner(self, state: _SlotState) -> str | None:
        owners = [
            request_id
            for request_id, prompt in self._prompts.items()
            if prompt[: len(state.tokens)] == state.tokens[: len(prompt)]
        ]
        return owners[0] if len(owners) == 1 else None

    def _read_kv(self, block_ids: Sequence[int], length: int) -> tuple[int, ...]:
        if -(-length // self._block_size) > len(block_ids):
            raise IndexError(f"{len(block_ids)} blocks cannot cover {length} positions")
        return tuple(self._kv[block_ids[p // self._block_size]][p % self._block_size] for p in range(length))

    def _write_kv(self, block_ids: Sequence[int], start: int, token_ids: Sequence[int]) -> None:
        end = start + len(token_ids)
        if -(-end // self._block_size) > len(block_ids):
            raise IndexError(f"{len(block_ids)} blocks cannot cover {end} positions")
        for position, token_id in enumerate(token_ids, start):
            self._kv[block_ids[position // self._block_size]][position % self._block_size] = token_id


@functools.cache
def fake_tokenizer() -> Tokenizer:
    """A tokenizer of the fake's vocabulary, for grammars: id ``i < 30`` is ``FAKE_TEXT[i]``, 30 is
    ``</s>`` (its EOS, the engine tests' EOS) and ``GARBAGE`` is ``<garbage>``."""
    vocab = {char: token_id for token_id, char in enumerate(FAKE_TEXT)} | {"</s>": 30, "<garbage>": GARBAGE}
    backend = BackendTokenizer(models.BPE(vocab, [], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()  # llguidance reads a byte-level vocabulary (these are ASCII)
    backend.add_special_tokens([AddedToken("</s>", special=True), AddedToken("<garbage>", special=True)])
    return Tokenizer(backend, special_tokens={"eos_token": "</s>"})


def isolated_run(
    prompt: Sequence[int],
    params: SamplingParams,
    seed: int,
    choice: int,
    stop_token_ids: frozenset[int],
    max_model_len: int,
    include_stop_token: bool = True,
) -> tuple[list[int], FinishReason]:
    """The tokens one choice of a request produces alone (prefill, then one decode per token), and
    why it stopped."""
    block_size = 4
    model = RecordingModel(num_slots=1, num_blocks=-(-(max_model_len + 1) // block_size), block_size=block_size)
    blocks = list(range(model.num_blocks))
    sampler = Sampler()
    tokens, output = list(prompt), list[int]()
    logits = model.forward([ForwardChunk(0, blocks, 0, tokens)])
    while True:
        row = SamplingRow(params, seed, choice, len(tokens), tuple(prompt), tuple(output))
        token = sampler.sample(logits, [row])[0].token_id
        if token in stop_token_ids:
            return ([*output, token] if include_stop_token else output), FinishReason.STOP
        output.append(token)
        tokens.append(token)
        if len(output) >= params.max_tokens or len(tokens) > max_model_len:
            return output, FinishReason.LENGTH
        logits = model.forward([ForwardChunk(0, blocks, len(tokens) - 1, [token])])
