"""``specmemo train-heads``, ``calibrate`` and ``eval-acceptance``: making and measuring draft heads."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specmemo_core.cli.common import DTYPES, StageProgress, add_threads_arg, device_default
from specmemo_core.errors import SpecMemoError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    _add_speed_up(subparsers)
    _add_train_heads(subparsers)
    _add_calibrate(subparsers)
    _add_eval_acceptance(subparsers)


def _add_heldout_args(p: argparse.ArgumentParser) -> None:
    """What training and calibration share: the held-out prompts, the base model's replies to
    them (how long, how many at once), and where it runs."""
    p.add_argument("--heldout-prompts", type=int, default=300)
    p.add_argument("--heldout-file", default=None)
    p.add_argument("--reply-tokens", type=int, default=256)
    p.add_argument("--gen-batch", type=int, default=256)
    p.add_argument("--device", default=device_default())
    add_threads_arg(p)


def _add_train_heads(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train-heads", help="train draft heads for a model by self-distillation")
    p.add_argument("--model", default="default")
    p.add_argument("--out", required=True, help="output folder (re-running resumes)")
    p.add_argument("--kind", choices=["medusa", "hydra"], default="hydra")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--context-layer", action="store_true",
                   help="hydra heads read the base states through one attention layer of their own")
    p.add_argument("--context-next", action="store_true",
                   help="the context layer also reads each position's next token (implies --context-layer)")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=4000, help="training conversations (ShareGPT train split)")
    p.add_argument("--turns", type=int, default=1,
                   help="user turns answered per conversation (2: also learn from second turns, as in a chat)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="hydra: draft among this many most frequent reply tokens (0: the whole vocabulary)")
    p.add_argument("--prompts-file", default=None, help="JSONL prompts instead of ShareGPT")
    _add_heldout_args(p)
    p.set_defaults(run=run_train_heads)


def _add_speed_up(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "speed-up", help="train draft heads for your model (what the app's 'Speed up this model' does)",
        description="Train draft heads for a model by self-distillation on the prompts shipped with the app "
                    "(or your own), calibrate them, and store them where the app and every command find them "
                    "next time. Prints a time estimate first; running it again resumes.")
    p.add_argument("--model", default="default", help="'default', a .gguf file or a model folder; "
                                                      "shape:NAME estimates a model of that shape (--estimate)")
    p.add_argument("--prompts-file", default=None, help="your own prompts (JSONL, one {\"turns\": [...]} a line)")
    p.add_argument("--prompts", type=int, default=None, help="train on this many prompts (default 8000)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 4000)")
    p.add_argument("--estimate", action="store_true", help="only time the job on this device and print the estimate")
    p.add_argument("--device", default=device_default())
    p.add_argument("--json", action="store_true")
    add_threads_arg(p)
    p.set_defaults(run=run_speed_up)


def run_speed_up(args: argparse.Namespace) -> int:
    from specmemo_core.storage.data_folder import data_dir
    from specmemo_core.storage.sources import open_model
    from specmemo_core.tools.train.speed_up import (base_model_for, estimate_training, preflight, speed_up_job,
                                                    train_speed_up_heads)

    shape = args.model.startswith("shape:")
    if shape and not args.estimate:
        raise SpecMemoError("a shape: model has random weights: heads trained on it would be of no use; "
                            "add --estimate to time the job, or give a real model file")
    with StageProgress() as progress:
        opened = None if shape else open_model(args.model, progress)  # the header: no weight read yet
        name, fingerprint = ((args.model[len("shape:"):], "shape") if shape
                             else (opened.identity.name, opened.identity.fingerprint))
        job = speed_up_job(args.model, name=name, fingerprint=fingerprint, device=args.device,
                           data_folder=data_dir(), prompts_file=args.prompts_file, prompts=args.prompts,
                           steps=args.steps)
        memory = preflight(job, opened=opened)  # refuses, with how many prompts fit, before the weights are read
        hf, _, _ = base_model_for(args.model, args.device, progress)
        estimate = estimate_training(job, hf, progress=progress)
        del hf
        print(f"training heads for {name}: {estimate.describe()}; needs {memory.host_bytes / 2**30:.1f} GiB of RAM"
              + (f" and {memory.device_bytes / 2**30:.1f} GiB of GPU memory" if memory.device_bytes else "")
              + ("; resuming" if job.started else ""), file=sys.stderr)
        if args.estimate:
            print(json.dumps({"model": name, "estimate": estimate.as_dict()}, indent=1) if args.json
                  else estimate.describe())
            return 0
        card = train_speed_up_heads(job, progress=progress, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps({"heads": str(job.out), "estimate": estimate.as_dict(), "card": card}, indent=1) if args.json
          else f"heads stored in {job.out}; every command and the app use them from now on")
    return 0


def _add_calibrate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="measure heads' accuracy and tree-path acceptance on held-out prompts")
    p.add_argument("--heads", required=True)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="the base model's precision for the held-out replies (default: bf16 on a GPU, fp32 on a CPU)")
    _add_heldout_args(p)
    p.set_defaults(run=run_calibrate)


def _add_eval_acceptance(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval-acceptance", help="accepted tokens per step and speed per tree, vs plain greedy")
    p.add_argument("--model", default="default")
    p.add_argument("--heads", default="auto")
    p.add_argument("--prompts", default=None, help="JSONL with a 'turns' list per line (default: MT-Bench)")
    p.add_argument("--queries", type=int, default=20)
    p.add_argument("--tree", action="append", help="tree to evaluate (repeatable); default: medusa-64, "
                                                   "1-10-16-17, calibrated-64 and calibrated-56+lookup-8")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default=device_default())
    p.add_argument("--json", action="store_true")
    add_threads_arg(p)
    p.set_defaults(run=run_eval_acceptance)


def run_train_heads(args: argparse.Namespace) -> int:
    from specmemo_core.tools.train.pipeline import PipelineConfig, run_training
    from specmemo_core.tools.train.trainer import TrainConfig

    cfg = PipelineConfig(
        model=args.model, kind=args.kind, num_heads=args.heads, num_layers=args.layers,
        context=args.context_layer or args.context_next, context_next=args.context_next,
        train_prompts=args.prompts, turns=args.turns, draft_vocab=args.draft_vocab,
        heldout_prompts=args.heldout_prompts, max_new_tokens=args.reply_tokens,
        gen_batch=args.gen_batch, prompts_file=args.prompts_file, heldout_file=args.heldout_file,
        train=TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed),
    )
    with StageProgress() as progress:
        card = run_training(cfg, Path(args.out), args.device, progress, log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(card, indent=1))
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from specmemo_core.tools.train.pipeline import PipelineConfig, calibrate_folder

    cfg = PipelineConfig(model=args.model, heldout_prompts=args.heldout_prompts, heldout_file=args.heldout_file,
                         max_new_tokens=args.reply_tokens, gen_batch=args.gen_batch)
    with StageProgress() as progress:
        record = calibrate_folder(Path(args.heads), cfg, args.device, progress,
                                  dtype=DTYPES[args.dtype] if args.dtype else None)
    print(json.dumps({"topk_accuracy": record["topk_accuracy"], "expected_accepted": record["expected_accepted"]},
                     indent=1))
    return 0


def _evaluate(args: argparse.Namespace, progress: StageProgress) -> dict:
    from specmemo_core.runtime.engine import Engine, resolve_tree
    from specmemo_core.storage.datasets import first_queries, load_prompt_file, mtbench_conversations
    from specmemo_core.tools.evaluate import eval_acceptance

    engine = Engine.load(args.model, heads=args.heads, tree=None, dtype=DTYPES[args.dtype], device=args.device,
                         progress=progress)
    if engine.heads is None:
        raise SpecMemoError("no draft heads: give --heads DIR (or train them with specmemo train-heads)")
    folder = engine.heads_folder
    picked = (first_queries(load_prompt_file(args.prompts), args.queries) if args.prompts
              else mtbench_conversations(args.queries))
    names = args.tree or ["medusa-64", "1-10-16-17"] + (
        ["calibrated-64", "calibrated-56+lookup-8"] if folder and (folder / "calibration.json").exists() else [])
    trees = [resolve_tree(n, folder) for n in names]
    return eval_acceptance(engine.model, engine.tokenizer, engine.config, picked, heads=engine.heads,
                           trees=trees, max_new_tokens=args.max_new_tokens, progress=progress)


def run_eval_acceptance(args: argparse.Namespace) -> int:
    with StageProgress() as progress:
        report = _evaluate(args, progress)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{'tree':<16}{'nodes':>6}{'tokens/step':>15}{'tok/s':>9}{'vs plain':>10}{'identical':>11}")
    for name, r in report.items():
        print(f"{name:<16}{r['tree_nodes']:>6}{r['tokens_per_step']:>15.3f}{r['tokens_per_s']:>9.1f}"
              f"{r['speedup_vs_plain']:>9.2f}x{r['identical_turns']:>7}/{r['turns']}")
    return 0
