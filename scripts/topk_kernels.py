"""Issue 22/23 on a GPU: what a drafting top-k costs, and a two-stage one that spreads a
few long rows over many thread blocks. One CUDA graph per variant replays it ``--reps``
times; microseconds per call, median of ``--rounds`` rounds.

torch.topk over [rows, V] with rows ≪ SMs and small k runs one block per row: a grown
tree's levels (8 rows × the 8,192-token drafting vocabulary) and a static tree's (heads
× the whole vocabulary) leave most of the GPU idle. ``chunked_topk`` takes each chunk's
top-k first (rows × chunks slices), then the top-k of those.

    python scripts/topk_kernels.py [--reps 200] [--rounds 5] > docs/results/plan_step_h200/topk.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specmemo_core.runtime.heads import chunked_topk


def timed(fn, reps: int, rounds: int) -> float:
    """µs per call of ``fn`` captured ``reps`` times in one graph: median of ``rounds``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for rows, vocab, k, dtype in ((1, 8192, 8, torch.float32), (8, 8192, 8, torch.float32),
                                  (64, 8192, 8, torch.float32), (4, 49152, 10, torch.bfloat16),
                                  (57, 49152, 1, torch.bfloat16), (1, 200, 47, torch.float32)):
        x = torch.randn(rows, vocab, device="cuda", dtype=dtype)
        want = x.topk(k, dim=-1)
        got = chunked_topk(x, k)
        same = bool(torch.equal(want.values, got[0]))
        out = {"rows": rows, "vocab": vocab, "k": k, "dtype": str(dtype).removeprefix("torch."), "same_values": same,
               "topk_us": round(timed(lambda: x.topk(k, dim=-1), args.reps, args.rounds), 2),
               **{f"chunked_{c}_us": round(timed(lambda: chunked_topk(x, k, chunk=c), args.reps, args.rounds), 2)
                  for c in (256, 512, 1024, 2048)},
               "argmax_us": round(timed(lambda: x.argmax(dim=-1), args.reps, args.rounds), 2),
               "log_softmax_us": round(timed(lambda: torch.log_softmax(x.float(), dim=-1), args.reps, args.rounds), 2)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
