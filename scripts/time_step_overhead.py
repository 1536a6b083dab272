"""Where a graph-replayed decoding step's wall time goes besides its kernels: the default
model's shape (random weights), its trained heads, bf16, on a GPU. For each tree, ms per step
of four loops over the same captured step unit:

- ``loop``: ``Decoder.generate`` (replay, the host read, the loop's bookkeeping), each step
  started before the last is read (``StaticDecoder.overlap``); ``loop-serial``: one at a time;
- ``replay+read``: replay, then the step's host read (``settle``'s ``tolist``), nothing else;
- ``replay+sync``: replay, then wait for the GPU;
- ``replays``: back-to-back replays, one wait at the end (the GPU's time alone).

``replay+sync`` − ``replays`` is the launch latency a step exposes when the host waits for it;
``loop`` − ``replay+read`` the Python work between steps.

    python3 scripts/time_step_overhead.py [contexts, e.g. 300,1000] [--kernels] > step_overhead.jsonl

``--kernels``: also one eager step of the planner's usual tree under the profiler (where its time goes).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from specmemo_core.planning.memory import known_shape
from specmemo_core.planning.plan_check import random_model
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.runtime.engine import resolve_tree
from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache

TREES = ("single", "lookup-8", "calibrated-16+lookup-8", "medusa-64")
HEADS = Path(__file__).resolve().parents[1] / "assets/heads/SmolLM2-135M-Instruct"
STEPS = 100


def per_step_ms(run, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def time_loop(decoder, prompt: list[int]) -> float:
    stream = decoder.generate(prompt, GenerationConfig(max_new_tokens=2000))
    next(stream)  # prefill
    for _ in range(5):
        next(stream)
    ms = per_step_ms(lambda: next(stream), STEPS)
    stream.close()
    decoder.reset()
    return ms


def time_tree(model, heads, tree, context: int) -> dict[str, float]:
    decoder = StaticDecoder(model, new_static_cache(model, 4096), heads, tree, graphs=True)
    decoder.capture()
    prompt = torch.randint(0, model.spec.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    for overlap, name in ((False, "loop-serial"), (True, "loop"), (False, "loop-serial"), (True, "loop")):
        decoder.overlap = overlap
        out.setdefault(name, []).append(time_loop(decoder, prompt))
    out = {k: min(v) for k, v in out.items()}
    decoder.overlap = False  # no step left in flight under the replays below
    stream = decoder.generate(prompt, GenerationConfig(max_new_tokens=8))
    for _ in range(3):
        next(stream)
    buffers = decoder._next_buffers()
    unit = decoder.units[buffers.depths.shape[0], decoder.cache.span_for(buffers.depths.shape[0])]
    start = decoder.cache.length
    for name, run in (("replay+read", lambda: unit.graph.replay() or unit._out.tolist()),
                      ("replay+sync", lambda: unit.graph.replay() or torch.cuda.synchronize()),
                      ("replays", unit.graph.replay)):
        out[name] = per_step_ms(run, STEPS)  # the device length moves on; the host's stays: rewind
        decoder.cache.truncate(start)
        if decoder.context_cache is not None:
            decoder.context_cache.truncate(start)
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    from time_graph_steps import count_kernels, step_heads

    shape = known_shape("smollm2-135m")
    model = random_model(shape, "bf16", "cuda")
    model.fuse_projections()
    model.compile_layers()
    heads = step_heads(shape, model, "cuda", str(HEADS))
    given = [a for a in sys.argv[1:] if not a.startswith("--")]
    contexts = [int(c) for c in (given[0] if given else "300,1000").split(",")]
    for context in contexts:
        for name in TREES:
            tree = None if name == "single" else resolve_tree(name, HEADS)
            drafts = tree is not None and tree.depth > 0
            times = time_tree(model, heads if drafts else None, tree, context)
            print(json.dumps({"ctx": context, "tree": name, **times}), flush=True)
    if "--kernels" in sys.argv:
        tree = resolve_tree("calibrated-16+lookup-8", HEADS)
        print(json.dumps({"tree": "calibrated-16+lookup-8", "kernels": count_kernels(model, heads, tree, 300)}))


if __name__ == "__main__":
    main()
