"""Speculative decoding (issue #33): met with and without it, in one run, as CPU per token and ratios.

    python bench/speculation.py [--model qwen3_5-medium] [--threads 1] [--repeats 3] [--k 4]
                                [--no-batch] [--no-ngram] [--llamacpp] [--json]
    python bench/speculation.py --row-costs | --verify-costs [--model qwen3_5-medium] [--threads 1]

Acceptance is set by the bench, not hoped for: the drafts of the oracle drafter are the target's own greedy
continuation (computed first, without speculation) with a chosen share of its positions drafted wrong
(drawn at random, seeded, so every run draws the same), at acceptance 1.0, 0.7, 0.4 and 0:

- one stream (a ``--prompt-len`` prompt, ``--new-tokens`` greedy tokens): met without speculation, with it
  (adaptive draft length, the engine's default) and with every step verifying ``--k`` draft tokens (no
  back-off), decode-phase CPU seconds per token and wall tokens/s, and the measured acceptance;
- ``--batch`` × (prompt + new) greedy requests at once, without speculation and with it (oracle drafts at
  acceptance 1.0: the draft that most tempts a step to verify);
- the real n-gram method (``{"method": "ngram", "num_speculative_tokens": k}``) on the built-in model over a
  few code files, each followed by its first lines (an editor rewriting a file): its measured acceptance
  and speed-up, adaptive and without back-off.

Every speculative run's tokens are checked against the plain run's (an exception if they differ). CPU
per token is the best of ``--repeats``; each speculative run follows a plain run of its own, and its
speed-up is the median over repeats of that pair's ratio of CPU seconds per token (a loaded machine's
wall times, and minutes apart even its CPU times, are other people's load). ``--llamacpp`` adds
llama.cpp's plain decode of the same model (``llama-bench -n``, wall tokens/s) in the same run, if
llama.cpp is built under
``<MET_CACHE_DIR>/llamacpp/`` (``bench/vs_llamacpp.py`` builds it; this bench does not).

``--row-costs`` instead times forwards of B decode rows each carrying k draft tokens (B 1-16, k 0-4), CPU
ms per step; ``--verify-costs`` one stream through the engine verifying k = 1..4 draft tokens every step,
all accepted and none, as the cost of a step in lone decode steps: what
``metrale.worker.engine.draft_length.CPU_STEP_COST`` is fitted on.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import prompts_for
from bench.models import MODEL_NAMES, bench_model
from metrale.worker.engine.draft_length import DraftLengthPolicy, FullDraftLengths
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.request import Request
from metrale.worker.engine.sampling_params import SamplingParams
from metrale.worker.engine.speculation import Drafter, SpeculativeConfig
from metrale.worker.model.builtin import builtin_model_dir
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.family import FamilyModel
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model
from metrale.worker.scheduler.config import SchedulerConfig
from metrale.worker.scheduler.sequence import SequenceId

ACCEPTANCES = (1.0, 0.7, 0.4, 0.0)
BLOCK = 16

CODE_FILES = (
    '''import json
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Inventory:
    """Items on hand, by name, with their unit price and count."""

    items: dict[str, tuple[float, int]] = field(default_factory=dict)

    def add(self, name: str, price: float, count: int = 1) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        old_price, old_count = self.items.get(name, (price, 0))
        if old_count and old_price != price:
            raise ValueError(f"{name} is priced {old_price}, not {price}")
        self.items[name] = (price, old_count + count)

    def remove(self, name: str, count: int = 1) -> None:
        price, held = self.items[name]
        if count > held:
            raise ValueError(f"only {held} of {name} on hand")
        if count == held:
            del self.items[name]
        else:
            self.items[name] = (price, held - count)

    def value(self) -> float:
        return sum(price * count for price, count in self.items.values())

    def save(self, path: Path) -> None:
        data = {name: {"price": p, "count": c} for name, (p, c) in self.items.items()}
        path.write_text(json.dumps(data, indent=2, sort_keys=True))

    @classmethod
    def load(cls, path: Path) -> "Inventory":
        data = json.loads(path.read_text())
        inventory = cls()
        for name, entry in data.items():
            inventory.add(name, entry["price"], entry["count"])
        return inventory
''',
    '''import os
import sys


def walk_sizes(root):
    """Yield (path, size) for every regular file under root, depth first."""
    for directory, subdirectories, files in os.walk(root):
        subdirectories.sort()
        for name in sorted(files):
            path = os.path.join(directory, name)
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            yield path, size


def human(size):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return "%d %s" % (size, unit)
        size //= 1024
    return "%d TiB" % size


def largest(root, count=10):
    sizes = sorted(walk_sizes(root), key=lambda item: item[1], reverse=True)
    return sizes[:count]


def main(argv):
    if len(argv) < 2:
        print("usage: %s DIRECTORY [COUNT]" % argv[0], file=sys.stderr)
        return 2
    root = argv[1]
    count = int(argv[2]) if len(argv) > 2 else 10
    total = 0
    for path, size in largest(root, count):
        total += size
        print("%10s  %s" % (human(size), path))
    print("%10s  total of the %d largest" % (human(total), count))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
''',
    '''class Node:
    def __init__(self, key, value):
        self.key = key
        self.value = value
        self.prev = None
        self.next = None


class LRUCache:
    """A least-recently-used cache of at most capacity entries."""

    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.map = {}
        self.head = Node(None, None)
        self.tail = Node(None, None)
        self.head.next = self.tail
        self.tail.prev = self.head

    def _unlink(self, node):
        node.prev.next = node.next
        node.next.prev = node.prev

    def _push_front(self, node):
        node.next = self.head.next
        node.prev = self.head
        self.head.next.prev = node
        self.head.next = node

    def get(self, key, default=None):
        node = self.map.get(key)
        if node is None:
            return default
        self._unlink(node)
        self._push_front(node)
        return node.value

    def put(self, key, value):
        node = self.map.get(key)
        if node is not None:
            node.value = value
            self._unlink(node)
            self._push_front(node)
            return
        if len(self.map) == self.capacity:
            oldest = self.tail.prev
            self._unlink(oldest)
            del self.map[oldest.key]
        node = Node(key, value)
        self.map[key] = node
        self._push_front(node)

    def __len__(self):
        return len(self.map)
''',
)


class OracleDrafter:
    """Drafts each choice's own greedy continuation (``expected``, by request id), with exactly
    ``wrong_share`` of its positions (``wrong_positions``) replaced by another token."""

    def __init__(self, expected: Mapping[str, Sequence[int]], wrong_share: float, k: int, vocab: int) -> None:
        self.expected, self.vocab = expected, vocab
        self.wrong = {rid: wrong_positions(rid, len(tokens), wrong_share) for rid, tokens in expected.items()}
        self.num_speculative_tokens = k

    def propose(
        self, seq_id: SequenceId, prompt_ids: Sequence[int], output_ids: Sequence[int], at_most: int
    ) -> Sequence[int]:
        done, wrong = len(output_ids), self.wrong[seq_id.request_id]
        continuation = self.expected[seq_id.request_id][done : done + min(at_most, self.num_speculative_tokens)]
        return [(token + 1) % self.vocab if done + i in wrong else token for i, token in enumerate(continuation)]

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""


def wrong_positions(request_id: str, length: int, wrong_share: float) -> frozenset[int]:
    """``round(wrong_share * length)`` of the positions ``0 .. length - 1``, drawn at random (seeded by
    ``request_id``, so every run draws the same): where the oracle's draft token is replaced."""
    return frozenset(random.Random(request_id).sample(range(length), round(wrong_share * length)))


