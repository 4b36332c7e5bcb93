"""Huge-prompt benchmark: ``/health`` latency while an 8 MB prompt is sent to ``met serve``, and how
long the prompt takes to be refused (over real HTTP, the built-in model, its embedded Redis).

A thread probes ``GET /health`` every 5 ms on its own connection while the main thread posts each
prompt; the table gives the prompt's status and latency and the probes' p50 / p99 / max.

    python -m bench.prompt_size [--mb 8] [--port 8765] [--met .venv/bin/met]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

SENTENCE = "The keeper of the light walked along the shore counting waves. "
console = Console()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=8.0, help="prompt size in millions of characters")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--met", default=shutil.which("met") or str(Path(sys.executable).with_name("met")))
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    env = {name: value for name, value in os.environ.items() if not name.startswith("MET_")}
    serve = subprocess.Popen(
        [args.met, "serve", "--port", str(args.port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_ready(base, serve)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        text = (SENTENCE * (int(args.mb * 1e6) // len(SENTENCE) + 1))[: int(args.mb * 1e6)]
        bodies = {
            "chat": ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}]}),
            "completion": ("/v1/completions", {"model": model, "prompt": text}),
        }
        table = Table(title=f"{args.mb:g} M-character prompt against met serve ({model})")
        for column in ("endpoint", "status", "answered in ms", "health p50 ms", "p99 ms", "max ms", "probes"):
            table.add_column(column, justify="right")
        for name, (path, body) in bodies.items():
            status, took, probes = _measure(base, path, body)
            ranked = sorted(probes)
            table.add_row(
                name,
                str(status),
                f"{took * 1e3:.0f}",
                f"{ranked[len(ranked) // 2] * 1e3:.1f}",
                f"{ranked[min(len(ranked) - 1, int(len(ranked) * 0.99))] * 1e3:.1f}",
                f"{ranked[-1] * 1e3:.1f}",
                str(len(ranked)),
            )
        console.print(table)
    finally:
        serve.terminate()
        serve.wait(timeout=30)


def _measure(base: str, path: str, body: dict[str, object]) -> tuple[int, float, list[float]]:
    """Post ``body`` while probing /health: the status, the seconds it took, the probes' seconds.

    The body is encoded before probing starts, so this process's own JSON work does not delay its probes."""
    content = json.dumps(body).encode()
    probes: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=base, timeout=30) as client:
            while not done.is_set():
                started = time.perf_counter()
                client.get("/health")
                probes.append(time.perf_counter() - started)
                time.sleep(0.005)

    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(0.2)
    with httpx.Client(base_url=base, timeout=120) as client:
        started = time.perf_counter()
        status = client.post(path, content=content, headers={"content-type": "application/json"}).status_code
        took = time.perf_counter() - started
    time.sleep(0.2)
    done.set()
    prober.join()
    return status, took, probes


def _wait_ready(base: str, serve: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            raise SystemExit(f"met serve exited with {serve.returncode}")
        try:
            if httpx.get(f"{base}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("met serve did not become ready")


if __name__ == "__main__":
    main()
