"""How close a plain Triton tile GEMM (all M rows in one program, a tile of weight rows each)
gets to the weight-read floor against cuBLAS: a vicuna-7b layer's four matmuls × 32 layers at
M rows (default 64: a 64-node tree), bf16, one CUDA graph, under each launch (BLOCK_N,
BLOCK_K, stages, warps). A measurement only: the tree step keeps cuBLAS (``runtime/token_layer.py``).

    python3 scripts/time_tile_gemm.py 64 > tile-gemm-m64.jsonl   (docs/results/tree_rows_h200/profile/)
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
import triton
import triton.language as tl

LAYERS = 32
SHAPES = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))  # q/k/v, o, gate/up, down: [N, K]


@triton.jit
def tile_matmul(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                ST: tl.constexpr):
    """y[:, n-tile] = x [M, K] · W[n-tile, K]ᵀ, all M (≤ BM) rows in the program."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=ST):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m < M)[:, None], other=0.0)
        w = tl.load(w_ptr + n[None, :] * K + k[:, None], eviction_policy="evict_first")
        acc = tl.dot(x, w, acc)
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=(m < M)[:, None])


def graph_ms(fn) -> float:
    """The median of 3 timings of 20 replays of ``fn`` captured as one CUDA graph, ms a replay."""
    from specmemo_core.runtime.step import capture_graph
    from time_step_parts import replay_ms

    graph = capture_graph(fn, warmup=2)[0]
    return sorted(replay_ms(graph) for _ in range(3))[1]


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n, k in SHAPES] for _ in range(LAYERS)]
    xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES}
    ys = {n: torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for n, _ in SHAPES}
    floor = sum(n * k for n, k in SHAPES) * LAYERS * 2 / 4.8e12 * 1e3

    def cublas():
        for layer in weights:
            for (n, k), w in zip(SHAPES, layer):
                torch.matmul(xs[k], w.t(), out=ys[n])

    print(json.dumps({"M": rows, "floor_ms": round(floor, 3), "cublas": round(graph_ms(cublas), 3)}), flush=True)
    for bn, bk, stages, warps in itertools.product((32, 64, 128), (64, 128, 256), (3, 4, 5), (4, 8)):
        if (bn + 64) * bk * stages * 2 > 200_000:  # shared memory
            continue

        def tiles(bn=bn, bk=bk, stages=stages, warps=warps):
            for layer in weights:
                for (n, k), w in zip(SHAPES, layer):
                    tile_matmul[(n // bn,)](xs[k], w, ys[n], rows, n, k, BM=64, BN=bn, BK=bk, ST=stages,
                                            num_warps=warps)

        ms = graph_ms(tiles)
        want = xs[4096] @ weights[0][1].t()
        tile_matmul[(4096 // bn,)](xs[4096], weights[0][1], ys[4096], rows, 4096, 4096, BM=64, BN=bn, BK=bk,
                                   ST=stages, num_warps=warps)
        error = (ys[4096].float() - want.float()).abs().max().item()
        print(json.dumps({"cfg": [bn, bk, stages, warps], "ms": round(ms, 3), "x_floor": round(ms / floor, 3),
                          "err": error}), flush=True)


if __name__ == "__main__":
    main()
