"""Where a batched workload's time goes: prefills, steps per batch bucket, and the phases of one step.

``specmemo bench --batch`` reports total tokens/s; this says why a speculative batch
gains what it gains. One pass of the bench's workload (the queries as concurrent
requests, joining as slots free) through a ``BatchDecoder``, timed by part:

prefill      ``add``: each new request's prompt, prefilled alone while the batch waits.
steps        ``step``: per batch bucket, how many steps ran and their median time.
phases       one step at the full bucket, eagerly, its four phases timed apart with a
             device sync between them (draft → verify → accept → commit + host read).

    python -m specmemo_core.tools.batch_profile --batch 8 --tree calibrated-8+lookup-3 --dtype bf16 --json

Every timing ends in a host read (a step's ``settle``, a prefill's first token), so no
extra sync is needed for the pass figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

from specmemo_core.runtime.batch import BatchDecoder, buckets
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.runtime.step import GreedyAcceptance, commit, draft_tokens, settle, verify


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_pass(decoder: BatchDecoder, prompts: Sequence[Sequence[int]], config: GenerationConfig) -> dict[str, Any]:
    """Every prompt through ``decoder`` once (as the batch bench runs them), timed by part."""
    prefill_s = 0.0
    step_times: dict[int, list[float]] = defaultdict(list)
    row_steps = new_tokens = 0
    waiting = list(range(len(prompts)))
    start = time.perf_counter()
    while waiting or decoder.active:
        while waiting and decoder.free_slots:
            i = waiting.pop(0)
            t0 = time.perf_counter()
            decoder.add(i, prompts[i], max_new_tokens=config.max_new_tokens, config=config)
            prefill_s += time.perf_counter() - t0
        rows = len(decoder.active)
        bucket = next(b for b in buckets(decoder.slots) if b >= rows)
        t0 = time.perf_counter()
        out = decoder.step()
        step_times[bucket].append(time.perf_counter() - t0)
        row_steps += rows
        new_tokens += sum(map(len, out.values()))
    total = time.perf_counter() - start
    return {
        "total_s": round(total, 4), "prefill_s": round(prefill_s, 4),
        "step_s": round(sum(sum(v) for v in step_times.values()), 4),
        "new_tokens": new_tokens, "tokens_per_s": round(new_tokens / total, 2),
        "tokens_per_row_step": round((new_tokens - len(prompts)) / max(row_steps, 1), 4),
        "buckets": {str(b): {"steps": len(v), "median_ms": round(1e3 * statistics.median(v), 3)}
                    for b, v in sorted(step_times.items())},
    }


def profile_phases(decoder: BatchDecoder, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                   repeats: int = 5) -> dict[str, float]:
    """Median ms of each phase of an eager step with every slot full (greedy)."""
    device = decoder.model.device
    endless = GenerationConfig(max_new_tokens=10**6)  # no stop token: every slot stays full
    for i in range(decoder.slots):
        decoder.add(("phase", i), prompts[i % len(prompts)], max_new_tokens=10**6, config=endless)
    decoder.step()  # the first step reports the prefills' tokens
    parts = decoder._parts[decoder.slots]
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        buf = decoder._next_buffers(parts.cache)
        span = parts.cache.span_for(buf.depths.shape[0])
        marks = [time.perf_counter()]

        def mark() -> None:
            _sync(device)
            marks.append(time.perf_counter())

        with torch.inference_mode():
            parts.cache.ensure_room(buf.depths.shape[0])
            mark()
            proposal = draft_tokens(parts, buf)
            mark()
            verified = verify(parts, proposal, proposal.layout, span)
            mark()
            accepted = GreedyAcceptance().accept(parts.model, verified, buf)
            mark()
            settle(parts, commit(parts, verified, accepted, span))
            mark()
        for name, a, b in zip(("draft", "verify", "accept", "commit"), marks[1:], marks[2:]):
            times[name].append(b - a)
    for seq_id in decoder.active:
        decoder.remove(seq_id)
    return {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}


def profile(model: Any, heads: Any, prompts: Sequence[Sequence[int]], *, batch: int, tree: Any,
            config: GenerationConfig, graphs: bool, passes: int = 2,
            make: Callable[..., BatchDecoder] = BatchDecoder) -> dict[str, Any]:
    """Plain and speculative (``tree``) decoders of ``batch`` slots: the last of ``passes`` passes each,
    and the eager phases of a full step."""
    longest = max(map(len, prompts))
    report: dict[str, Any] = {}
    for name, t in (("plain", None), ("speculative", tree)):
        nodes = t.num_nodes if t is not None else 1
        decoder = make(model, slots=batch, capacity=longest + config.max_new_tokens + nodes + 1,
                       heads=heads if t is not None else None, tree=t, graphs=graphs)
        runs = [profile_pass(decoder, prompts, config) for _ in range(passes)]
        eager = make(model, slots=batch, capacity=longest + 64 + nodes + 1,
                     heads=heads if t is not None else None, tree=t, graphs=False)
        report[name] = {"tree": t.name if t is not None else None, "nodes": nodes, "pass": runs[-1],
                        "eager_phases_ms": profile_phases(eager, prompts, config)}
    return report


def main(argv: Sequence[str] | None = None) -> int:
    from specmemo_core.planning.entry import torch_dtype
    from specmemo_core.runtime.chat import encode_conversation, end_of_turn_ids
    from specmemo_core.runtime.engine import Engine, resolve_tree
    from specmemo_core.storage.datasets import mtbench_conversations

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tree", default="calibrated-8+lookup-3")
    p.add_argument("--queries", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    engine = Engine.load(args.model, heads="auto", dtype=torch_dtype(args.dtype), device=args.device)
    prompts = [encode_conversation(engine.tokenizer, [{"role": "user", "content": turn}], {})
               for turns in mtbench_conversations(args.queries) for turn in turns]  # as ``bench --batch``
    tree = resolve_tree(args.tree, engine.heads_folder)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens,
                              stop_token_ids=frozenset(end_of_turn_ids(engine.tokenizer, engine.config)))
    report = profile(engine.model, engine.heads, prompts, batch=args.batch, tree=tree, config=config,
                     graphs=engine.model.device.type == "cuda", passes=args.passes)
    report["_run"] = {"batch": args.batch, "dtype": args.dtype, "device": str(engine.model.device),
                      "queries": len(prompts), "max_new_tokens": args.max_new_tokens}
    print(json.dumps(report, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
