"""Where a tree step's matmuls lose to a plain step's: each of a layer's four matmul kernels as a step
runs them (``token_layer``: the tiles for T tokens, the one-token kernels for one), a chain over the
model's layers (each its own weights, so L2 holds none), one CUDA graph each, dependent launch as in
a step, ms per chain and the weights' GB/s. A measurement only (issue 23: a 64-node tree ≤ 1.2× a
plain step; the tiles' matmuls are most of what is left).

    python3 scripts/time_layer_matmuls.py --shape vicuna-7b [--tokens 64] [--launch 'tile_prefetch=0']
    TRITON_INTERPRET=1 python3 scripts/time_layer_matmuls.py --check     (the launches, on a CPU)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from time_graph_steps import launch_with  # noqa: E402
from time_step_parts import graph_ms, layer_matmuls  # noqa: E402

from specmemo_core.planning.memory import known_shape  # noqa: E402
from specmemo_core.runtime import token_layer  # noqa: E402

NAMES = ("qkv", "o", "gate_up", "down")


def layer_weights(shape, layers: int, device: str, dtype: torch.dtype) -> list[dict]:
    """``layers`` sets of a layer's four fused weights (random, scaled as trained ones), and a norm."""
    out = []
    for _ in range(layers):
        w = {name: torch.randn(n, k, device=device, dtype=dtype) * 0.02
             for name, (n, k) in zip(NAMES, layer_matmuls(shape))}
        w["norm"] = SimpleNamespace(weight=torch.ones(shape.hidden_size, device=device, dtype=dtype), eps=1e-5)
        out.append(w)
    return out


def inputs(layers: list[dict], tokens: int) -> dict[int, torch.Tensor]:
    """Each matmul's input rows [tokens, K], by K."""
    first = layers[0]
    return {k: torch.randn(tokens, k, device=first["qkv"].device, dtype=first["qkv"].dtype)
            for k in {first[name].shape[1] for name in NAMES}}


def chains(layers: list[dict], xs: dict[int, torch.Tensor], launch: token_layer.Launch, *, pdl: bool):
    """Each matmul's chain over ``layers`` as the step's kernels run it on the rows ``xs`` (one row:
    the one-token kernels, else the tiles): name -> a function launching the chain, and the outputs."""
    kernels, first = token_layer._kernels(), layers[0]
    tokens = next(iter(xs.values())).shape[0]
    outs = {name: torch.empty(tokens, first[name].shape[0] // (2 if name in ("qkv", "gate_up") else 1),
                              device=first[name].device, dtype=first[name].dtype) for name in NAMES}
    shapes = {name: token_layer.tile_shape_of(launch, large=True, add=name in ("o", "down"), qkv=name == "qkv")
              for name in NAMES}  # a 7B layer's: the step's kernels take the large tiles

    def run(name: str) -> None:
        x, residual = xs[first[name].shape[1]], xs[first[name].shape[1]][:, :outs[name].shape[1]]
        for w in layers:
            linear = SimpleNamespace(weight=w[name], bias=None)
            if name in ("qkv", "gate_up") and tokens > 1:
                token_layer._norm_pair_rows(kernels, x, w["norm"], (w[name], None), outs[name], rope=None,
                                            launch=launch, shape=shapes[name], pdl=int(pdl))
            elif name in ("qkv", "gate_up"):
                token_layer._norm_pairs(kernels, x, w["norm"], (w[name], None), outs[name], rope=None,
                                        launch=launch, pdl=pdl)
            elif tokens > 1:
                token_layer._matmul_add_rows(kernels, x, linear, residual, launch=launch, shape=shapes[name],
                                             pdl=int(pdl))
            else:
                token_layer._matmul_add(kernels.matmul_add, x, linear, residual, launch, pdl)
    return {name: (lambda name=name: run(name)) for name in NAMES}, outs


def check() -> None:
    """Every chain launches, tiles and one-token kernels alike (fp32, in Triton's interpreter)."""
    shape = SimpleNamespace(hidden_size=64, intermediate_size=96, head_dim=16, num_heads=4, num_kv_heads=2)
    layers = layer_weights(shape, 2, "cpu", torch.float32)
    launch = token_layer.Launch(large_tile_n=16, large_tile_stages=2)
    for tokens in (1, 3):
        runs, outs = chains(layers, inputs(layers, tokens), launch, pdl=False)
        for name, fn in runs.items():
            fn()
            assert torch.isfinite(outs[name]).all(), name
        print(json.dumps({"tokens": tokens, "outputs": {n: list(outs[n].shape) for n in NAMES}}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="vicuna-7b")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--launch", default="", help="token_layer.Launch fields, name=value;… (time_graph_steps)")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        return check()
    shape = known_shape(args.shape)
    launch = launch_with(args.launch)
    layers = layer_weights(shape, shape.num_layers, "cuda", torch.bfloat16)
    tiles, _ = chains(layers, inputs(layers, args.tokens), launch, pdl=True)
    plain, _ = chains(layers, inputs(layers, 1), launch, pdl=True)
    for name in NAMES:
        gb = layers[0][name].numel() * 2 * shape.num_layers / 1e9
        t, p = graph_ms(tiles[name]), graph_ms(plain[name])
        print(json.dumps({"shape": args.shape, "matmul": name, "tokens": args.tokens, "launch": args.launch,
                          "tiles_ms": round(t, 4), "one_token_ms": round(p, 4), "tiles_over_one": round(t / p, 3),
                          "tiles_TBps": round(gb / t, 3), "one_token_TBps": round(gb / p, 3)}), flush=True)


if __name__ == "__main__":
    main()
