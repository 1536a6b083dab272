"""``specmemo bench --batch 1,2,4,8,16``: total tokens/s of many conversations decoded at once.

The queries (MT-Bench's first user turns by default) are concurrent requests: a
``runtime.batch.BatchDecoder`` of B slots takes them in order, a new one joining as soon
as a slot frees (continuous batching), until every reply is done. For each B two methods
run the same workload, interleaved after an untimed warm-up round (``bench.run_bench``):

plain        batched plain decoding (tree ``none``: one token per sequence per step).
speculative  batched speculation on the tree the planner picks for B conversations
             (``PlanChoices.batch``; plain decoding where drafts no longer pay).

The report gives, per B and method, total tokens/s over the passes (median, min, max),
new tokens per sequence per step, and how many replies are token-for-token the plain
method's (greedy: all of them, whatever the tree).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.batch import BatchDecoder
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.runtime.tree import Tree
from specmemo_core.tools.bench import Method, Pass, Spread, identical_count, run_bench

METHODS = ("plain", "speculative")


def parse_batches(text: str) -> list[int]:
    """``"1,2,4"`` → [1, 2, 4]: distinct whole numbers from 1 to 256 (checked before anything loads)."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or len(set(sizes)) != len(sizes) or not all(1 <= b <= 256 for b in sizes):
        raise SpecMemoError(f"--batch needs distinct batch sizes from 1 to 256, e.g. 1,2,4,8,16; got {text!r}")
    return sizes


def batch_runner(decoder: BatchDecoder, prompts: Sequence[Sequence[int]],
                 config: GenerationConfig) -> Callable[[], Pass]:
    """Every prompt through ``decoder`` (made once, reused by every pass), each joining as a slot frees."""

    def run() -> Pass:
        replies: list[list[int]] = [[] for _ in prompts]
        waiting = list(range(len(prompts)))
        sequence_steps = 0
        start = time.perf_counter()
        while waiting or decoder.active:
            while waiting and decoder.free_slots:
                i = waiting.pop(0)
                decoder.add(i, prompts[i], max_new_tokens=config.max_new_tokens, config=config)
            for i, tokens in decoder.step().items():
                replies[i] += tokens
            sequence_steps += len(decoder.active) + len(decoder.finished)
        seconds = time.perf_counter() - start  # the step's host read waited for the device
        new = sum(map(len, replies))
        return Pass(replies, new, seconds, sequence_steps, new - len(prompts), ())

    return run


def batch_methods(model: Any, heads: Any, prompts: Sequence[Sequence[int]], *, batches: Sequence[int],
                  tree_for: Callable[[int], Tree | None], config: GenerationConfig,
                  graphs: bool = False) -> list[Method]:
    """Plain and speculative methods for each batch size; ``tree_for(B)``: the speculative tree."""
    longest = max(map(len, prompts))
    methods = []
    for b in batches:
        for name in METHODS:
            tree = tree_for(b) if name == "speculative" else None
            nodes = tree.num_nodes if tree is not None else 1
            decoder = BatchDecoder(model, slots=b, capacity=longest + config.max_new_tokens + nodes + 1,
                                   heads=heads if tree is not None else None, tree=tree, graphs=graphs)
            methods.append(Method(f"{name}/b{b}", batch_runner(decoder, prompts, config),
                                  tree.name if tree is not None else None, nodes))
    return methods


def batch_report(methods: Sequence[Method], passes: dict[str, list[Pass]]) -> dict[str, Any]:
    """{B: {method: summary}, speedup of speculative over plain}."""
    out: dict[str, Any] = {}
    for m in methods:
        name, b = m.name.split("/b")
        runs = passes[m.name]
        entry = out.setdefault(b, {})
        entry[name] = {
            "tree": m.tree, "tree_nodes": m.tree_nodes,
            "tokens_per_s": Spread.of([p.tokens_per_s for p in runs]).as_dict(),
            "tokens_per_s_passes": [round(p.tokens_per_s, 3) for p in runs],
            "tokens_per_sequence_step": round(runs[-1].mean_accepted, 4),
            "new_tokens": runs[-1].new_tokens, "replies": len(runs[-1].replies),
        }
    for b, entry in out.items():
        plain = passes[f"plain/b{b}"][-1].replies
        for name in METHODS:
            entry[name]["identical_to_plain"] = identical_count(passes[f"{name}/b{b}"][-1].replies, plain)
        base = entry["plain"]["tokens_per_s"]["median"]
        entry["speedup"] = round(entry["speculative"]["tokens_per_s"]["median"] / base, 3) if base else None
    return out


def run_batch_bench(model: Any, heads: Any, prompts: Sequence[Sequence[int]], *, batches: Sequence[int],
                    tree_for: Callable[[int], Tree | None], config: GenerationConfig, repeats: int,
                    device: str = "cpu", graphs: bool = False, progress: Any = None) -> dict[str, Any]:
    methods = batch_methods(model, heads, prompts, batches=batches, tree_for=tree_for, config=config, graphs=graphs)
    return batch_report(methods, run_bench(methods, repeats, device=device, progress=progress))


def format_batch_table(result: dict[str, Any]) -> str:
    lines = [f"{'batch':>6}{'method':>13}  {'tree':<26}{'tok/s median':>13}{'min':>9}{'max':>9}"
             f"{'tok/seq-step':>13}{'identical':>10}"]
    for b, entry in result.items():
        if b.startswith("_"):
            continue
        for name in METHODS:
            r = entry[name]
            s = r["tokens_per_s"]
            lines.append(f"{b:>6}{name:>13}  {(r['tree'] or 'none')[:25]:<26}{s['median']:>13.2f}{s['min']:>9.2f}"
                         f"{s['max']:>9.2f}{r['tokens_per_sequence_step']:>13.2f}"
                         f"{str(r['identical_to_plain']) + '/' + str(r['replies']):>10}")
    return "\n".join(lines)
