"""Whether a one-token matmul reads weights stored transposed ([K, N], as cuBLAS prefers for a
tree's 64 rows: ``time_gemm_layouts.py``) as fast as ``token_layer``'s ``matmul_add`` reads
them as checkpoints hold them ([N, K]). A model shape's four layer matmuls × its layers, bf16,
one CUDA graph a chain, no PDL either side: ``matmul_add`` (residual zero) against
``column_matvec`` (a program sums BN columns over K/SPLITS rows of Wᵀ; with SPLITS > 1 a
second kernel adds the splits' fp32 partials in a fixed order), each launch of the scan.
A measurement only.

    python3 scripts/time_column_gemv.py [--shape vicuna-7b] > column-gemv.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl


@triton.jit
def column_matvec(x_ptr, w_ptr, y_ptr, n_cols, k_rows, k_per_split,
                  BN: tl.constexpr, BK: tl.constexpr):
    """y[s, n] = Σ_{k in split s} Wt[k, n]·x[k] for BN columns n (fp32 partials)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    s = tl.program_id(1)
    live = n < n_cols
    acc = tl.zeros((BK, BN), tl.float32)
    lo = s * k_per_split
    for k0 in range(lo, lo + k_per_split, BK):
        k = k0 + tl.arange(0, BK)
        in_k = k < k_rows
        x = tl.load(x_ptr + k, mask=in_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + k[:, None] * n_cols + n[None, :], mask=in_k[:, None] & live[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[:, None]
    tl.store(y_ptr + s * n_cols + n, tl.sum(acc, 0), mask=live)


@triton.jit
def add_splits(part_ptr, out_ptr, n_cols, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[n] = Σ_s part[s, n], in split order."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = n < n_cols
    total = tl.zeros((BLOCK,), tl.float32)
    for s in range(SPLITS):
        total += tl.load(part_ptr + s * n_cols + n, mask=live, other=0.0)
    tl.store(out_ptr + n, total.to(out_ptr.dtype.element_ty), mask=live)


def column_launch(x, wt, part, y, *, bn: int, bk: int, splits: int, warps: int) -> None:
    """y [N] = x [K] · wt [K, N] through ``column_matvec`` (and ``add_splits``)."""
    k_rows, n_cols = wt.shape
    per = triton.cdiv(triton.cdiv(k_rows, splits), bk) * bk
    column_matvec[(triton.cdiv(n_cols, bn), splits)](x, wt, part if splits > 1 else y, n_cols, k_rows, per,
                                                      BN=bn, BK=bk, num_warps=warps)
    if splits > 1:
        add_splits[(triton.cdiv(n_cols, 1024),)](part, y, n_cols, SPLITS=splits, BLOCK=1024)


def main() -> None:
    from specmemo_core.planning.memory import known_shape
    from specmemo_core.runtime.token_layer_kernels import matmul_add
    from time_step_parts import graph_ms, layer_matmuls

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="vicuna-7b")
    args = ap.parse_args()
    shape = known_shape(args.shape)
    for n, k in layer_matmuls(shape):
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(shape.num_layers)]
        wt = [m.t().contiguous() for m in w]
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        zero, y = torch.zeros(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16)
        part = torch.empty(8, n, device="cuda", dtype=torch.float32)
        want = w[0].float() @ x.float()  # each kernel's first layer, checked against it
        floor_ms = n * k * 2 * shape.num_layers / 3.35e12 * 1e3

        def rows_launch(m):  # as a plain step launches it (token_layer.LAUNCH), without PDL
            matmul_add[(triton.cdiv(n, 2),)](x, m, m, zero, y, n, k, m.stride(0), BLOCK_N=2, BLOCK_K=1024,
                                             HAS_BIAS=False, PDL=False, num_warps=4)
        ms = graph_ms(lambda: [rows_launch(m) for m in w])
        rows_launch(w[0])
        print(json.dumps({"shape": args.shape, "n": n, "k": k, "kernel": "matmul_add [N,K]", "ms": round(ms, 4),
                          "h100_floor_ms": round(floor_ms, 4), "err": float((y.float() - want).abs().max())}),
              flush=True)
        for bn, bk, splits, warps in itertools.product((16, 32, 64), (256, 512), (1, 2, 4), (4, 8)):
            if bn * bk > 32768:
                continue

            def columns(bn=bn, bk=bk, splits=splits, warps=warps):
                for m in wt:
                    column_launch(x, m, part, y, bn=bn, bk=bk, splits=splits, warps=warps)
            ms = graph_ms(columns)
            column_launch(x, wt[0], part, y, bn=bn, bk=bk, splits=splits, warps=warps)
            print(json.dumps({"shape": args.shape, "n": n, "k": k, "kernel": f"column [K,N] {bn}:{bk}:{splits}:{warps}",
                              "ms": round(ms, 4), "err": float((y.float() - want).abs().max())}), flush=True)


if __name__ == "__main__":
    main()
