"""``specmemo`` command line: chat, generate (more subcommands join as they are built)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specmemo_core.runtime.chat import ChatSession
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.errors import SpecMemoError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class StageProgress:
    """A tqdm bar per named stage on stderr, so a slow load never looks like a hang."""

    def __init__(self) -> None:
        self.stage: str | None = None
        self.bar = None

    def __call__(self, stage: str, fraction: float) -> None:
        from tqdm import tqdm

        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = tqdm(total=100, desc=stage, file=sys.stderr, leave=False,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}")
        self.bar.n = int(round(100 * min(max(fraction, 0.0), 1.0)))
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@dataclass
class ReplyStats:
    """Totals over one reply, for --json and the status line."""

    new_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # verify steps after the prefill
    drafted: int = 0  # tokens those steps emitted before stop cuts
    text: str = ""
    step_times: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"text": self.text, "new_tokens": self.new_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_s": round(self.tokens_per_s, 3), "mean_accepted": round(self.mean_accepted, 4),
                "steps": self.steps}


def stream_reply(session: ChatSession, text: str, config: GenerationConfig,
                 on_text: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> ReplyStats:
    """Send one message and collect statistics from the decoder's steps."""
    stats = ReplyStats()
    start = time.perf_counter()
    for piece in session.send(text, config, cancel):
        step = piece.step
        stats.new_tokens += len(step.token_ids)
        if step.accepted and not step.prefill:
            stats.steps += 1
            stats.drafted += step.accepted
            stats.step_times.append(step.forward_s)
        if piece.text and on_text:
            on_text(piece.text)
        stats.text += piece.text
    stats.seconds = time.perf_counter() - start
    return stats


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default', a .gguf file or a Hugging Face model folder")
    p.add_argument("--heads", default="auto", help="'auto' (shipped heads), 'none', 'random', or a heads folder/file")
    p.add_argument("--tree", default="auto",
                   help="'auto' (the planner's choice), or force a tree name (medusa-64, 1-10-16-17, "
                        "calibrated-N, …) or a JSON file")
    p.add_argument("--no-spec", action="store_true", help="plain greedy/sampled decoding, no speculation")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps (default: the best one found)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--context", type=int, default=4096, help="KV cache size in tokens")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="static-shape decoding replayed as CUDA graphs (default: on for CUDA, off for CPU)")


def _planned(args: argparse.Namespace):
    """The engine with the planner's tree, through the one plan entry (``planning.entry``)."""
    from specmemo_core.planning.entry import PlanChoices, find_device, load_planned
    from specmemo_core.storage.sources import data_dir

    choices = PlanChoices(reply_tokens=args.max_new_tokens, temperature=args.temperature,
                          precision=args.dtype, speculate=not args.no_spec,
                          tree=None if args.tree in (None, "auto") else args.tree)
    progress = StageProgress()
    try:
        return load_planned(args.model, heads=args.heads, choices=choices, device=find_device(args.device),
                            data_folder=data_dir(), progress=progress)
    finally:
        progress.close()


def _generation_config(args: argparse.Namespace) -> GenerationConfig:
    """Checked before the model loads, so a typo costs no loading time."""
    if args.context < 2:
        raise SpecMemoError(f"--context must be at least 2 tokens, got {args.context}")
    if args.max_new_tokens >= args.context:
        raise SpecMemoError(f"--max-new-tokens {args.max_new_tokens} cannot fit a context of {args.context} "
                            f"tokens (the prompt needs room too); ask for fewer, or raise --context")
    return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)


