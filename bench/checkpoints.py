"""Checkpoint benchmark: TTFT of the 8th turn of a chat with and without checkpoints (gateway + worker +
Redis, one run), and checkpoint save/load time and size for the built-in model and a
Kimi-Linear-48B-shaped state (state bytes only; no weights).

    python bench/checkpoints.py [--redis redis://127.0.0.1:6379/15] [--turn-words 170] [--reply 40]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis
import torch
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from metrale.cli.sse_lines import iter_sse_lines
from metrale.gateway.app import create_app
from metrale.shared.keys import Keys
from metrale.shared.settings import GatewaySettings, KernelBackend, WorkerSettings
from metrale.worker.checkpoints.format import CheckpointMeta, decode_checkpoint, encode_checkpoint
from metrale.worker.checkpoints.store import MemoryTier, RedisTier
from metrale.worker.engine.factory import EngineLimits
from metrale.worker.fleet.assembly import build_worker
from metrale.worker.model.builtin import random_model_dir
from metrale.worker.model.config import ModelConfig
from metrale.worker.model.state import StatePool, state_sizes

WORDS = [
    "the",
    "keeper",
    "of",
    "the",
    "light",
    "walked",
    "along",
    "the",
    "shore",
    "counting",
    "waves",
    "and",
    "gulls",
    "before",
    "dawn",
]
KIMI_48B = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_expert_group": 1,
    "moe_intermediate_size": 1024,
    "dtype": "bfloat16",
}  # transformers' KimiLinearConfig defaults


@contextlib.contextmanager
def worker(url: str, keys: Keys, model_dir: Path, checkpoints: bool) -> Iterator[None]:
    settings = WorkerSettings(
        redis_url=url,
        model_dir=model_dir,
        checkpoint_dir=None,
        kernels=KernelBackend.TORCH,
        heartbeat_ttl_s=5,
        namespace=keys.namespace,
    )
    client = redis.Redis.from_url(url)
    name = f"bench-{uuid.uuid4().hex[:6]}"
    service = build_worker(
        settings,
        client,
        directory=model_dir,
        served_name="tiny",
        worker_id=name,
        limits=EngineLimits(max_seqs=4, num_blocks=1024),
        checkpoints=checkpoints,
    )
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    while not client.exists(keys.worker(name)):
        time.sleep(0.02)
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


@contextlib.contextmanager
def gateway(settings: GatewaySettings) -> Iterator[str]:
    """The gateway app under uvicorn on a free port, in a thread; yields its base URL (real HTTP, so a
    stream's first chunk arrives when it is sent)."""
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def chat_ttfts(url: str, model_dir: Path, checkpoints: bool, turns: int, words: int, reply: int) -> list[float]:
    keys = Keys(f"met-bench-{uuid.uuid4().hex[:8]}")
    settings = GatewaySettings(
        redis_url=url, api_keys={}, request_timeout_s=300, max_queue=100, heartbeat_ttl_s=5, namespace=keys.namespace
    )
    messages: list[dict[str, str]] = [{"role": "system", "content": "You keep a lighthouse log."}]
    ttfts = []
    with (
        worker(url, keys, model_dir, checkpoints),
        gateway(settings) as base,
        httpx.Client(base_url=base, timeout=300) as http,
    ):
        for turn in range(turns):
            text = " ".join(WORDS[(turn * 7 + i) % len(WORDS)] for i in range(words))
            messages.append({"role": "user", "content": text})
            body = {
                "model": "tiny",
                "messages": messages,
                "max_tokens": reply,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "session": "bench",
                # Every token yields a chunk, so the first chunk times the first token even when its
                # bytes do not complete a character yet.
                "logprobs": True,
            }
            start, first, content = time.perf_counter(), None, ""
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
                for line in iter_sse_lines(response.iter_text()):
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        if choice.get("logprobs") and first is None:
                            first = time.perf_counter() - start
                        content += choice["delta"].get("content") or ""
            ttfts.append(first or 0.0)
            messages.append({"role": "assistant", "content": content})
    sync = redis.Redis.from_url(url)
    sync.delete(*sync.scan_iter(f"{keys.namespace}:*"))
    return ttfts


def save_load(config: ModelConfig, dtype: torch.dtype, length: int, tier: MemoryTier | RedisTier) -> dict[str, float]:
    pool = StatePool(config, num_slots=1, num_blocks=-(-length // 16), block_size=16, latent_dtype=dtype)
    for tensor in (*pool.recurrent.values(), *pool.conv.values(), *pool.kv.values()):
        tensor.normal_()
    blocks = list(range(pool.num_blocks))
    meta = CheckpointMeta("bench", "t", length, "0" * 32, str(dtype).removeprefix("torch."))
    save, load = [], []
    for _ in range(3):
        start = time.perf_counter()
        data = encode_checkpoint(pool.export(0, blocks, length), meta)
        tier.put("met-bench:ckpt", data)
        save.append(time.perf_counter() - start)
        start = time.perf_counter()
        state = decode_checkpoint(tier.get("met-bench:ckpt") or b"", meta)
        assert isinstance(state, dict)
        pool.import_(state, 0, blocks)
        load.append(time.perf_counter() - start)
    tier.delete("met-bench:ckpt")
    return {"bytes": len(data), "save_ms": 1000 * statistics.median(save), "load_ms": 1000 * statistics.median(load)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-words", type=int, default=170)
    parser.add_argument("--reply", type=int, default=40)
    args = parser.parse_args()
    model_dir = random_model_dir(Path("~/.cache/metrale"))
    warm = chat_ttfts(args.redis, model_dir, True, args.turns, args.turn_words, args.reply)
    cold = chat_ttfts(args.redis, model_dir, False, args.turns, args.turn_words, args.reply)
    print("| turn | TTFT with checkpoints (ms) | TTFT without (ms) | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for turn, (w, c) in enumerate(zip(warm, cold, strict=True), start=1):
        print(f"| {turn} | {1000 * w:.1f} | {1000 * c:.1f} | {w / c:.2f} |")
    client = redis.Redis.from_url(args.redis)
    print()
    print("| state | tokens | bytes | tier | save (ms) | load (ms) |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    shapes = [
        ("built-in tiny", ModelConfig.from_pretrained(model_dir), torch.float32),
        ("Kimi-Linear-48B-shaped", ModelConfig.from_hf_dict(KIMI_48B), torch.bfloat16),
    ]
    for name, config, dtype in shapes:
        sizes = state_sizes(config, dtype)
        print(f"<!-- {name}: {sizes.slot_bytes:,} bytes per sequence (KDA) + {sizes.token_bytes:,} per token (MLA) -->")
        for length in (2048,):
            for tier in (MemoryTier(1 << 30), RedisTier(client, max_bytes=1 << 30)):
                r = save_load(config, dtype, length, tier)
                print(f"| {name} | {length} | {r['bytes']:,} | {tier.name} | {r['save_ms']:.1f} | {r['load_ms']:.1f} |")


if __name__ == "__main__":
    main()
