"""Accepted tokens per step, first turns apart from later turns: how much the lookup chain
adds to the heads' tree before the conversation holds a reply to copy from, and after.

    python scripts/lookup_gain_by_turn.py --queries 10 --tokens 64 --out docs/results/lookup_by_turn/cpu.json

MT-Bench conversations (2 turns each), greedy, the engine's own precision on this device.
"""
from __future__ import annotations

import argparse
import json

import torch

from specmemo_core.planning.entry import load_planned
from specmemo_core.runtime.engine import resolve_tree
from specmemo_core.storage.datasets import mtbench_conversations
from specmemo_core.tools.evaluate import run_conversations


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trees", default="calibrated-6,calibrated-6+lookup-3,calibrated-12,calibrated-12+lookup-3")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    planned = load_planned("default")
    e = planned.engine
    convs = mtbench_conversations(args.queries)
    report = {"queries": args.queries, "tokens": args.tokens, "device": str(e.model.device),
              "threads": torch.get_num_threads(), "trees": {}}
    for name in args.trees.split(","):
        tree = resolve_tree(name, e.heads_folder)
        first = run_conversations(e.model, e.tokenizer, e.config, [c[:1] for c in convs], heads=e.heads,
                                  tree=tree, max_new_tokens=args.tokens)
        both = run_conversations(e.model, e.tokenizer, e.config, [c[:2] for c in convs], heads=e.heads,
                                 tree=tree, max_new_tokens=args.tokens)
        # the second turns' steps: the two-turn run less the first-turn run (same first replies, greedy)
        steps, tokens = both.steps - first.steps, both.step_tokens - first.step_tokens
        by_turn = {"first": {"steps": first.steps, "tokens": first.step_tokens,
                             "mean_accepted": round(first.mean_accepted, 4)},
                   "second": {"steps": steps, "tokens": tokens, "mean_accepted": round(tokens / steps, 4)}}
        report["trees"][name] = by_turn
        print(name, by_turn, flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