@dataclass(frozen=True)
class Measured:
    """One run: decode-phase CPU seconds per generated token (all threads), wall tokens/s over the same
    phase, and what speculation did (zeros without it)."""

    cpu_s_per_token: float
    tokens_per_s: float
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


def make_engine(
    model: FamilyModel,
    max_seqs: int,
    total: int,
    drafter: Drafter | None = None,
    lengths: DraftLengthPolicy | None = None,
) -> Engine:
    blocks = max_seqs * (-(-(total + 8) // BLOCK))
    executor = ModelExecutor(model, num_slots=max_seqs, num_blocks=blocks, block_size=BLOCK)
    config = SchedulerConfig(
        max_batch_tokens=max(2048, max_seqs),
        max_seqs=max_seqs,
        num_slots=max_seqs,
        num_blocks=blocks,
        block_size=BLOCK,
        max_model_len=total + 8,
    )
    return Engine(executor, config, seed=0, drafter=drafter, draft_lengths=lengths)


def timed_run(
    engine: Engine, prompts: Sequence[Sequence[int]], new_tokens: int
) -> tuple[Measured, dict[str, list[int]]]:
    """All ``prompts`` through ``engine`` at once (greedy, ``ignore_eos``); the decode phase is timed from
    the step after the last prompt's first token."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"p{i}", tuple(prompt), params))
        tokens[f"p{i}"] = []
    cpu_start = wall_start = 0.0
    counted = -1
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
        if counted < 0 and all(tokens.values()):
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            counted = sum(map(len, tokens.values()))
    cpu, wall = time.process_time() - cpu_start, time.perf_counter() - wall_start
    produced = sum(map(len, tokens.values())) - counted
    stats = engine.speculation_stats()
    return Measured(cpu / produced, produced / wall, stats.draft_tokens, stats.accepted_tokens), tokens


def check_same(plain: dict[str, list[int]], tokens: dict[str, list[int]], what: str) -> None:
    for request_id, expected in plain.items():
        if tokens[request_id] != expected:
            raise RuntimeError(f"{what}: {request_id}'s tokens differ from the plain run's")


def best(runs: list[Measured]) -> Measured:
    return min(runs, key=lambda run: run.cpu_s_per_token)


def paired_speed_up(plain: list[Measured], runs: list[Measured]) -> float:
    """The median over repeats of a plain run's CPU per token over the run right after it: on a loaded
    machine a pair seconds apart shares its load, where the best of each may come from different minutes."""
    return statistics.median(p.cpu_s_per_token / r.cpu_s_per_token for p, r in zip(plain, runs, strict=True))


def one_stream(model: FamilyModel, vocab: int, args: argparse.Namespace) -> dict[str, list[Measured]]:
    prompt = prompts_for(1, args.prompt_len, vocab)
    total = args.prompt_len + args.new_tokens
    make_engine(model, 1, total).generate(prompt, SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    runs: dict[str, list[Measured]] = {}
    for repeat in range(args.repeats):
        for acceptance in args.acceptances:
            for name, lengths in (("adaptive", None), ("full", FullDraftLengths())):
                measured, plain = timed_run(make_engine(model, 1, total), prompt, args.new_tokens)
                runs.setdefault("plain", []).append(measured)
                runs.setdefault(f"{acceptance}/{name}/plain", []).append(measured)
                drafter = OracleDrafter(plain, 1.0 - acceptance, args.k, vocab)
                engine = make_engine(model, 1, total, drafter, lengths)
                measured, tokens = timed_run(engine, prompt, args.new_tokens)
                check_same(plain, tokens, f"acceptance {acceptance} {name}")
                runs.setdefault(f"{acceptance}/{name}", []).append(measured)
        print(f"  one stream, repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    return runs


def batch_load(model: FamilyModel, vocab: int, args: argparse.Namespace) -> dict[str, list[Measured]]:
    prompts = prompts_for(args.batch, args.prompt_len, vocab)
    total = args.prompt_len + args.new_tokens
    runs: dict[str, list[Measured]] = {}
    for repeat in range(args.batch_repeats):
        measured, plain = timed_run(make_engine(model, args.batch, total), prompts, args.new_tokens)
        runs.setdefault("plain", []).append(measured)
        drafter = OracleDrafter(plain, 0.0, args.k, vocab)
        measured, tokens = timed_run(make_engine(model, args.batch, total, drafter), prompts, args.new_tokens)
        check_same(plain, tokens, "batch with speculation")
        runs.setdefault("speculative", []).append(measured)
        print(f"  batch, repeat {repeat + 1}/{args.batch_repeats} done", file=sys.stderr, flush=True)
    return runs


def code_prompts(tokenizer: Tokenizer, lines: int = 3) -> list[list[int]]:
    """Each code file, then a line saying it comes again, then its first ``lines`` lines."""
    prompts = []
    for text in CODE_FILES:
        again = "\n".join(text.splitlines()[:lines])
        prompts.append(tokenizer.encode(f"{text}\n\n# The same file, once more:\n{again}\n").ids)
    return prompts


def ngram_on_code(args: argparse.Namespace) -> dict[str, list[Measured]]:
    directory = builtin_model_dir()
    model = load_model(directory, dtype="auto")
    prompts = code_prompts(Tokenizer.from_file(str(directory / "tokenizer.json")))
    total = max(map(len, prompts)) + args.new_tokens
    config = SpeculativeConfig("ngram", args.k, 4, 1)
    runs: dict[str, list[Measured]] = {}
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):  # one stream each
            measured, plain = timed_run(make_engine(model, 1, total), [prompt], args.new_tokens)
            runs.setdefault(f"plain/{i}", []).append(measured)
            for name, lengths in (("adaptive", None), ("full", FullDraftLengths())):
                engine = make_engine(model, 1, total, config.drafter(), lengths)
                measured, tokens = timed_run(engine, [prompt], args.new_tokens)
                check_same(plain, tokens, f"n-gram {name}")
                runs.setdefault(f"{name}/{i}", []).append(measured)
        print(f"  n-gram, repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    return runs


def llamacpp_decode(directory: Path, args: argparse.Namespace) -> tuple[float, str] | None:
    """llama.cpp's plain decode (``llama-bench -n``, wall tok/s) of the same model in f32; None when
    llama.cpp is not built (this bench never builds it)."""
    from bench.llamacpp import TARGETS, cache_root, converted, ensure_built, llama_bench

    if not all((cache_root() / "build" / "bin" / tool).exists() for tool in TARGETS):
        return None
    llama = ensure_built()  # built already: this only finds it and checks its commit
    gguf = converted(llama, directory, "f32")
    result = llama_bench(llama, gguf, args.prompt_len, args.new_tokens, args.threads, max(args.repeats, 1))
    return result.tg_tokens_per_s, gguf.name


def row_costs(model: FamilyModel) -> list[tuple[int, int, float]]:
    """(B, k, CPU ms) for a forward of B decode rows each verifying k draft tokens (median of 15)."""
    slots, length = 16, 64
    per_slot = length // BLOCK
    executor = ModelExecutor(model, num_slots=slots, num_blocks=slots * per_slot, block_size=BLOCK)
    generator = torch.Generator().manual_seed(0)

    def blocks(slot: int) -> list[int]:
        return list(range(slot * per_slot, (slot + 1) * per_slot))

    rows = []
    for batch in (1, 2, 4, 8, 16):
        for k in range(5):
            prompts = [torch.randint(0, 500, (16,), generator=generator).tolist() for _ in range(batch)]
            executor.forward([ForwardChunk(s, blocks(s), 0, prompts[s]) for s in range(batch)])
            times = []
            for position in range(16, 32):
                tokens = torch.randint(0, 500, (1 + k,), generator=generator).tolist()
                start = time.process_time()
                executor.forward([ForwardChunk(s, blocks(s), position, tokens, verify=k > 0) for s in range(batch)])
                for s in range(batch if k else 0):
                    executor.settle_verified(s, 1)
                times.append(time.process_time() - start)
            rows.append((batch, k, sorted(times[1:])[len(times[1:]) // 2] * 1e3))
            print(f"  B={batch:2d} k={k}: {rows[-1][2]:.2f} CPU ms", file=sys.stderr, flush=True)
    return rows


def verify_costs(model: FamilyModel, vocab: int, args: argparse.Namespace) -> None:
    """One stream verifying k draft tokens every step (``FullDraftLengths``), all right and all wrong:
    a step's CPU seconds over a plain step's, best of ``--repeats``, runs interleaved."""
    prompt = prompts_for(1, args.prompt_len, vocab)
    total = args.prompt_len + args.new_tokens
    _, plain = timed_run(make_engine(model, 1, total), prompt, args.new_tokens)
    runs: dict[tuple[float, int], list[Measured]] = {}
    for _ in range(args.repeats):
        for wrong_share in (0.0, 1.0):
            for k in range(5):
                drafter = OracleDrafter(plain, wrong_share, k, vocab) if k else None
                engine = make_engine(model, 1, total, drafter, FullDraftLengths() if k else None)
                runs.setdefault((wrong_share, k), []).append(timed_run(engine, prompt, args.new_tokens)[0])
    print("| draft tokens k | step cost, all accepted | step cost, none accepted |")
    print("|---|---|---|")
    for k in range(1, 5):
        costs = []
        for wrong_share in (0.0, 1.0):
            tokens_per_step = 1 if wrong_share == 1.0 else k + 1
            step = best(runs[(wrong_share, k)]).cpu_s_per_token * tokens_per_step
            costs.append(step / best(runs[(wrong_share, 0)]).cpu_s_per_token)
        print(f"| {k} | {costs[0]:.2f} | {costs[1]:.2f} |")
    print("\nIn lone decode steps (CPU seconds per step over a plain step's, measured beside it).")


def print_row_costs(rows: list[tuple[int, int, float]]) -> None:
    cost = {(b, k): ms for b, k, ms in rows}
    lone = cost[(1, 0)]
    print("| decode rows B | k = 0 | k = 1 | k = 2 | k = 3 | k = 4 | speed-up, all accepted, k = 1 / 4 |")
    print("|---|---|---|---|---|---|---|")
    for b in sorted({b for b, _, _ in rows}):
        cells = " | ".join(f"{cost[(b, k)]:.1f}" for k in range(5))
        speed = f"{2 * cost[(b, 0)] / cost[(b, 1)]:.2f} / {5 * cost[(b, 0)] / cost[(b, 4)]:.2f}"
        print(f"| {b} | {cells} | {speed} |")
    batches = sorted({b for b, _, _ in rows})
    decode_row = (cost[(batches[-1], 0)] / lone - 1) / (batches[-1] - 1)
    verify = [(cost[(b, 4)] - cost[(b, 0)]) / (4 * b * lone) for b in batches]
    print(
        f"\nCPU ms per step; a lone decode step {lone:.2f} ms. Per lone step: each more decode row "
        f"{decode_row:.3f}; each draft token verified {min(verify):.2f}-{max(verify):.2f} (by B)."
    )


def ratio_table(stream: dict[str, list[Measured]], llama: tuple[float, str] | None, k: int) -> None:
    plain = best(stream["plain"])
    print(f"\n### One stream, k = {k} (oracle drafts)\n")
    print(
        "| drafts right | met | CPU ms / token | measured acceptance | speed-up, CPU / token (paired) | tok/s (wall) |"
    )
    print("|---|---|---|---|---|---|")
    print(f"| — | plain | {plain.cpu_s_per_token * 1e3:.2f} | — | 1.00 | {plain.tokens_per_s:.1f} |")
    measured = {float(key.split("/")[0]) for key in stream if "/" in key}  # the acceptances run
    for acceptance in sorted(measured, reverse=True):
        for name in ("adaptive", "full"):
            run = best(stream[f"{acceptance}/{name}"])
            speed_up = paired_speed_up(stream[f"{acceptance}/{name}/plain"], stream[f"{acceptance}/{name}"])
            label = "speculative (adaptive)" if name == "adaptive" else f"speculative (always {k})"
            print(
                f"| {acceptance:.1f} | {label} | {run.cpu_s_per_token * 1e3:.2f} | {run.acceptance:.2f} | "
                f"{speed_up:.2f} | {run.tokens_per_s:.1f} |"
            )
    if llama is not None:
        tok_s, gguf = llama
        full = best(stream["1.0/adaptive"]) if "1.0/adaptive" in stream else None
        if full is None:
            return
        print(
            f"\nllama.cpp plain decode ({gguf}): {tok_s:.1f} tok/s wall; met speculative at 1.0 ÷ llama.cpp: "
            f"{full.tokens_per_s / tok_s:.2f} (wall), plain met ÷ llama.cpp {plain.tokens_per_s / tok_s:.2f}"
        )


def batch_table(batch: dict[str, list[Measured]], args: argparse.Namespace) -> None:
    plain, spec = best(batch["plain"]), best(batch["speculative"])
    speed_up = paired_speed_up(batch["plain"], batch["speculative"])
    print(f"\n### {args.batch} × ({args.prompt_len} + {args.new_tokens}), decode phase\n")
    print("| met | CPU ms / token | tok/s (wall) | draft tokens verified | speed-up, CPU / token (paired) |")
    print("|---|---|---|---|---|")
    print(f"| plain | {plain.cpu_s_per_token * 1e3:.3f} | {plain.tokens_per_s:.1f} | — | 1.00 |")
    print(
        f"| speculative (oracle, all right) | {spec.cpu_s_per_token * 1e3:.3f} | {spec.tokens_per_s:.1f} | "
        f"{spec.draft_tokens} | {speed_up:.2f} |"
    )


def ngram_table(ngram: dict[str, list[Measured]], k: int) -> None:
    print(f"\n### n-gram method on the built-in model, code files then their first lines, k = {k}\n")
    print("| prompt | plain CPU ms / token | adaptive: acceptance, ÷ plain | always k: acceptance, ÷ plain |")
    print("|---|---|---|---|")
    for i in range(len(CODE_FILES)):
        plain = best(ngram[f"plain/{i}"])
        cells = []
        for name in ("adaptive", "full"):
            run = best(ngram[f"{name}/{i}"])
            speed_up = paired_speed_up(ngram[f"plain/{i}"], ngram[f"{name}/{i}"])
            cells.append(f"{run.acceptance:.2f} ({run.accepted_tokens}/{run.draft_tokens}), {speed_up:.2f}")
        print(f"| {i} | {plain.cpu_s_per_token * 1e3:.2f} | {cells[0]} | {cells[1]} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODEL_NAMES, default="qwen3_5-medium")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-repeats", type=int, default=1)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument(
        "--acceptances", type=float, nargs="+", default=list(ACCEPTANCES), help="shares of right draft tokens"
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--no-batch", action="store_true")
    parser.add_argument("--no-ngram", action="store_true")
    parser.add_argument("--llamacpp", action="store_true", help="llama.cpp's plain decode, if it is built")
    parser.add_argument("--row-costs", action="store_true")
    parser.add_argument("--verify-costs", action="store_true")
    parser.add_argument("--json", action="store_true", help="also print every run as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    directory = bench_model(args.model, Path(tempfile.gettempdir()) / "metrale-bench", dtype=args.dtype)
    model = load_model(directory, dtype="auto")
    print(f"model {args.model} ({args.dtype}), {args.threads} thread(s), k = {args.k}, best of {args.repeats}\n")
    if args.row_costs:
        print_row_costs(row_costs(model))
        return
    vocab = model.config.vocab_size
    if args.verify_costs:
        verify_costs(model, vocab, args)
        return
    llama = None
    if args.llamacpp:
        llama = llamacpp_decode(directory, args)
        if llama is None:
            print(
                "llama.cpp is not built under <MET_CACHE_DIR>/llamacpp/ (bench/vs_llamacpp.py builds it): "
                "its line is left out\n"
            )
    results: dict[str, dict[str, list[Measured]]] = {"one stream": one_stream(model, vocab, args)}
    if not args.no_batch:
        results["batch"] = batch_load(model, vocab, args)
    if not args.no_ngram:
        results["n-gram"] = ngram_on_code(args)
    ratio_table(results["one stream"], llama, args.k)
    if "batch" in results:
        batch_table(results["batch"], args)
    if "n-gram" in results:
        ngram_table(results["n-gram"], args.k)
    if args.json:
        every = {
            part: {name: [asdict(run) for run in runs] for name, runs in parts.items()}
            for part, parts in results.items()
        }
        print(json.dumps(every, indent=1))


if __name__ == "__main__":
    main()
