"""Write the held-out prompt mix the shipped heads are calibrated on (JSONL, one turn each).

Why a mix: calibrating on held-out ShareGPT first turns alone over-predicted tokens per
step on MT-Bench-style questions (the first 20 MT-Bench queries: calibrated-6 predicted
2.17, measured 1.63), and the planner's tree choice follows the calibration's curve.
The mix: MT-Bench questions 11–80 with both turns (every category; the benches use
questions 1–10, the first 20 queries, so these stay out of them; second turns rework the
first reply, where lookup chains pay) and held-out ShareGPT first turns (never trained
on), cut to ``--sharegpt`` prompts of at most ``--max-chars`` characters.

    python scripts/make_calibration_prompts.py --out /tmp/calibration_prompts.jsonl
    specmemo calibrate --heads assets/heads/SmolLM2-135M-Instruct \
        --heldout-file /tmp/calibration_prompts.jsonl --heldout-prompts 400 --reply-tokens 128
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specmemo_core.storage.datasets import mtbench_questions, sharegpt_conversations
from specmemo_core.tools.train.distill import user_turns

BENCH_QUESTIONS = 10  # MT-Bench questions the benches run (their first 20 queries)


def calibration_prompts(*, sharegpt: int, max_chars: int) -> list[list[str]]:
    """Conversations (lists of user turns)."""
    mtbench = [list(q["turns"]) for q in mtbench_questions()[BENCH_QUESTIONS:]]
    held_out = [t[:1] for t in user_turns(sharegpt_conversations(), held_out=True) if len(t[0]) <= max_chars]
    return mtbench + held_out[:sharegpt]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sharegpt", type=int, default=140)
    p.add_argument("--max-chars", type=int, default=2000)
    args = p.parse_args()
    prompts = calibration_prompts(sharegpt=args.sharegpt, max_chars=args.max_chars)
    Path(args.out).write_text("".join(json.dumps({"turns": t}) + "\n" for t in prompts), encoding="utf-8")
    print(f"{len(prompts)} conversations, {sum(map(len, prompts))} turns → {args.out}")


if __name__ == "__main__":
    main()