def cmd_generate(args: argparse.Namespace) -> int:
    config = _generation_config(args)
    planned = _planned(args)
    session = planned.new_session(capacity=args.context, system_prompt=args.system, graphs=args.graphs)
    echo = None if args.json else (lambda s: print(s, end="", flush=True))
    stats = stream_reply(session, args.prompt, config, echo)
    if args.json:
        print(json.dumps(stats.as_dict() | {"tree": planned.tree, "precision": planned.engine.precision,
                                            "threads": torch.get_num_threads()}))
    else:
        print(f"\n[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, "
              f"{stats.mean_accepted:.2f} tokens/step]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    config = _generation_config(args)
    planned = _planned(args)
    session = planned.new_session(capacity=args.context, system_prompt=args.system, graphs=args.graphs)
    mode = f"speculative, tree {planned.tree}" if planned.tree else "plain decoding"
    print(f"SpecMemo chat — {planned.engine.identity.name} ({mode}). Empty line or Ctrl-D quits; Ctrl-C stops a reply.",
          file=sys.stderr)
    while True:
        try:
            text = input("\nyou> ")
        except EOFError:
            break
        if not text.strip():
            break
        print("bot> ", end="", flush=True)
        cancel = threading.Event()
        try:
            stats = stream_reply(session, text, config, lambda s: print(s, end="", flush=True), cancel)
        except KeyboardInterrupt:
            cancel.set()
            print("\n[stopped]", file=sys.stderr)
            continue
        except SpecMemoError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            continue
        print(f"\n[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, "
              f"{stats.mean_accepted:.2f} tokens/step]", file=sys.stderr)
    return 0


def _device_default() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_train_heads(args: argparse.Namespace) -> int:
    from specmemo_core.tools.train.pipeline import PipelineConfig, run_training
    from specmemo_core.tools.train.trainer import TrainConfig

    cfg = PipelineConfig(
        model=args.model, kind=args.kind, num_heads=args.heads, num_layers=args.layers,
        context=args.context_layer, train_prompts=args.prompts, turns=args.turns, draft_vocab=args.draft_vocab,
        heldout_prompts=args.heldout_prompts, max_new_tokens=args.reply_tokens,
        gen_batch=args.gen_batch, prompts_file=args.prompts_file, heldout_file=args.heldout_file,
        train=TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed),
    )
    progress = StageProgress()
    try:
        card = run_training(cfg, Path(args.out), args.device, progress, log=lambda m: print(m, file=sys.stderr))
    finally:
        progress.close()
    print(json.dumps(card, indent=1))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from specmemo_core.tools.train.pipeline import PipelineConfig, calibrate_folder

    cfg = PipelineConfig(model=args.model, heldout_prompts=args.heldout_prompts, heldout_file=args.heldout_file,
                         max_new_tokens=args.reply_tokens, gen_batch=args.gen_batch)
    progress = StageProgress()
    try:
        record = calibrate_folder(Path(args.heads), cfg, args.device, progress)
    finally:
        progress.close()
    print(json.dumps({"topk_accuracy": record["topk_accuracy"], "expected_accepted": record["expected_accepted"]}, indent=1))
    return 0


def cmd_eval_acceptance(args: argparse.Namespace) -> int:
    from specmemo_core.storage.datasets import first_queries, load_prompt_file, mtbench_conversations
    from specmemo_core.runtime.engine import Engine, resolve_tree
    from specmemo_core.tools.evaluate import eval_acceptance

    progress = StageProgress()
    try:
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
        report = eval_acceptance(engine.model, engine.tokenizer, engine.config, picked, engine.heads, trees,
                                 args.max_new_tokens, progress)
    finally:
        progress.close()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{'tree':<16}{'nodes':>6}{'accepted/step':>15}{'tok/s':>9}{'vs plain':>10}{'identical':>11}")
        for name, r in report.items():
            print(f"{name:<16}{r['tree_nodes']:>6}{r['mean_accepted']:>15.3f}{r['tokens_per_s']:>9.1f}"
                  f"{r['speedup_vs_plain']:>9.2f}x{r['identical_turns']:>7}/{r['turns']}")
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    from specmemo_core.planning.device import probe

    report = probe()
    if args.json:
        print(json.dumps(report.as_dict()))
        return 0
    gib = 2**30
    print(f"{'kind':<6}{'name':<36}{'free / total GiB':>18}  {'driver':<18}note")
    for d in report.devices:
        print(f"{d.kind:<6}{d.name[:35]:<36}{d.free_bytes / gib:>8.1f} / {d.total_bytes / gib:<7.1f}"
              f"  {d.driver[:18]:<18}{d.note}")
    for note in report.notes:
        print(f"note: {note}")
    return 0


