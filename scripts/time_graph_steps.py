"""Milliseconds per greedy step of the static decoder, eager and as CUDA graphs, on a
random-weight model of a known shape (no weights to carry to a GPU machine).

Random heads accept ~nothing, so this times the step itself: what a tree of N nodes
costs against a plain step. Speed = accepted tokens per step / step time; with the
accepted lengths of real heads (``specmemo eval-acceptance``) it predicts tokens/s.

    python scripts/time_graph_steps.py [--shape smollm2-135m] [--dtype bf16] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specmemo_core.decoding import GenerationConfig
from specmemo_core.heads import random_heads
from specmemo_core.memory import known_shape
from specmemo_core.plan_check import random_model
from specmemo_core.static_decoding import StaticDecoder, new_static_cache
from specmemo_core.tree import load_tree


def time_steps(model, heads, tree, graphs: bool, steps: int, context: int = 1000) -> float:
    decoder = StaticDecoder(model, new_static_cache(model, context + 2 * steps * 5 + 64), heads, tree, graphs=graphs)
    prompt = torch.randint(0, model.spec.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    config = GenerationConfig(max_new_tokens=steps)
    for _ in decoder.generate(prompt, GenerationConfig(max_new_tokens=20)):  # warm-up, captures
        pass
    decoder.reset()
    stream = decoder.generate(prompt, config)
    next(stream)  # prefill
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t0, n = time.perf_counter(), 0
    for _ in stream:
        n += 1
    sync()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--trees", default="single,1-10-16-17,medusa-64")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    shape = known_shape(args.shape)
    model = random_model(shape, args.dtype, args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = {"shape": args.shape, "dtype": args.dtype, "device": name, "ms_per_step": {}}
    for name in args.trees.split(","):
        tree = None if name == "single" else load_tree(name)
        heads = (random_heads(4, shape.hidden_size, shape.vocab_size, kind="hydra", context=(shape.hidden_size,
                 shape.num_heads, shape.num_kv_heads, shape.head_dim)).to(device=args.device, dtype=model.dtype)
                 if tree else None)
        for graphs in (False, True):
            ms = time_steps(model, heads, tree, graphs, args.steps)
            out["ms_per_step"][f"{name}{'+graphs' if graphs else ''}"] = round(ms, 3)
            print(json.dumps({"tree": name, "graphs": graphs, "ms_per_step": round(ms, 3)}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
