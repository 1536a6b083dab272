"""The memory one decoding step takes on a GPU, measured, against the memory model.

For each tree, a random-weight model of a known shape (memory does not depend on the
weights) with the default heads (``assets/heads``) runs a conversation prefix on CUDA,
then one decoding step. The step's peak of ``torch.cuda.max_memory_allocated`` above
what was allocated before it is what the step holds at once: the memory model's tree
buffers plus the forward's activations at that many nodes
(``memory.tree_buffer_bytes`` + ``memory.activation_peak_bytes``), which this prints
side by side. Steps: ``eager`` (``decoding.Decoder``, greedy), ``sampled`` (the same at
temperature 0.7: typical acceptance) and ``graphs`` (``static_decoding.StaticDecoder``'s
first step unit, captured: the graph pool keeps what the step allocates). With
``--captures``, also what making every span's step unit costs (``StaticDecoder.capture``)
for a first session and for a second one that shares its capture stream, as an engine's
sessions do.

    python scripts/measure_tree_buffers.py [--shape smollm2-135m] [--dtype bf16]
        [--trees single,1-9-6-1,1-10-16-17,medusa-64] [--context 1000] [--captures] [--save FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.engine import ASSETS_DIR
from specmemo_core.runtime.heads import load_heads
from specmemo_core.planning.memory import HeadsShape, TreeShape, activation_peak_bytes, known_shape, tree_buffer_bytes
from specmemo_core.planning.plan_check import random_model
from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache
from specmemo_core.runtime.tree import load_tree

HEADS = ASSETS_DIR / "heads" / "SmolLM2-135M-Instruct"
STEPS = {"eager": 0.0, "sampled": 0.7, "graphs": 0.0}


def measured_step_bytes(model, heads, tree, context: int, how: str) -> int:
    """Peak bytes allocated during one decoding step, above those allocated before it."""
    nodes = tree.num_nodes if tree is not None else 1
    capacity = context + 4 * nodes + 8
    if how == "graphs":
        decoder = StaticDecoder(model, new_static_cache(model, capacity), heads, tree, graphs=True)
    else:
        decoder = Decoder(model, model.new_cache(capacity), heads, tree)
    prompt = torch.randint(0, model.spec.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    steps = decoder.generate(prompt, GenerationConfig(max_new_tokens=3, temperature=STEPS[how]))
    next(steps)  # the prefill and the first token
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    next(steps)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def capture_bytes(model, heads, tree, capacity: int, stream=None) -> tuple[int, torch.cuda.Stream]:
    """Bytes that stay allocated after a new session's step units are made for every span."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    decoder = StaticDecoder(model, new_static_cache(model, capacity), heads, tree, graphs=True, capture_stream=stream)
    decoder.capture()
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated() - before - decoder.cache.nbytes
    return used, decoder._capture_stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--trees", default="single,1-9-6-1,1-10-16-17,medusa-64")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--captures", action="store_true", help="also measure making every span's step unit")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    shape = known_shape(args.shape)
    model = random_model(shape, args.dtype, "cuda")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    heads = load_heads(HEADS, shape.hidden_size, shape.vocab_size, dtype=dtype, device="cuda")
    heads.use_draft_vocab(model.lm_head.weight)
    heads_shape = HeadsShape.from_spec(heads.spec)
    rows = []
    for name in args.trees.split(","):
        tree = None if name == "single" else load_tree(name)
        shape_of_tree = TreeShape.of(tree)
        nodes = shape_of_tree.nodes
        context = args.context + nodes
        for how, temperature in STEPS.items():
            buffers = tree_buffer_bytes(shape, shape_of_tree, context, args.dtype,
                                        heads=heads_shape if tree else None, sampling=temperature > 0)
            activations = activation_peak_bytes(shape, nodes, context, args.dtype, "cuda")
            measured = measured_step_bytes(model, heads if tree is not None else None, tree, args.context, how)
            row = {"tree": name, "nodes": nodes, "step": how, "measured_bytes": measured,
                   "predicted_tree_buffers": buffers, "predicted_activations": activations,
                   "predicted_bytes": buffers + activations,
                   "error": round((buffers + activations - measured) / max(measured, 1), 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    captures = {}
    if args.captures:
        tree = load_tree("1-10-16-17")
        first, stream = capture_bytes(model, heads, tree, 4096 + tree.num_nodes)
        second, _ = capture_bytes(model, heads, tree, 4096 + tree.num_nodes, stream)
        captures = {"tree": tree.name, "spans": len(new_static_cache(model, 4096 + tree.num_nodes).spans()),
                    "first_session_bytes": first, "second_session_same_stream_bytes": second}
        print(json.dumps(captures), flush=True)
    out = {"shape": args.shape, "dtype": args.dtype, "context": args.context,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
           "captures": captures}
    if args.save:
        args.save.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
