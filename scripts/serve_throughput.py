"""The local server's throughput: total reply tokens per second with 1 and N concurrent clients.

Starts ``specmemo serve``'s server in this process on a free 127.0.0.1 port with the default
model planned as the command plans it (the planner's tree, greedy), or measures one already
running (``--base-url``). Each client is a thread with its own ``openai`` client sending its
share of the prompts one after another; throughput = completion tokens of all replies /
wall time from the first request to the last reply. One warm-up request is not counted.
In-process, the same prompts are also decoded without the server (``direct``), back to back
with the runs, so the server's own cost can be read under the same load.

    python scripts/serve_throughput.py --clients 1 4 --out docs/results/serve_throughput_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about a cat who likes to sleep in the sun.",
    "What are three tips for staying focused while studying?",
    "Describe how a bicycle works to a ten-year-old.",
    "Give me a simple recipe for pancakes.",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "How do plants make their food?",
]


def one_client(base_url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    client = openai.OpenAI(base_url=base_url, api_key="any", max_retries=0, timeout=600)
    out = []
    for prompt in prompts:
        start = time.perf_counter()
        reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=0)
        out.append({"completion_tokens": reply.usage.completion_tokens, "seconds": time.perf_counter() - start,
                    **reply.specmemo})
    return out


def measure(base_url: str, clients: int, requests: int, max_tokens: int) -> dict:
    shares = [[PROMPTS[(c + i * clients) % len(PROMPTS)] for i in range(requests)] for c in range(clients)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for share in pool.map(lambda s: one_client(base_url, s, max_tokens), shares) for r in share]
    wall = time.perf_counter() - start
    tokens = sum(r["completion_tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "completion_tokens": tokens, "wall_s": round(wall, 2),
            "total_tokens_per_s": round(tokens / wall, 2),
            "mean_request_s": round(statistics.mean(r["seconds"] for r in results), 2),
            "mean_decode_tokens_per_s": round(statistics.mean(r["tokens_per_s"] for r in results), 2),
            "mean_accepted": round(statistics.mean(r["mean_accepted"] for r in results), 3),
            "mean_queued_s": round(statistics.mean(r["queued_s"] for r in results), 2)}


def measure_direct(planned, capacity: int, requests: int, max_tokens: int) -> dict:
    """The same prompts decoded without the server (a fresh chat session each, as ``generate``
    does): what the server's own overhead is measured against, under the same load."""
    from specmemo_core.cli.replies import stream_reply
    from specmemo_core.runtime.decoding import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens)
    start = time.perf_counter()
    stats = [stream_reply(planned.new_session(capacity=capacity), PROMPTS[i % len(PROMPTS)], config)
             for i in range(requests)]
    wall = time.perf_counter() - start
    tokens = sum(s.tokens for s in stats)
    return {"requests": requests, "completion_tokens": tokens, "wall_s": round(wall, 2),
            "total_tokens_per_s": round(tokens / wall, 2),
            "mean_accepted": round(statistics.mean(s.mean_accepted for s in stats), 3)}


def start_server(threads: int, slots: int):
    """The default model served as ``specmemo serve`` serves it, on a free port."""
    from specmemo_core.planning.device import cpu_device
    from specmemo_core.planning.entry import PlanChoices, load_planned
    from specmemo_core.planning.threads import apply_threads
    from specmemo_core.serving.served import serve_engine
    from specmemo_core.serving.server import LocalServer, ServerAddress
    from specmemo_core.storage.data_folder import data_dir

    used = apply_threads(threads)
    planned = load_planned("default", choices=PlanChoices(batch=slots), device=cpu_device(), data_folder=data_dir(),
                           wait_for_timing=False)
    server = LocalServer(serve_engine(planned.engine, capacity=max(planned.plan.kv_tokens, 256), slots=slots),
                         ServerAddress(port=0)).start()
    return server, planned, {"model": planned.engine.identity.name, "tree": planned.tree, "precision": planned.engine.precision,
                    "torch_threads": used, "decoder": f"BatchDecoder ({slots} slots)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=8, help="requests in all, per measurement")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=4, help="the in-process server's batch slots (serve --slots)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the in-process server (0: chosen)")
    parser.add_argument("--base-url", default=None, help="measure this running server instead of starting one")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    server, planned, setup = (None, None, {"server": args.base_url}) if args.base_url else start_server(args.threads, args.slots)
    base_url = args.base_url or server.url
    direct = None
    try:
        one_client(base_url, PROMPTS[:1], 8)  # warm-up: first-call allocations
        if planned is not None:
            direct = measure_direct(planned, server.served.context_tokens, args.requests, args.max_tokens)
            print(json.dumps({"direct": direct}), file=sys.stderr)
        runs = []
        for clients in args.clients:
            runs.append(measure(base_url, clients, max(args.requests // clients, 1), args.max_tokens))
            print(json.dumps(runs[-1]), file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
    report = {"setup": {**setup, "max_tokens": args.max_tokens, "temperature": 0}, "runs": runs, "direct": direct,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "load_average_1min_before": load_before, "load_average_1min_after": os.getloadavg()[0]}}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
