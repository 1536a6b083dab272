"""``specmemo bench``: tokens/s of transformers' generate and our decoders, side by side."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specmemo_core.cli.common import DTYPES, StageProgress, add_threads_arg, device_default
from specmemo_core.errors import SpecMemoError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="tokens/s of transformers' generate and our decoders, side by side")
    p.add_argument("--model", default="default")
    p.add_argument("--heads", default="auto", help="'auto' (shipped heads), 'random', or a heads folder/file")
    p.add_argument("--prompts", default=None, help="JSONL with a 'turns' list per line (default: MT-Bench)")
    p.add_argument("--queries", type=int, default=20, help="the first N user turns (default 20)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after one untimed warm-up round")
    p.add_argument("--methods", default=None,
                   help="comma list of hf, hf-pld, vanilla, plan and tree names (default: all of "
                        "hf,hf-pld,vanilla,medusa-64,1-10-16-17,plan)")
    p.add_argument("--device", default=device_default())
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    add_threads_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by method")
    p.add_argument("--save", default=None, metavar="FILE",
                   help="also write the JSON report to FILE after every timed round (a run cut short "
                        "keeps its finished rounds; _run.rounds_done says how many)")
    p.add_argument("--batch", default=None, metavar="B,B,…",
                   help="batched decoding instead of --methods: the queries as concurrent requests through "
                        "batch decoders of these sizes (e.g. 1,2,4,8,16), batched plain and batched speculation "
                        "on the planner's tree for each size; total tokens/s")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw tokens/s per method (median, min–max) as a PNG bar chart")
    p.set_defaults(run=run)


def _method_names(args: argparse.Namespace) -> list[str]:
    """The checks made before anything loads, so a typo costs no loading time."""
    from specmemo_core.tools.bench import ALL_METHODS

    names = [m.strip() for m in (args.methods or ",".join(ALL_METHODS)).split(",") if m.strip()]
    if not names or len(set(names)) != len(names):
        raise SpecMemoError(f"--methods needs distinct names, e.g. {','.join(ALL_METHODS)}; got {args.methods!r}")
    if not 1 <= args.max_new_tokens < 4096 or not 1 <= args.repeats <= 100:
        raise SpecMemoError("--max-new-tokens must be 1…4095 and --repeats 1…100")
    if args.plot and not args.plot.lower().endswith(".png"):  # refused now, not after the run
        raise SpecMemoError(f"--plot needs a .png file name, got {args.plot!r}")
    return names


def _measure(args: argparse.Namespace, names: list[str], progress: StageProgress) -> dict:
    from specmemo_core.runtime.engine import Engine
    from specmemo_core.storage.datasets import first_queries, load_prompt_file, mtbench_conversations
    from specmemo_core.storage.data_folder import data_dir
    from specmemo_core.tools.bench import HF_METHODS, build_methods, report, run_bench, run_info

    convs = (first_queries(load_prompt_file(args.prompts), args.queries) if args.prompts
             else mtbench_conversations(args.queries))
    dtype = DTYPES[args.dtype]
    engine = Engine.load(args.model, heads=args.heads, tree=None, dtype=dtype, device=args.device, progress=progress)
    hf = None
    if any(n in HF_METHODS for n in names):
        from specmemo_core.storage.sources import load_model
        from specmemo_core.tools.train.pipeline import hf_model_from

        hf = hf_model_from(load_model(args.model), args.device, dtype)
    methods = build_methods(names, engine, hf, convs, max_new_tokens=args.max_new_tokens, precision=args.dtype,
                            data_folder=data_dir())  # the plan method reads the device timing the chat cached

    def full_report(passes: dict) -> dict:
        result = report(methods, passes)
        result["_run"] = run_info(engine.identity.name, args.device, args.dtype, conversations=convs,
                                  max_new_tokens=args.max_new_tokens, repeats=args.repeats, methods=names)
        result["_run"]["rounds_done"] = len(next(iter(passes.values())))
        return result

    def save(passes: dict) -> None:  # after every round: a run cut short keeps what it measured
        tmp = Path(args.save).with_suffix(".tmp")
        tmp.write_text(json.dumps(full_report(passes), indent=1), encoding="utf-8")
        tmp.replace(args.save)

    passes = run_bench(methods, args.repeats, device=args.device, progress=progress,
                       on_round=save if args.save else None)
    return full_report(passes)


def _measure_batches(args: argparse.Namespace, batches: list[int], progress: StageProgress) -> dict:
    """``--batch``: every query a request of its own, through batch decoders of each size."""
    from specmemo_core.runtime.chat import encode_conversation, end_of_turn_ids
    from specmemo_core.runtime.decoding import GenerationConfig
    from specmemo_core.runtime.engine import Engine, resolve_tree
    from specmemo_core.storage.data_folder import data_dir
    from specmemo_core.storage.datasets import first_queries, load_prompt_file, mtbench_conversations
    from specmemo_core.text import encodable
    from specmemo_core.tools.batch_bench import run_batch_bench
    from specmemo_core.tools.bench import planner_choice, run_info

    convs = (first_queries(load_prompt_file(args.prompts), args.queries) if args.prompts
             else mtbench_conversations(args.queries))
    engine = Engine.load(args.model, heads=args.heads, tree=None, dtype=DTYPES[args.dtype], device=args.device,
                         progress=progress)
    prompts = [encode_conversation(engine.tokenizer, [{"role": "user", "content": encodable(turn)}], {})
               for turns in convs for turn in turns]
    trees = {}

    def tree_for(b: int):
        chosen = planner_choice(engine, args.dtype, args.max_new_tokens, data_folder=data_dir(), batch=b)
        trees[b] = chosen.tree
        return resolve_tree(chosen.tree, engine.heads_folder) if chosen.tree else None

    config = GenerationConfig(max_new_tokens=args.max_new_tokens,
                              stop_token_ids=frozenset(end_of_turn_ids(engine.tokenizer, engine.config)))
    result = run_batch_bench(engine.model, engine.heads, prompts, batches=batches, tree_for=tree_for, config=config,
                             repeats=args.repeats, device=args.device, graphs=engine.model.device.type == "cuda",
                             progress=progress)
    result["_run"] = run_info(engine.identity.name, args.device, args.dtype, conversations=convs,
                              max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                              methods=["plain", "speculative"])
    result["_run"].update(batches=batches, planner_trees={str(b): t for b, t in trees.items()},
                          requests=len(prompts))
    return result


def run(args: argparse.Namespace) -> int:
    from specmemo_core.tools.bench import format_table, plot_report

    if args.batch is not None:
        return _run_batches(args)
    names = _method_names(args)
    progress = StageProgress()
    try:
        result = _measure(args, names, progress)
    finally:
        progress.close()
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    if args.plot:
        print(f"chart: {plot_report(result, args.plot)}", file=sys.stderr)
    return 0


def _run_batches(args: argparse.Namespace) -> int:
    from specmemo_core.tools.batch_bench import format_batch_table, parse_batches

    batches = parse_batches(args.batch)  # refused before anything loads
    if not 1 <= args.max_new_tokens < 4096 or not 1 <= args.repeats <= 100:
        raise SpecMemoError("--max-new-tokens must be 1…4095 and --repeats 1…100")
    progress = StageProgress()
    try:
        result = _measure_batches(args, batches, progress)
    finally:
        progress.close()
    if args.save:
        Path(args.save).write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps(result) if args.json else format_batch_table(result))
    return 0
