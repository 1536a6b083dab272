"""What a forward of N tokens costs on a CPU, on each backend that runs the default GGUF:
the native forward (``runtime/native``, built for this CPU and, on x86, for AVX2 alone and for
AVX2 with VNNI where the CPU has it) and
llama.cpp's (``runtime/ggml_step.py``, where llama-cpp-python is installed), through the
forward our step calls. N tokens after a 200-token context, logits for every token (as a
tree's verification needs them); each size timed ``--calls`` times per round, rounds
interleaving the backends, the median of each round's median and their spread.

    python scripts/native_step_costs.py [--sizes 1,2,4,8,16] [--rounds 3] [--threads 2]
        > docs/results/native_cpu/step_costs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

CONTEXT = 200


def backends(threads: int) -> dict:
    from specmemo_core.runtime.ggml_step import available as have_llamacpp
    from specmemo_core.runtime.ggml_step import load_llamacpp
    from specmemo_core.runtime.native.lm import load_native
    from specmemo_core.storage.sources import open_model

    out = {"native": load_native(open_model("default"), threads=threads)}
    if platform.machine() in ("x86_64", "AMD64"):
        out["native-avx2"] = load_native(open_model("default"), threads=threads, march="x86-64-v3")
        if "avx_vnni" in Path("/proc/cpuinfo").read_text(errors="replace"):  # AVX2 with VNNI (Alder Lake's)
            out["native-avx2-vnni"] = load_native(open_model("default"), threads=threads, march="alderlake")
    if have_llamacpp():
        out["llamacpp"] = load_llamacpp(open_model("default"), threads=threads)
    return out


def forward_ms(lm, cache, size: int, calls: int, generator: torch.Generator) -> float:
    """The median ms of ``calls`` forwards of ``size`` new tokens after the cache's context
    (each forward's cells dropped again, so every call sees the same context)."""
    times = []
    for _ in range(calls):
        tokens = torch.randint(3, 40000, (size,), generator=generator)
        positions, mask = cache.prepare(torch.arange(size))
        start = time.perf_counter()
        lm(tokens, positions, mask, cache)
        times.append(time.perf_counter() - start)
        cache.truncate(cache.length)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    models = backends(args.threads)
    generator = torch.Generator().manual_seed(0)
    caches = {}
    for name, lm in models.items():
        cache = lm.new_cache(1024)
        context = torch.randint(3, 40000, (CONTEXT,), generator=generator)
        lm(context, *cache.prepare(torch.arange(CONTEXT)), cache, last_only=True)
        cache.settle(CONTEXT)
        caches[name] = cache
    runs: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in models}
    for _ in range(args.rounds):
        for name, lm in models.items():
            for n in sizes:
                runs[name][n].append(forward_ms(lm, caches[name], n, args.calls, generator))
    from specmemo_core.planning.device import cpu_device

    result = {"cpu": cpu_device().name or platform.machine(), "threads": args.threads, "context": CONTEXT,
              "rounds": args.rounds, "calls_per_round": args.calls,
              "kernels": {name: lm.lib.sm_kernel().decode() for name, lm in models.items() if hasattr(lm, "lib")},
              "ms": {name: {str(n): {"median": round(statistics.median(v), 2), "min": round(min(v), 2),
                                     "max": round(max(v), 2)} for n, v in per.items()} for name, per in runs.items()}}
    for name in models:
        one = result["ms"][name]["1"]["median"]
        result.setdefault("vs_one_token", {})[name] = {str(n): round(result["ms"][name][str(n)]["median"] / one, 2)
                                                       for n in sizes}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
