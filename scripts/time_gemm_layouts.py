"""Whether the weights' layout changes cuBLAS's speed at a tree's row counts: a model shape's
four layer matmuls × its layers, bf16, one CUDA graph a chain, y = x·Wᵀ with W stored
[N, K] as checkpoints hold it (``nk``, what ``F.linear`` runs) against W stored transposed
[K, N] (``kn``), and yᵀ = W·xᵀ (``swap``: the weight as the left operand), each through
cuBLAS and cuBLASLt. A measurement only.

    python3 scripts/time_gemm_layouts.py [--shape vicuna-7b] [--rows 1,16,64] > gemm-layouts.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specmemo_core.planning.memory import known_shape
from time_step_parts import graph_ms, layer_matmuls


def chains(shape, rows: int) -> dict[str, object]:
    dims = layer_matmuls(shape)
    nk = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in dims]
          for _ in range(shape.num_layers)]
    kn = [[w.t().contiguous() for w in layer] for layer in nk]
    xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in dims}
    xts = {k: x.t().contiguous() for k, x in xs.items()}

    def run(weights, product):
        def go():
            for layer in weights:
                for w in layer:
                    product(w)
        return go

    return {"nk": run(nk, lambda w: torch.nn.functional.linear(xs[w.shape[1]], w)),
            "kn": run(kn, lambda w: torch.mm(xs[w.shape[0]], w)),
            "swap": run(nk, lambda w: torch.mm(w, xts[w.shape[1]]))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="vicuna-7b")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    shape = known_shape(args.shape)
    for rows in (int(r) for r in args.rows.split(",")):
        runs = chains(shape, rows)
        times: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                for name, run in runs.items():
                    times.setdefault(f"{name} {library}", []).append(graph_ms(run))
        torch.backends.cuda.preferred_blas_library("cublas")
        for name, ms in times.items():
            print(json.dumps({"shape": args.shape, "rows": rows, "layout": name, "median": round(statistics.median(ms), 4),
                              "min": round(min(ms), 4), "max": round(max(ms), 4), "runs": len(ms)}), flush=True)


if __name__ == "__main__":
    main()
