"""One-token matmuls of a 7B-shaped step (bf16, x [1, K] @ W[N, K]ᵀ) on the GPU: cuBLAS's
(``F.linear``) against a plain Triton GEMV at several block shapes, in CUDA graphs over
distinct weight copies (so no weight is read from L2; timed as ``time_step_parts.graph_ms``
times its parts). Prints one JSON line per shape:
each kernel's µs a call and the bandwidth it reached, and the best Triton configuration.

Usage (GPU machine): ``python3 scripts/time_gemv.py --shape vicuna-7b [--copies 8]``.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specmemo_core.planning.memory import known_shape
from time_step_parts import graph_ms  # scripts/ is on the path when this runs as a script


@triton.jit
def gemv(x_ptr, w_ptr, y_ptr, n_rows, k_cols, stride_w,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n] = Σ_k x[k]·W[n, k] for BLOCK_N rows n, fp32 sums over BLOCK_K-wide tiles."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < n_rows
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, k_cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + k, mask=k < k_cols, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=live[:, None] & (k < k_cols)[None, :],
                    other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=live)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="vicuna-7b")
    ap.add_argument("--copies", type=int, default=8, help="distinct weights per shape, read in turn")
    args = ap.parse_args()
    s = known_shape(args.shape)
    h, hkv, hd, d, i = s.num_heads, s.num_kv_heads, s.head_dim, s.hidden_size, s.intermediate_size
    shapes = {"qkv": ((h + 2 * hkv) * hd, d), "o": (d, h * hd), "gate_up": (2 * i, d), "down": (d, i),
              "lm_head": (s.vocab_size, d)}
    configs = list(itertools.product((4, 8, 16), (256, 512), (4, 8), (1, 3)))
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(args.copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0])[0].float()
        row = {"shape": args.shape, "matmul": name, "n": n, "k": k}
        bytes_ = n * k * 2

        def cublas():
            for w in ws:
                F.linear(x, w)
        row["cublas_us"] = round(graph_ms(cublas) * 1000 / len(ws), 2)
        best = None
        for bn, bk, warps, stages in configs:
            def ours():
                for w in ws:
                    gemv[(triton.cdiv(n, bn),)](x, w, y, n, k, w.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                                num_warps=warps, num_stages=stages)
            try:
                us = graph_ms(ours) * 1000 / len(ws)
            except Exception as e:  # a configuration that does not compile (registers): skip it
                print(json.dumps({"config": [bn, bk, warps, stages], "error": str(e)[:120]}), flush=True)
                continue
            if best is None or us < best[0]:
                best = (us, [bn, bk, warps, stages])
        gemv[(triton.cdiv(n, best[1][0]),)](x, ws[0], y, n, k, ws[0].stride(0), BLOCK_N=best[1][0],
                                           BLOCK_K=best[1][1], num_warps=best[1][2], num_stages=best[1][3])
        row.update(triton_us=round(best[0], 2), config=best[1],
                   max_rel_err=float(((y.float() - ref).abs().max() / ref.abs().max()).item()),
                   cublas_tbps=round(bytes_ / row["cublas_us"] / 1e6, 2), triton_tbps=round(bytes_ / best[0] / 1e6, 2))
        print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
