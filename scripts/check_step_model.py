"""The planner's step model (``plan_check.time_forward``) against whole graph-replayed steps of
the trees it chooses among: the default model's shape (random weights), its trained heads, bf16,
on a GPU, at a 128- and a 1,000-token context (or those given), two timings of 60 steps each.

    python3 scripts/check_step_model.py [128,1000] > step_model.jsonl   (docs/results/tree_rows_h200/)
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from specmemo_core.planning.memory import known_shape
from specmemo_core.planning.plan_check import random_model, time_forward
from specmemo_core.runtime.engine import resolve_tree

TREES = ("single", "lookup-8", "chain-1", "calibrated-12+lookup-8", "dynamic-16+lookup-8", "dynamic-32+lookup-8",
         "calibrated-24+lookup-8", "calibrated-48+lookup-8", "medusa-64")
HEADS = Path("assets/heads/SmolLM2-135M-Instruct")


def main() -> None:
    from time_graph_steps import step_heads, time_steps

    logging.basicConfig(level=logging.INFO)  # time_forward's timed steps, the fit's points, on stderr
    shape = known_shape("smollm2-135m")
    model = random_model(shape, "bf16", "cuda")
    model.fuse_projections()
    heads = step_heads(shape, model, "cuda", str(HEADS))
    t0 = time.time()
    model_step = time_forward(model, heads)
    print(json.dumps({"time_forward_s": round(time.time() - t0, 1)}), flush=True)
    contexts = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "128,1000").split(",")]
    for context in contexts:
        for name in TREES:
            tree = None if name == "single" else resolve_tree(name, HEADS)
            drafts = tree is not None and tree.depth > 0
            ms = [time_steps(model, heads if drafts else None, tree, True, 60, context=context) for _ in range(2)]
            nodes, depth = (1, 0) if tree is None else (tree.num_nodes, tree.depth)
            grown = tree is not None and tree.growth is not None
            print(json.dumps({"ctx": context, "tree": name, "nodes": nodes, "depth": depth, "grown": grown,
                              "graph_step_ms": [round(m, 3) for m in ms],
                              "model_ms": round(model_step(nodes, depth, grown) * 1e3, 3)}), flush=True)


if __name__ == "__main__":
    main()
