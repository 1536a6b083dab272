"""``specmemo bench --batch 1,2,4,8,16``: total tokens/s of many conversations decoded at once.

The workload is clients sending requests at once (``Requests``): by default each MT-Bench
conversation is a client that sends its user turns in order, each request carrying the
conversation so far (the earlier replies included, as an OpenAI client resends them);
``--batch-requests turns`` makes every user turn a request alone. A
``runtime.batch.BatchDecoder`` of B slots takes the requests in order, a new one joining
as soon as a slot frees (continuous batching), until every reply is done. For each B two
methods run the same workload, interleaved after an untimed warm-up round
(``bench.run_bench``):

plain        batched plain decoding (tree ``none``: one token per sequence per step).
speculative  batched speculation on the tree the planner picks for B conversations
             (``PlanChoices.batch``; plain decoding where drafts no longer pay).

The report gives, per B and method, total tokens/s over the passes (median, min, max),
new tokens per sequence per step, and how many replies are token-for-token the plain
method's (greedy: all of them, whatever the tree).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.batch import BatchDecoder
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.runtime.tree import Tree
from specmemo_core.tools.bench import Method, Pass, Spread, identical_count, run_bench, turn_prompt

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


@dataclass(frozen=True)
class Requests:
    """The workload: clients, each sending its requests one after another (a client sends
    its next one when the reply to the last one is done, as a chat client does).
    ``prompt(c, replies)``: the ids of client c's next request, given the replies it got
    so far; ``longest``: no prompt is longer (the batch slots are sized for it)."""

    turns: tuple[int, ...]  # requests per client
    prompt: Callable[[int, Sequence[Sequence[int]]], list[int]]
    longest: int

    @classmethod
    def alone(cls, prompts: Sequence[Sequence[int]]) -> Requests:
        """Every prompt a client of its own, sending it once."""
        fixed = [list(p) for p in prompts]
        return cls(tuple(1 for _ in fixed), lambda c, replies: fixed[c], max(map(len, fixed)))

    @classmethod
    def of_conversations(cls, tokenizer: Any, conversations: Sequence[Sequence[str]], *, history: bool,
                         max_new_tokens: int) -> Requests:
        """``history``: each conversation is a client that sends its user turns in order, each
        request the conversation so far (earlier replies as the ids the model gave, as
        ``bench``'s conversations are); else every user turn is a request alone."""
        if not history:
            return cls.alone([turn_prompt(tokenizer, [turn], []) for turns in conversations for turn in turns])
        convs = [list(turns) for turns in conversations]
        bound = max(len(turn_prompt(tokenizer, turns, [[]] * (len(turns) - 1))) + (len(turns) - 1) * max_new_tokens
                    for turns in convs)  # the replies' ids go in place of empty replies
        return cls(tuple(map(len, convs)), lambda c, replies: turn_prompt(tokenizer, convs[c], replies), bound)


def batch_runner(decoder: BatchDecoder, requests: Requests, config: GenerationConfig) -> Callable[[], Pass]:
    """Every request through ``decoder`` (made once, reused by every pass), each joining as a
    slot frees; a client's next request queues behind the others when its reply is done.
    The pass's replies are in (client, request) order."""

    def run() -> Pass:
        replies: list[list[list[int]]] = [[[] for _ in range(n)] for n in requests.turns]
        waiting = deque((c, 0) for c in range(len(requests.turns)))
        sequence_steps = 0
        start = time.perf_counter()
        while waiting or decoder.active:
            while waiting and decoder.free_slots:
                c, t = waiting.popleft()
                decoder.add((c, t), requests.prompt(c, replies[c][:t]), max_new_tokens=config.max_new_tokens,
                            config=config)
            for (c, t), tokens in decoder.step().items():
                replies[c][t] += tokens
            sequence_steps += len(decoder.active) + len(decoder.finished)
            waiting.extend((c, t + 1) for c, t in sorted(decoder.finished) if t + 1 < requests.turns[c])
        seconds = time.perf_counter() - start  # the step's host read waited for the device
        flat = [reply for client in replies for reply in client]
        new = sum(map(len, flat))
        return Pass(flat, new, seconds, sequence_steps, new - len(flat), ())

    return run


def batch_methods(model: Any, heads: Any, requests: Requests, *, batches: Sequence[int],
                  tree_for: Callable[[int], Tree | None], config: GenerationConfig,
                  graphs: bool = False) -> list[Method]:
    """Plain and speculative methods for each batch size; ``tree_for(B)``: the speculative tree."""
    methods = []
    for b in batches:
        for name in METHODS:
            tree = tree_for(b) if name == "speculative" else None
            nodes = tree.num_nodes if tree is not None else 1
            decoder = BatchDecoder(model, slots=b, capacity=requests.longest + config.max_new_tokens + nodes + 1,
                                   heads=heads if tree is not None else None, tree=tree, graphs=graphs)
            methods.append(Method(f"{name}/b{b}", batch_runner(decoder, requests, config),
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


def run_batch_bench(model: Any, heads: Any, requests: Requests, *, batches: Sequence[int],
                    tree_for: Callable[[int], Tree | None], config: GenerationConfig, repeats: int,
                    device: str = "cpu", graphs: bool = False, progress: Any = None) -> dict[str, Any]:
    methods = batch_methods(model, heads, requests, batches=batches, tree_for=tree_for, config=config, graphs=graphs)
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


def format_batch_markdown(result: dict[str, Any]) -> str:
    """The report as README's Markdown table: per B, total tokens/s (median, min–max) of
    batched plain and batched speculation, the tree, tokens per sequence per step, and the
    speed-up over plain at that B and over plain at B = 1 (when B = 1 ran)."""
    rows = ["| B | batched plain tok/s | tree | batched speculation tok/s | tokens/seq/step | vs plain at B "
            "| vs batch-1 plain |", "|---|---|---|---|---|---|---|"]
    one = result.get("1", {}).get("plain", {}).get("tokens_per_s", {}).get("median")
    for b, entry in result.items():
        if b.startswith("_"):
            continue
        p, s = entry["plain"]["tokens_per_s"], entry["speculative"]["tokens_per_s"]
        vs_one = f"{s['median'] / one:.2f}×" if one else "n/a"
        rows.append(f"| {b} | {p['median']:.0f} ({p['min']:.0f}–{p['max']:.0f}) | {entry['speculative']['tree'] or 'none'} "
                    f"| {s['median']:.0f} ({s['min']:.0f}–{s['max']:.0f}) "
                    f"| {entry['speculative']['tokens_per_sequence_step']:.2f} | {entry['speedup']:.2f}× | {vs_one} |")
    return "\n".join(rows)
