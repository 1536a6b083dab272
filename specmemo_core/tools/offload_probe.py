"""Measure layer streaming on a device: the host→device bandwidth, a forward's time over
1…N tokens with some layers streamed, how much of the link a plain step uses, and what
the planner's time model predicted for the same layout.

    python -m specmemo_core.tools.offload_probe --model default --dtype bf16 --resident 15

A forward over ``nodes`` tokens stands for a verify step over a tree of that many nodes
(the same weights stream whatever the mask): the tree's mask changes attention, not the
bytes that cross the link. On CPU the bandwidth is None and the times are the CPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from specmemo_core.planning.memory import ModelShape
from specmemo_core.planning.offload import layout
from specmemo_core.runtime.host_link import host_to_device_bandwidth
from specmemo_core.runtime.model import CausalLM

CONTEXT = 128  # committed tokens in the cache while the forwards are timed


@dataclass(frozen=True)
class OffloadProbe:
    device: str
    resident_layers: int
    streamed_layers: int
    streamed_bytes: int  # per forward
    predicted_pinned_bytes: int  # planning/offload.layout's, for the same layers
    bandwidth_gb_s: float | None  # measured host→device, pinned; None off CUDA/ROCm
    step_s: dict[int, float]  # median forward time by tokens (tree nodes)
    link_fraction: float | None  # streamed bytes ÷ the 1-token forward's time ÷ the bandwidth
    predicted_transfer_s: float | None  # streamed bytes ÷ bandwidth: the time model's floor


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forwards(model: CausalLM, sizes: Sequence[int], *, repeats: int = 5) -> dict[int, float]:
    """Median seconds of a forward over ``n`` new tokens after ``CONTEXT`` committed ones,
    for each ``n`` in ``sizes`` (one warm-up forward each)."""
    device = model.device
    cache = model.new_cache(CONTEXT + max(sizes))
    with torch.inference_mode():
        positions, mask = cache.prepare(torch.arange(CONTEXT, device=device))
        model(torch.arange(CONTEXT, device=device) % model.spec.vocab_size, positions, mask, cache)
        cache.commit_prefix(CONTEXT)
        out = {}
        for n in sizes:
            tokens = torch.arange(n, device=device) % model.spec.vocab_size
            positions, mask = cache.prepare(torch.arange(n, device=device))
            times = []
            for _ in range(repeats + 1):
                _sync(device)
                t0 = time.perf_counter()
                model.greedy_picks(model(tokens, positions, mask, cache))
                _sync(device)
                times.append(time.perf_counter() - t0)
            out[n] = statistics.median(times[1:])
    return out


def probe(model: CausalLM, *, sizes: Sequence[int] = (1, 16, 64), repeats: int = 5,
          precision: str = "bf16") -> OffloadProbe:
    """Measure ``model`` as it stands (streamed or not; see the module doc)."""
    device = model.device
    resident = len(model.model.layers)
    streamer = model.streamed
    streamed_bytes = streamer.pinned_bytes if streamer is not None else 0
    streamed_layers = model.spec.num_layers - resident
    planned = layout(ModelShape.from_spec(model.spec), precision, resident, device_kind=device.type)
    bandwidth = host_to_device_bandwidth(device)
    step_s = time_forwards(model, sizes, repeats=repeats)
    fraction = transfer = None
    if bandwidth is not None and streamed_bytes:
        transfer = streamed_bytes / bandwidth
        fraction = transfer / step_s[min(sizes)]
    return OffloadProbe(str(device), resident, streamed_layers, streamed_bytes, planned.pinned_bytes,
                        bandwidth / 1e9 if bandwidth is not None else None, step_s, fraction, transfer)


def main(argv: Sequence[str] | None = None) -> None:
    from specmemo_core.runtime.engine import Engine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--precision", default=None, choices=("int8", "int4"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resident", type=int, default=None, help="decoder layers kept on the device (none: all)")
    parser.add_argument("--sizes", default="1,16,64,128,256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    engine = Engine.load(args.model, heads="none", dtype=dtype, device=args.device, precision=args.precision,
                         resident_layers=args.resident)
    result = probe(engine.model, sizes=[int(s) for s in args.sizes.split(",")], repeats=args.repeats,
                   precision=args.precision or args.dtype)
    print(json.dumps(asdict(result), indent=2))


if __name__ == "__main__":
    main()
