"""The planner's step-time model against the decoder's measured steps, per tree (CPU or GPU).

Decodes one prompt with plain decoding and several trees (3 rounds, interleaved), takes each
tree's 25th-percentile step time (a shared machine only adds time), and prints the measured
step-time ratio to a plain step next to the ratio ``plan_check.time_forward`` predicts.

    python scripts/step_model_check.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specmemo_core.planning.plan_check import time_forward
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.runtime.engine import Engine

TREES = (None, "calibrated-4+lookup-3", "calibrated-6+lookup-3", "calibrated-12", "calibrated-32")
PROMPT = "Give me three ideas for a rainy Sunday afternoon."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = Engine.load("default", precision="fp32")
    times: dict = {t: [] for t in TREES}
    accepted: dict = {t: [] for t in TREES}
    for _ in range(args.rounds):
        for tree in TREES:
            session = base.with_tree(tree).new_session(1024, None, speculate=tree is not None)
            for piece in session.send(PROMPT, GenerationConfig(max_new_tokens=40)):
                if not piece.step.prefill:
                    times[tree].append(piece.step.forward_s)
                    accepted[tree].append(piece.step.accepted)
    p25 = {t: sorted(v)[len(v) // 4] for t, v in times.items()}
    model = time_forward(base.model, base.heads)
    for tree in TREES:
        shape = base.with_tree(tree).tree
        nodes, depth = (shape.num_nodes, shape.depth) if shape is not None else (1, 0)
        print(f"{str(tree):24s} nodes {nodes:3d}  measured {p25[tree] / p25[None]:.2f}x plain  "
              f"predicted {model(nodes, depth) / model(1, 0):.2f}x  mean accepted {statistics.mean(accepted[tree]):.2f}")


if __name__ == "__main__":
    main()