def _prefer(text: str) -> float:
    named = {"turns": 0.0, "speed": 1.0, "balanced": 0.5}
    if text in named:
        return named[text]
    try:
        value = float(text)
    except ValueError:
        raise SpecMemoError(f"--prefer takes turns, speed or a number from 0 to 1, not {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise SpecMemoError(f"--prefer takes turns, speed or a number from 0 to 1, not {text!r}")
    return value


def _verify_plan(args: argparse.Namespace, result, request, budget, shape, engine):
    """Run the plan on the device with synthetic text. ``--vram SIZE`` on a CUDA GPU caps
    this process at SIZE first, so the run proves the plan fits a GPU of that size."""
    from specmemo_core.runtime.engine import resolve_tree
    from specmemo_core.planning.plan_check import cap_device, random_model, verify

    device = "cuda" if budget.kind == "cuda" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecMemoError("--verify on a CUDA plan needs a CUDA GPU and a CUDA build of torch")
    if device == "cuda" and args.vram != "auto":
        cap_device(device, budget.total_bytes)
    if args.model.startswith("shape:"):  # random weights of that shape, random hydra heads
        from specmemo_core.runtime.heads import random_heads

        model = random_model(shape, result.precision, device)
        heads = (random_heads(4, shape.hidden_size, shape.vocab_size, kind="hydra").to(device=device, dtype=model.dtype)
                 if result.tree else None)
    elif engine is None:  # CPU: the planning engine was packed for fp32 inference; load the plan's own
        from specmemo_core.runtime.engine import Engine

        dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(result.precision, torch.bfloat16)
        engine = Engine.load(args.model, heads="auto", tree=None, dtype=dtype, device="cpu",
                             precision=result.precision)
        model = engine.model
        heads = engine.heads if result.tree else None
    else:
        from specmemo_core.runtime.quantize import QuantSpec, quantize_model

        model = engine.model.to(device)
        if result.precision in ("int8", "int4"):  # weight-only: activations in bf16, as planned
            quantize_model(model, QuantSpec("bf16"))
        quantize_model(model, QuantSpec(result.precision))
        heads = engine.heads.to(device=device, dtype=model.dtype) if (engine.heads and result.tree) else None
    tree = resolve_tree(result.tree, engine.heads_folder if engine is not None else None) if result.tree else None
    return verify(result, model, heads, tree, request.prompt_tokens, request.reply_tokens, request.turns)


def _tree_option(name: str, options, record, heads_folder):
    """``--tree``: plan with this tree only (its acceptance from the calibration, else the prior)."""
    from specmemo_core.runtime.engine import resolve_tree
    from specmemo_core.planning.planner import TreeOption, prior_expected_accepted

    for option in options:
        if option.name == name:
            return option
    tree = resolve_tree(name, heads_folder)
    if record is not None:
        from specmemo_core.tools.train.calibrate import expected_accepted

        accepted = expected_accepted(tree, {tuple(p): r for p, r in record["paths"]})
    else:
        accepted = prior_expected_accepted(tree)
    return TreeOption(name, tree.num_nodes, tree.depth, accepted, tree.widest_drafting_level)


def cmd_plan(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from specmemo_core.planning.device import parse_size, probe
    from specmemo_core.planning.memory import HeadsShape, ModelShape, known_shape
    from specmemo_core.planning.planner import Budget, PlanRequest, plan, specmemo_prior_options, tree_options

    request = PlanRequest(turns=args.turns, prefer=_prefer(args.prefer), precision=args.precision,
                          prompt_tokens=args.prompt_tokens, reply_tokens=args.reply_tokens)
    best = probe().best()
    kind = args.device or ("cuda" if args.vram != "auto" and best.kind == "cpu" else best.kind)
    if args.vram == "auto":
        budget = Budget(best.kind, best.total_bytes, best.free_bytes, best.name)
    else:
        size = parse_size(args.vram)
        budget = Budget(kind, size, size, f"{args.vram} {kind}")
    engine = None
    record = None
    folder = None
    if args.model.startswith("shape:"):
        shape, heads, trees = known_shape(args.model[6:]), HeadsShape("hydra", 4, 1), specmemo_prior_options()
    else:
        from specmemo_core.runtime.engine import Engine
        from specmemo_core.tools.train.calibrate import load_calibration

        on = "cuda" if budget.kind == "cuda" and torch.cuda.is_available() else "cpu"
        engine = Engine.load(args.model, heads="auto", tree=None, device=on, progress=StageProgress())
        shape = ModelShape.from_spec(engine.model.spec, engine.identity.name)
        heads = HeadsShape.from_spec(engine.heads.spec) if engine.heads is not None else None
        folder = engine.heads_folder
        record = load_calibration(folder) if folder else None
        trees = tree_options(record)
    if request.system_tokens + request.tokens_per_turn > shape.max_context:  # else it "fits" with 0 turns
        raise SpecMemoError(f"one turn of {request.tokens_per_turn} tokens (prompt {request.prompt_tokens}, reply "
                            f"{request.reply_tokens}) does not fit the {shape.max_context}-token context of "
                            f"{shape.name}; ask for fewer --prompt-tokens/--reply-tokens")
    if args.tree:
        trees = [_tree_option(args.tree, trees, record, folder)]
    step_time = None
    if engine is not None and budget.kind == best.kind:  # the cached timing (measured once, with a progress bar)
        from specmemo_core.planning.timing import timing_for
        from specmemo_core.storage.sources import data_dir

        step_time = timing_for(engine, best.name, data_dir(), None, StageProgress()).step_time()
    # --tree is the user's choice: use it when it fits, even where the timing says plain is faster
    result = plan(budget, shape, heads, request, trees, None if args.tree else step_time)
    out = asdict(result)
    if args.verify and result.fits:
        if budget.kind != "cuda":
            engine = None  # freed before the CPU check loads the plan's own model (see _verify_plan)
        check = _verify_plan(args, result, request, budget, shape, engine)
        out.update(predicted_bytes_total=check.predicted_bytes, measured_peak_bytes=check.measured_peak_bytes,
                   measured_terms=check.measured_terms, fits=result.fits and check.fits,
                   turns_run=check.turns_run, context_resets=check.context_resets)
    if args.json:
        print(json.dumps(out))
        return 0 if result.fits else 3
    gib = lambda n: f"{n / 2**30:8.3f} GiB"  # noqa: E731
    print(f"device   {budget.kind} {budget.name}: {gib(budget.free_bytes)} free, {gib(result.budget_bytes)} usable")
    print(f"model    {shape.name}   turns wanted {request.turns} x {request.tokens_per_turn} tokens")
    if not result.fits:
        print("does not fit. What would:")
        for s in result.suggestions:
            print(f"  - {s}")
        return 3
    print(f"plan     precision {result.precision}, tree {result.tree or 'none (plain decoding)'} "
          f"({result.tree_nodes} nodes, {result.heads_used} heads), KV cache {result.kv_tokens} tokens "
          f"= {result.turns} turns")
    if result.predicted_tokens_per_s:
        print(f"speed    {result.predicted_tokens_per_s:.1f} tokens/s predicted")
    for term, n in result.predicted_bytes.items():
        print(f"  {term:<14}{gib(n)}")
    print(f"  {'total':<14}{gib(result.total_bytes)}")
    for note in result.notes:
        print(f"note: {note}")
    if args.verify:
        print(f"verify   predicted {gib(out['predicted_bytes_total'])}, measured peak {gib(out['measured_peak_bytes'])}")
        for term, n in out["measured_terms"].items():
            print(f"  measured {term:<10}{gib(n)}  (predicted {gib(result.predicted_bytes[term])})")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from specmemo_core.tools.bench import ALL_METHODS, HF_METHODS, build_methods, format_table, plot_report, report, run_bench, run_info
    from specmemo_core.storage.datasets import first_queries, load_prompt_file, mtbench_conversations
    from specmemo_core.runtime.engine import Engine

    names = [m.strip() for m in (args.methods or ",".join(ALL_METHODS)).split(",") if m.strip()]
    if not names or len(set(names)) != len(names):
        raise SpecMemoError(f"--methods needs distinct names, e.g. {','.join(ALL_METHODS)}; got {args.methods!r}")
    if not 1 <= args.max_new_tokens < 4096 or not 1 <= args.repeats <= 100:
        raise SpecMemoError("--max-new-tokens must be 1…4095 and --repeats 1…100")
    if args.plot and not args.plot.lower().endswith(".png"):  # refused now, not after the run
        raise SpecMemoError(f"--plot needs a .png file name, got {args.plot!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    convs = (first_queries(load_prompt_file(args.prompts), args.queries) if args.prompts
             else mtbench_conversations(args.queries))
    dtype = DTYPES[args.dtype]
    progress = StageProgress()
    try:
        engine = Engine.load(args.model, heads=args.heads, tree=None, dtype=dtype, device=args.device,
                             progress=progress)
        hf = None
        if any(n in HF_METHODS for n in names):
            from specmemo_core.storage.sources import load_model
            from specmemo_core.tools.train.pipeline import hf_model_from

            hf = hf_model_from(load_model(args.model), args.device, dtype)
        methods = build_methods(names, engine, hf, engine.heads_folder, convs, args.max_new_tokens, args.dtype)

        def full_report(passes: dict) -> dict:
            result = report(methods, passes)
            result["_run"] = run_info(engine.identity.name, args.device, args.dtype, convs, args.max_new_tokens,
                                      args.repeats, names) | {"rounds_done": len(next(iter(passes.values())))}
            return result

        def save(passes: dict) -> None:  # after every round: a run cut short keeps what it measured
            tmp = Path(args.save).with_suffix(".tmp")
            tmp.write_text(json.dumps(full_report(passes), indent=1), encoding="utf-8")
            tmp.replace(args.save)

        passes = run_bench(methods, args.repeats, device=args.device, progress=progress,
                           on_round=save if args.save else None)
    finally:
        progress.close()
    result = full_report(passes)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
    if args.plot:
        print(f"chart: {plot_report(result, args.plot)}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmemo", description="Local chat with memory-aware speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="multi-turn chat in the terminal")
    _add_model_args(chat)
    chat.set_defaults(func=cmd_chat)
    gen = sub.add_parser("generate", help="one reply to one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--json", action="store_true", help="print one JSON object with the reply and its speed")
    _add_model_args(gen)
    gen.set_defaults(func=cmd_generate)

    train = sub.add_parser("train-heads", help="train draft heads for a model by self-distillation")
    train.add_argument("--model", default="default")
    train.add_argument("--out", required=True, help="output folder (re-running resumes)")
    train.add_argument("--kind", choices=["medusa", "hydra"], default="hydra")
    train.add_argument("--heads", type=int, default=4)
    train.add_argument("--layers", type=int, default=1)
    train.add_argument("--context-layer", action="store_true",
                       help="hydra heads read the base states through one attention layer of their own")
    train.add_argument("--steps", type=int, default=4000)
    train.add_argument("--batch-size", type=int, default=2048)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--prompts", type=int, default=4000, help="training conversations (ShareGPT train split)")
    train.add_argument("--turns", type=int, default=1,
                       help="user turns answered per conversation (2: also learn from second turns, as in a chat)")
    train.add_argument("--draft-vocab", type=int, default=8192,
                       help="hydra: draft among this many most frequent reply tokens (0: the whole vocabulary)")
    train.add_argument("--prompts-file", default=None, help="JSONL prompts instead of ShareGPT")
    train.add_argument("--heldout-prompts", type=int, default=300)
    train.add_argument("--heldout-file", default=None)
    train.add_argument("--reply-tokens", type=int, default=256)
    train.add_argument("--gen-batch", type=int, default=256)
    train.add_argument("--device", default=_device_default())
    train.set_defaults(func=cmd_train_heads)

    cal = sub.add_parser("calibrate", help="measure heads' accuracy and tree-path acceptance on held-out prompts")
    cal.add_argument("--heads", required=True)
    cal.add_argument("--model", default="default")
    cal.add_argument("--heldout-prompts", type=int, default=300)
    cal.add_argument("--heldout-file", default=None)
    cal.add_argument("--reply-tokens", type=int, default=256)
    cal.add_argument("--gen-batch", type=int, default=256)
    cal.add_argument("--device", default=_device_default())
    cal.set_defaults(func=cmd_calibrate)

    ev = sub.add_parser("eval-acceptance", help="accepted tokens per step and speed per tree, vs plain greedy")
    ev.add_argument("--model", default="default")
    ev.add_argument("--heads", default="auto")
    ev.add_argument("--prompts", default=None, help="JSONL with a 'turns' list per line (default: MT-Bench)")
    ev.add_argument("--queries", type=int, default=20)
    ev.add_argument("--tree", action="append", help="tree to evaluate (repeatable); default: medusa-64, "
                                                    "1-10-16-17, calibrated-64 and calibrated-56+lookup-8")
    ev.add_argument("--max-new-tokens", type=int, default=128)
    ev.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ev.add_argument("--device", default=_device_default())
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval_acceptance)

    pl = sub.add_parser("plan", help="fit the chat to the device: precision, tree, KV cache; before loading")
    pl.add_argument("--model", default="default", help="'default', a model path, or shape:NAME (e.g. shape:vicuna-7b)")
    pl.add_argument("--vram", default="auto", help="'auto' (probe the device) or a size such as 8GB")
    pl.add_argument("--device", choices=["cpu", "cuda", "rocm", "mps"], default=None)
    pl.add_argument("--turns", type=int, default=20)
    pl.add_argument("--prefer", default="balanced", help="turns, speed, balanced or 0..1")
    pl.add_argument("--precision", choices=["fp32", "bf16", "fp16", "int8", "int4"], default=None)
    pl.add_argument("--prompt-tokens", type=int, default=200)
    pl.add_argument("--reply-tokens", type=int, default=256)
    pl.add_argument("--tree", default=None, help="plan with this tree only (e.g. medusa-64, 1-10-16-17)")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--verify", action="store_true", help="run the plan with synthetic text and measure memory")
    pl.set_defaults(func=cmd_plan)

    dev = sub.add_parser("devices", help="list GPUs and the CPU with the memory free for the model")
    dev.add_argument("--json", action="store_true", help="print one JSON object with devices and notes")
    dev.set_defaults(func=cmd_devices)

    bench = sub.add_parser("bench", help="tokens/s of transformers' generate and our decoders, side by side")
    bench.add_argument("--model", default="default")
    bench.add_argument("--heads", default="auto", help="'auto' (shipped heads), 'random', or a heads folder/file")
    bench.add_argument("--prompts", default=None, help="JSONL with a 'turns' list per line (default: MT-Bench)")
    bench.add_argument("--queries", type=int, default=20, help="the first N user turns (default 20)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=3, help="timed rounds after one untimed warm-up round")
    bench.add_argument("--methods", default=None,
                       help="comma list of hf, hf-pld, vanilla, plan and tree names (default: all of "
                            "hf,hf-pld,vanilla,medusa-64,1-10-16-17,plan)")
    bench.add_argument("--device", default=_device_default())
    bench.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    bench.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    bench.add_argument("--json", action="store_true", help="print one JSON object keyed by method")
    bench.add_argument("--save", default=None, metavar="FILE",
                       help="also write the JSON report to FILE after every timed round (a run cut short "
                            "keeps its finished rounds; _run.rounds_done says how many)")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw tokens/s per method (median, min–max) as a PNG bar chart")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecMemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
