"""Tokens/s of our plain and speculative decoding against transformers' generate.

Same prompt, same process, the methods interleaved (A B C A B C …) so drift in the
machine's speed hits all alike; median, min and max over the repeats. Usage:
    python scripts/compare_generate.py [--repeats 3] [--max-new-tokens 128] [--tree calibrated-16 ...]
"""

import argparse
import json
import statistics
import time

import torch

from specmemo_core.runtime.chat import encode_conversation
from specmemo_core.cli import stream_reply
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.runtime.engine import Engine, resolve_tree, shipped_heads_dir
from specmemo_core.tools.train.pipeline import hf_model_from
from specmemo_core.storage.sources import load_model

PROMPT = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
          "experiences and must-see attractions.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", action="append")
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args()
    trees = args.tree or ["calibrated-8", "calibrated-16", "medusa-64"]
    engine = Engine.load("default", heads="auto", tree=trees[0])
    folder = shipped_heads_dir(engine.identity)
    hf = hf_model_from(load_model("default"), "cpu", torch.float32)
    ids = torch.tensor([encode_conversation(engine.tokenizer, [{"role": "user", "content": args.prompt}])])
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)

    def run_hf():
        t = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                          do_sample=False, eos_token_id=engine.tokenizer.eos_token_id,
                          pad_token_id=engine.tokenizer.eos_token_id)
        n = out.shape[1] - ids.shape[1]
        return n / (time.perf_counter() - t), n, None

    def run_ours(tree_name):
        def go():
            engine.tree = resolve_tree(tree_name, folder) if tree_name else None
            session = engine.new_session(1024, speculate=tree_name is not None)
            stats = stream_reply(session, args.prompt, cfg)
            return stats.tokens_per_s, stats.new_tokens, stats.mean_accepted
        return go

    methods = {"hf generate": run_hf, "ours --no-spec": run_ours(None)}
    methods.update({f"ours spec {t}": run_ours(t) for t in trees})
    results = {name: [] for name in methods}
    for _ in range(args.repeats + 1):  # first round is a warm-up
        for name, fn in methods.items():
            results[name].append(fn())
    base = statistics.median(r[0] for r in results["hf generate"][1:])
    table = {}
    print(f"{'method':<26}{'tok/s median':>13}{'min':>8}{'max':>8}{'tokens':>8}{'acc/step':>10}{'vs hf':>8}")
    for name, runs in results.items():
        speeds = [r[0] for r in runs[1:]]
        med = statistics.median(speeds)
        acc = runs[-1][2]
        table[name] = {"median": round(med, 2), "min": round(min(speeds), 2), "max": round(max(speeds), 2),
                       "new_tokens": runs[-1][1], "mean_accepted": acc, "vs_hf": round(med / base, 3)}
        print(f"{name:<26}{med:>13.1f}{min(speeds):>8.1f}{max(speeds):>8.1f}{runs[-1][1]:>8}"
              f"{(acc or 1.0):>10.2f}{med / base:>7.2f}x")
    print(json.dumps(table))


if __name__ == "__main__":
    main()
