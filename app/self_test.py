"""``specmemo-chat --self-test``: load, plan, 16 speculative tokens, one line of report; no window."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from specmemo_core.runtime.decoding import GenerationConfig, ReplyStats

from .runtime import Runtime, load_runtime
from .settings import ChatSettings

PROMPT = "Write a Python function that returns the sum of a list."
FALLBACK_TREE = "calibrated-4"


def run_self_test(data_folder: Path, model: str = "default", tokens: int = 16) -> str:
    """Returns the report line; raises SpecMemoError (or anything else) on failure."""
    settings = ChatSettings(model=model, heads="auto", speculate=True, max_reply_tokens=tokens)
    runtime: Runtime = load_runtime(settings, data_folder, lambda stage, fraction: None)
    backend = runtime.backend
    if not backend.engine.speculative:  # NOTE: the planner keeps CPUs plain; the self-test checks speculation
        tree = runtime.plan.tree or FALLBACK_TREE
        backend = backend.with_tree(tree)
    if not backend.engine.speculative:
        raise RuntimeError("speculation could not be switched on: no draft heads were found for this model")
    session = backend.new_session(runtime.capacity, None, True)
    stats = ReplyStats()
    start = time.perf_counter()
    for piece in session.send(PROMPT, GenerationConfig(max_new_tokens=tokens)):
        stats.add(piece.step, piece.text, time.perf_counter() - start)
    count, seconds = stats.tokens, time.perf_counter() - start
    if count == 0:
        raise RuntimeError("the model produced no tokens")
    p = runtime.plan
    runtime = replace(runtime, backend=backend)
    return (f"self-test ok: model {backend.name}, device {runtime.device.kind} {runtime.device.name}, "
            f"plan {p.precision} tree {p.tree or 'none'} kv {p.kv_tokens} tokens ({p.turns} turns), "
            f"ran tree {backend.tree_name}, {count} tokens in {seconds:.2f} s = {count / seconds:.1f} tokens/s, "
            f"mean accepted {stats.mean_accepted:.2f} tokens/step")
