"""Where a replayed CUDA-graph step's time goes: the kernels inside the captured step unit
(as CUPTI records a graph's nodes), their count and time per step, grouped by kind, and the
step's wall time on the GPU; the difference between the two is the gaps between kernels.

    python scripts/profile_graph_step.py [--shape vicuna-7b] [--tree single|medusa-64] [--compile]
        [--context 1000] [--replays 20]
"""

from __future__ import annotations

import argparse
import json

import torch

from specmemo_core.planning.memory import known_shape
from specmemo_core.planning.plan_check import random_model
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache
from specmemo_core.runtime.tree import load_tree

KINDS = (("matmul", ("nvjet", "gemm", "gemv", "triton_mm", "cutlass", "splitk", "sm90_xmma")),
         ("attention", ("sdpa", "flash", "fmha", "attention", "cudnn")),
         ("fused (triton)", ("triton_",)), ("copy/index", ("index", "copy", "memcpy", "cat", "gather", "scatter")))


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(key in low for key in keys)), "other")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="vicuna-7b")
    ap.add_argument("--tree", default="single")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    from time_graph_steps import step_heads
    from time_step_parts import replay_ms

    shape = known_shape(args.shape)
    model = random_model(shape, "bf16", "cuda")
    model.fuse_projections()
    if args.compile:
        model.compile_layers()
    tree = None if args.tree == "single" else load_tree(args.tree)
    heads = step_heads(shape, model, "cuda") if tree else None
    decoder = StaticDecoder(model, new_static_cache(model, 4096), heads, tree, graphs=True)
    prompt = torch.randint(0, shape.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    stream = decoder.generate(prompt, GenerationConfig(max_new_tokens=8))
    for _ in range(4):  # prefill and a few steps: the unit of this span is captured
        next(stream)
    unit = next(iter(decoder.units.values()))
    graph = unit.graph
    wall_ms = replay_ms(graph, args.replays)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:70], []).append(e.device_time_total)
    by_kind: dict[str, list[float]] = {}
    for name, us in by_name.items():
        entry = by_kind.setdefault(kind(name), [0, 0.0])
        entry[0] += len(us) / args.replays
        entry[1] += sum(us) / args.replays / 1e3
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    print(json.dumps({
        "shape": args.shape, "tree": args.tree, "compiled": args.compile, "context": args.context,
        "device": torch.cuda.get_device_name(), "span": unit.span,
        "graph_replay_ms": round(wall_ms, 3),
        "kernels_per_step": round(len(kernels) / args.replays, 1),
        "kernel_ms_per_step": round(sum(e.device_time_total for e in kernels) / args.replays / 1e3, 3),
        "by_kind": {k: {"kernels": round(v[0], 1), "ms": round(v[1], 3)} for k, v in sorted(by_kind.items())},
        "top": [(n, round(len(us) / args.replays, 1), round(sum(us) / args.replays, 1)) for n, us in top]}, indent=1))


if __name__ == "__main__":
    main()
