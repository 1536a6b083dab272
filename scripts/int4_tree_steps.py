"""Issue 23 on a CPU: step times of int4 weights with bf16 activations against bf16, plain
and on two trees, alternating (bf16, int4, bf16, int4) in one process.

Default model with its shipped heads, the first user turns of MT-Bench questions 1-3, 64
new tokens each, greedy, ``Decoder`` steps (prefill excluded), 2 torch threads. Prints one
line per (precision, tree): tokens/s, tokens per step, ms per step.

    python scripts/int4_tree_steps.py > docs/results/int4_cpu/tree_steps.txt
"""

from __future__ import annotations

import time

import torch

from specmemo_core.runtime.chat import encode_conversation
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.engine import Engine
from specmemo_core.storage.datasets import mtbench_questions

TREES = (None, "calibrated-4+lookup-3", "dynamic-12+lookup-8")


def main() -> None:
    torch.set_num_threads(2)
    questions = [q["turns"][0] for q in mtbench_questions()[:3]]
    for precision in ("bf16", "int4", "bf16", "int4"):
        engine = Engine.load("default", precision=precision if precision == "int4" else None, dtype=torch.bfloat16)
        for tree in TREES:
            eng = engine.with_tree(tree)
            tokens = steps = 0
            seconds = 0.0
            for question in questions:
                ids = encode_conversation(eng.tokenizer, [{"role": "user", "content": question}], {})
                decoder = Decoder(eng.model, eng.model.new_cache(1024), eng.heads if tree else None, eng.tree)
                start = 0.0
                for step in decoder.generate(ids, GenerationConfig(max_new_tokens=64)):
                    if step.prefill:
                        start = time.perf_counter()
                        continue
                    tokens += len(step.token_ids)
                    steps += 1
                seconds += time.perf_counter() - start
            print(precision, tree, round(tokens / seconds, 1), "tok/s", round(tokens / steps, 2), "tok/step",
                  round(seconds / steps * 1000, 1), "ms/step", flush=True)


if __name__ == "__main__":
    main()
