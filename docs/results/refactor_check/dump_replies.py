"""Greedy replies of the MT-Bench workload through the app's path (Engine → session → send),
per tree, as token ids, with tokens/s: run once on the code before a refactor and once
after, then compare the JSON files (``--compare A.json B.json``). Works with the package
layout before issue 17 (``specmemo_core.engine``) and after (``specmemo_core.runtime.engine``).

    PYTHONPATH=CHECKOUT python dump_replies.py --device cpu --trees none,calibrated-6+lookup-3 --out X.json
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

import torch


def _api():
    try:
        from specmemo_core.runtime.decoding import GenerationConfig
        from specmemo_core.runtime.engine import Engine, resolve_tree
        from specmemo_core.storage.datasets import mtbench_conversations
    except ImportError:  # the layout before issue 17
        from specmemo_core.datasets import mtbench_conversations
        from specmemo_core.decoding import GenerationConfig
        from specmemo_core.engine import Engine, resolve_tree
    return Engine, resolve_tree, GenerationConfig, mtbench_conversations


def run(args) -> dict:
    Engine, resolve_tree, GenerationConfig, mtbench_conversations = _api()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    base = Engine.load("default", heads="auto", tree=None, dtype=dtype, device=args.device)
    convs = mtbench_conversations(args.queries)
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    out = {}
    for name in args.trees.split(","):
        tree = None if name == "none" else resolve_tree(name, base.heads_folder)
        engine = replace(base, tree=tree)
        speeds, replies = [], []
        for rep in range(args.repeats + 1):  # the first round warms up (and captures graphs)
            tokens, seconds, replies = 0, 0.0, []
            for conv in convs:
                session = engine.new_session(4096, None, speculate=tree is not None, graphs=args.graphs)
                for turn in conv:
                    ids = []
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for piece in session.send(turn, cfg):
                        ids.extend(piece.step.token_ids)
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    seconds += time.perf_counter() - t0
                    tokens += len(ids)
                    replies.append(ids)
            if rep:
                speeds.append(tokens / seconds)
        out[name] = {"replies": replies, "tokens_per_s": speeds,
                     "median_tokens_per_s": statistics.median(speeds) if speeds else None}
        print(name, [round(s, 1) for s in speeds], file=sys.stderr, flush=True)
    return out


def compare(a_path: str, b_path: str) -> None:
    a, b = json.load(open(a_path)), json.load(open(b_path))
    for name in a:
        if name in b:
            same = sum(x == y for x, y in zip(a[name]["replies"], b[name]["replies"]))
            print(f"{name}: {same}/{len(a[name]['replies'])} replies identical; tok/s median "
                  f"{a[name]['median_tokens_per_s']} vs {b[name]['median_tokens_per_s']}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--queries", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--trees", default="none,calibrated-6+lookup-3")
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        json.dump(run(args), open(args.out, "w"))
