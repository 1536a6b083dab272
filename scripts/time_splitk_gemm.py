"""Would a split-K tile GEMM read a tree step's weights faster than cuBLAS at 64 rows? A
layer's four matmuls of a 7B shape ([N, K] weights as checkpoints hold them), 32 layers a
chain, each matmul's chain one CUDA graph, against cuBLAS (``F.linear``) in the same
process: every program takes all M (≤ 64) rows, BN weight rows and 1/SPLITS of K; each
writes its fp32 partial sums, and the program that finishes a column tile last (a ticket
counter per tile) adds the tile's partials in split order (the same sums whatever the
arrival order) and writes the output. Pointer loads (Triton's software pipeline) and TMA
loads (host tensor descriptors) are both scanned. A measurement only (issue 23).

    PYTHONPATH=$PYTHONPATH:scripts python3 scripts/time_splitk_gemm.py --shape vicuna-7b > splitk.jsonl
    TRITON_INTERPRET=1 python3 scripts/time_splitk_gemm.py --check      (the kernels' sums, on a CPU)
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _finish(acc, y_ptr, part_ptr, count_ptr, tile, split, m, n, M, N,
            BM: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr):
    """Write a program's sums; with splits, the tile's last program adds them in split order."""
    rows = (m < M)[:, None]
    if SPLITS == 1:
        tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=rows)
    else:
        tl.store(part_ptr + (split * BM + m[:, None]) * N + n[None, :], acc, mask=rows)
        tl.debug_barrier()
        ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if ticket == SPLITS - 1:
            total = tl.zeros((BM, BN), tl.float32)
            for j in tl.static_range(SPLITS):
                total += tl.load(part_ptr + (j * BM + m[:, None]) * N + n[None, :], mask=rows, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptr + m[:, None] * N + n[None, :], total.to(y_ptr.dtype.element_ty), mask=rows)
            tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def splitk_matmul(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr, ST: tl.constexpr):
    """y [M, N] = x [M, K] · W [N, K]ᵀ, pointer loads."""
    tile, split = tl.program_id(0), tl.program_id(1)
    n = tile * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), tl.float32)
    start = split * K_SPLIT
    for k0 in tl.range(start, start + K_SPLIT, BK, num_stages=ST):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m < M)[:, None], other=0.0)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], eviction_policy="evict_first")
        acc = tl.dot(x, tl.trans(w), acc)
    _finish(acc, y_ptr, part_ptr, count_ptr, tile, split, m, n, M, N, BM, BN, SPLITS)


@triton.jit
def splitk_matmul_tma(x_desc, w_desc, y_ptr, part_ptr, count_ptr, M, N, K_SPLIT,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr,
                      ST: tl.constexpr):
    """The same through TMA loads of x [BM, BK] and W [BN, BK] blocks."""
    tile, split = tl.program_id(0), tl.program_id(1)
    n = tile * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), tl.float32)
    start = split * K_SPLIT
    for k0 in tl.range(start, start + K_SPLIT, BK, num_stages=ST):
        x = x_desc.load([0, k0])
        w = w_desc.load([tile * BN, k0])
        acc = tl.dot(x, w.T, acc)
    _finish(acc, y_ptr, part_ptr, count_ptr, tile, split, m, n, M, N, BM, BN, SPLITS)


class SplitK:
    """One launch of either kernel over fixed operands (descriptors and workspace made once)."""

    def __init__(self, x, w, y, *, bn, bk, splits, stages, warps, tma):
        from triton.tools.tensor_descriptor import TensorDescriptor

        (m, k), n = x.shape, w.shape[0]
        bm = max(16, triton.next_power_of_2(m))
        self.args = dict(BM=bm, BN=bn, BK=bk, SPLITS=splits, ST=stages, num_warps=warps)
        self.grid = (n // bn, splits)
        part = torch.empty(splits * bm * n if splits > 1 else 1, device=x.device, dtype=torch.float32)
        count = torch.zeros(n // bn, device=x.device, dtype=torch.int32)
        if tma:
            self.kernel = splitk_matmul_tma
            self.params = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
                           y, part, count, m, n, k // splits)
        else:
            self.kernel = splitk_matmul
            self.params = (x, w, y, part, count, m, n, k, k // splits)

    def __call__(self) -> None:
        self.kernel[self.grid](*self.params, **self.args)


def fits(n: int, k: int, bn: int, bk: int, splits: int, stages: int) -> bool:
    return n % bn == 0 and k % (splits * bk) == 0 and (bn + 64) * bk * stages * 2 <= 200_000


def check() -> None:
    """The kernels' sums against torch's on small operands (in Triton's interpreter on a CPU)."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(40, 256, device=device)
    w = torch.randn(96, 256, device=device)
    want = x @ w.t()
    for splits, tma in ((1, False), (2, False), (4, False), (2, True)):
        y = torch.empty(40, 96, device=device)
        xs = torch.zeros(64, 256, device=device)
        xs[:40] = x
        run = SplitK(xs if tma else x, w, y if not tma else torch.empty(64, 96, device=device), bn=32, bk=32,
                     splits=splits, stages=2, warps=4, tma=tma)
        for _ in range(2):  # the ticket counters must be back at zero for the second run
            run()
        got = run.params[2][:40]
        print(json.dumps({"splits": splits, "tma": tma, "max_abs_err": (got - want).abs().max().item()}))
        assert torch.allclose(got, want, atol=1e-3, rtol=1e-4), (splits, tma)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="vicuna-7b")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--only", default="", help="comma list of matmuls to scan (qkv,o,gate_up,down)")
    parser.add_argument("--min-programs", type=int, default=100, help="launches of fewer programs are skipped")
    args = parser.parse_args()
    if args.check:
        return check()
    from specmemo_core.planning.memory import known_shape
    from time_step_parts import graph_ms, layer_matmuls

    shape = known_shape(args.shape)
    names = ("qkv", "o", "gate_up", "down")
    for name, (n, k) in zip(names, layer_matmuls(shape)):
        if args.only and name not in args.only.split(","):
            continue
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(shape.num_layers)]
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(args.rows, n, device="cuda", dtype=torch.bfloat16)
        floor = n * k * 2 * shape.num_layers / 4.8e12 * 1e3
        cublas = graph_ms(lambda: [torch.matmul(x, w.t(), out=y) for w in weights])
        row = {"shape": args.shape, "matmul": name, "N": n, "K": k, "rows": args.rows, "floor_4.8TBs_ms": round(floor, 4),
               "cublas_ms": round(cublas, 4)}
        print(json.dumps(row), flush=True)
        want = x.float() @ weights[0].float().t()
        for tma, bn, bk, splits, stages, warps in itertools.product(
                (False, True), (32, 64, 128), (64, 128), (1, 2, 3, 4, 8), (3, 5), (4,)):
            if not fits(n, k, bn, bk, splits, stages) or (n // bn) * splits < args.min_programs or (n // bn) * splits > 1200:
                continue
            runs = [SplitK(x, w, y, bn=bn, bk=bk, splits=splits, stages=stages, warps=warps, tma=tma)
                    for w in weights]
            try:
                runs[0]()
                error = (y.float() - want).abs().max().item()
                ms = graph_ms(lambda: [run() for run in runs])
                cublas = graph_ms(lambda: [torch.matmul(x, w.t(), out=y) for w in weights])
            except Exception as failure:  # noqa: BLE001  a launch that does not build is a row, not the end
                print(json.dumps({"matmul": name, "cfg": [tma, bn, bk, splits, stages, warps],
                                  "error": str(failure)[:200]}), flush=True)
                continue
            print(json.dumps({"matmul": name, "cfg": [tma, bn, bk, splits, stages, warps], "ms": round(ms, 4),
                              "cublas_ms": round(cublas, 4), "vs_cublas": round(ms / cublas, 3),
                              "err": round(error, 4)}), flush=True)


if __name__ == "__main__":
    main()
