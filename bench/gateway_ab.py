"""Two gateways' CPU per delivered token, side by side in front of one fleet: a before/after that holds
on a machine whose load moves.

    python bench/gateway_ab.py --a TREE --b TREE [--model tiny] [--streams 64] [--prompts 128]
                               [--input-len 128] [--output-len 128] [--rounds 2]

A private ``redis-server``, one ``met worker`` (from the tree this script runs in) and two ``met
gateway`` processes on the same namespace, one imported from each source tree (``PYTHONPATH``). The load
(``metrale.cli.loadgen``, in this process) is split in two halves run at once, ``--streams / 2`` streams
through each gateway, so both relay the same worker's steps under the same machine load at the same
time; CPU µs per delivered token of each gateway is read from ``/proc``. ``--rounds`` repeats the
measurement (the halves swap gateways each round), and the ratio b ÷ a of each round is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet import QUIET, private_redis, process_cpu_s
from metrale.cli.loadgen import LoadSpec, run_load
from metrale.worker.model.builtin import RANDOM_MODEL_NAME, random_model_dir
from tests.integration.deployments import API_KEY, TENANT, TORCH_THREADS, running_fleet
from tests.integration.processes import free_port, met_environment, start_met, wait_ready


async def both(urls: list[str], specs: list[LoadSpec], headers: dict[str, str]) -> list[dict[str, object]]:
    return list(await asyncio.gather(*(run_load(url, spec, headers) for url, spec in zip(urls, specs, strict=True))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="source tree of gateway a")
    parser.add_argument("--b", type=Path, required=True, help="source tree of gateway b")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.streams < 2 or args.prompts < 2:
        parser.error("--streams and --prompts must be at least 2 (half through each gateway)")
    work = Path(tempfile.mkdtemp(prefix="metrale-bench-gateway-ab-"))
    settings = {"MET_MODEL_DIR": str(random_model_dir(work / "cache")), **QUIET}
    half = LoadSpec(RANDOM_MODEL_NAME, args.prompts // 2, args.input_len, args.output_len, args.streams // 2)
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    ratios = []
    with private_redis() as server, running_fleet(server.url, work, settings=settings) as fleet, ExitStack() as stack:
        urls, pids = {}, {}
        for name, tree in trees.items():
            env = met_environment(
                {**settings, "MET_NAMESPACE": fleet.keys.namespace, "MET_API_KEYS": f"{API_KEY}:{TENANT}"},
                torch_threads=TORCH_THREADS,
            ) | {"PYTHONPATH": str(tree)}
            port = free_port()
            gateway = start_met(f"gateway-{name}", ["gateway", "--redis", server.url, "--port", str(port)], env, work)
            stack.callback(gateway.stop)
            urls[name] = f"http://127.0.0.1:{port}"
            wait_ready(gateway, urls[name], others=[fleet.worker])
            pids[name] = gateway.popen.pid
        headers = fleet.endpoint.headers
        warm = dataclasses.replace(half, num_prompts=half.concurrency, output_len=8, seed=1)
        asyncio.run(both(list(urls.values()), [warm, warm], headers))
        for round_ in range(args.rounds):
            order = ["a", "b"] if round_ % 2 == 0 else ["b", "a"]
            specs = [dataclasses.replace(half, seed=2 * round_ + k) for k in range(2)]
            before = {name: process_cpu_s(pid) for name, pid in pids.items()}
            reports = dict(zip(order, asyncio.run(both([urls[n] for n in order], specs, headers)), strict=True))
            per_token = {}
            for name, report in reports.items():
                if report["failed"]:
                    raise RuntimeError(f"gateway {name}: {report['failed']} requests failed: {report['errors']}")
                tokens = round(float(report["output_token_throughput"]) * float(report["duration_s"]))  # type: ignore[arg-type]
                per_token[name] = 1e6 * (process_cpu_s(pids[name]) - before[name]) / tokens
            ratios.append(per_token["b"] / per_token["a"])
            print(
                f"round {round_ + 1}: gateway CPU µs per delivered token a {per_token['a']:.1f}, "
                f"b {per_token['b']:.1f}; b ÷ a {ratios[-1]:.3f}"
            )
    print(f"a = {trees['a']}, b = {trees['b']}; b ÷ a median {statistics.median(ratios):.3f} over {args.rounds} rounds")


if __name__ == "__main__":
    main()
