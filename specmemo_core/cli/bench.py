"""``specmemo bench``: tokens/s of transformers' generate and our decoders, side by side."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from specmemo_core.cli.common import (StageProgress, add_devices_arg, add_threads_arg, device_default,
                                      parse_devices)
from specmemo_core.errors import SpecMemoError, SplitError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="tokens/s of transformers' generate and our decoders, side by side")
    p.add_argument("--model", default="default")
    p.add_argument("--heads", default="auto", help="'auto' (shipped heads), 'random', or a heads folder/file")
    p.add_argument("--prompts", default=None, help="JSONL with a 'turns' list per line (default: MT-Bench)")
    p.add_argument("--queries", type=int, default=20, help="the first N user turns (default 20)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the untimed warm-up rounds")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed rounds first (default 1; 0 when time is short: the median of 3 repeats then "
                        "absorbs the first round's warm-up)")
    p.add_argument("--methods", default=None,
                   help="comma list of hf, hf-pld, vanilla, plan, llamacpp and tree names (default: all of "
                        "hf,hf-pld,vanilla,medusa-64,1-10-16-17,plan, and on a CPU llamacpp: llama.cpp on the same "
                        "GGUF, skipped with a line where llama-cpp-python is not installed); a name of ours "
                        "+graphs: on the static-shape decoder (CUDA graphs on a GPU); then +compiled: its decoder "
                        "layers through torch.compile (e.g. vanilla+graphs+compiled); then +serial: each step "
                        "starts only once the last is read (steps overlap by default on a GPU)")
    p.add_argument("--cap-gib", default=None, metavar="GIB",
                   help="offload methods (accelerate-offload, stream-plain, stream-tree, stream-random-heads): plan "
                        "for a GPU of GIB and cap this process's GPU memory to it (as plan --verify does); 'half': "
                        "the largest cap at which at most half the decoder layers stay on the GPU. CUDA only")
    p.add_argument("--resident-layers", type=int, default=None, metavar="N",
                   help="offload methods without a plan: keep N decoder layers on the device (a CPU smoke test)")
    p.add_argument("--offload-tree", default=None, help="the stream-tree methods' tree (default: the plan's)")
    p.add_argument("--device", default=device_default())
    add_devices_arg(p)  # bench: our decoders on the model split evenly over those GPUs
    p.add_argument("--dtype", "--precision", dest="dtype", choices=["auto", "fp32", "bf16", "int8", "int4"],
                   default="auto",
                   help="our methods' precision: 'auto' (default) the planner's, as in the app and chat (int4 for a "
                        "4-bit GGUF on a CPU, bf16 on a GPU), or force one; transformers' methods run int8/int4 "
                        "as the float dtype around them")
    p.add_argument("--backend", choices=["auto", "torch", "native", "llamacpp"], default="auto",
                   help="what runs our methods' forward: 'auto' (default) as the app chooses (for a 4-bit GGUF "
                        "on a CPU our C forward, 'native', else llama.cpp where installed; elsewhere ours in "
                        "torch), or force one")
    add_threads_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by method")
    p.add_argument("--save", default=None, metavar="FILE",
                   help="also write the JSON report to FILE after every timed round (a run cut short "
                        "keeps its finished rounds; _run.rounds_done says how many)")
    p.add_argument("--batch-tree", default=None, metavar="TREE",
                   help="with --batch: speculate on this tree at every batch size instead of the planner's")
    p.add_argument("--batch", default=None, metavar="B,B,…",
                   help="batched decoding instead of --methods: the queries as concurrent requests through "
                        "batch decoders of these sizes (e.g. 1,2,4,8,16), batched plain and batched speculation "
                        "on the planner's tree for each size; total tokens/s")
    p.add_argument("--batch-requests", choices=["conversations", "turns"], default="conversations",
                   help="with --batch: 'conversations' (default): each conversation a client sending its turns in "
                        "order, each with the conversation so far, as a chat client does; 'turns': every user turn "
                        "a request alone")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw tokens/s per method (median, min–max) as a PNG bar chart")
    p.set_defaults(run=run)


def _method_names(args: argparse.Namespace) -> tuple[list[str], list[dict[str, str]]]:
    """The checks made before anything loads, so a typo costs no loading time."""
    from specmemo_core.tools.bench import ALL_METHODS
    from specmemo_core.tools.bench_llamacpp import LLAMACPP

    default = ALL_METHODS + ((LLAMACPP,) if torch.device(args.device).type == "cpu" else ())
    names = [m.strip() for m in (args.methods or ",".join(default)).split(",") if m.strip()]
    if not names or len(set(names)) != len(names):
        raise SpecMemoError(f"--methods needs distinct names, e.g. {','.join(ALL_METHODS)}; got {args.methods!r}")
    if not 1 <= args.max_new_tokens < 4096 or not 1 <= args.repeats <= 100 or not 0 <= args.warmup <= 10:
        raise SpecMemoError("--max-new-tokens must be 1…4095, --repeats 1…100 and --warmup 0…10")
    if args.plot and not args.plot.lower().endswith(".png"):  # refused now, not after the run
        raise SpecMemoError(f"--plot needs a .png file name, got {args.plot!r}")
    _check_offload_names(args, names)
    if len(parse_devices(args.devices)) > 1 and set(names) - {"vanilla", "plan"} - set(_tree_names(names)):
        raise SplitError("with --devices only our decoders run split (vanilla, plan and tree names); bench "
                         "transformers' and the offload methods on one --device")
    return _without_unavailable(names, args)  # last: it may start llama.cpp once to see that it runs


def _without_unavailable(names: list[str], args: argparse.Namespace) -> tuple[list[str], list[dict[str, str]]]:
    """``names`` less the llamacpp method where it cannot run (not installed, not on a CPU,
    or its build crashes here), said in one line on stderr, and what was left out (the
    report's ``_run.skipped``)."""
    from specmemo_core.tools.bench_llamacpp import LLAMACPP, crash_reason, gguf_path, missing_reason

    if LLAMACPP not in names:
        return names, []
    reason = missing_reason()
    if reason is None and torch.device(args.device).type != "cpu":
        reason = "llamacpp skipped: it runs on the CPU here; bench it with --device cpu"
    if reason is None:
        reason = crash_reason(gguf_path(args.model), torch.get_num_threads())
    if reason is None:
        return names, []
    print(reason, file=sys.stderr)
    left = [n for n in names if n != LLAMACPP]
    if not left:
        raise SpecMemoError(reason)
    return left, [{"method": LLAMACPP, "reason": reason}]


def _tree_names(names: list[str]) -> list[str]:
    from specmemo_core.tools.bench import HF_METHODS
    from specmemo_core.tools.bench_offload import OFFLOAD_METHODS

    return [n for n in names if n not in HF_METHODS and n not in OFFLOAD_METHODS
            and n not in ("vanilla", "plan", "llamacpp")]


def _load_engine(args: argparse.Namespace, progress: StageProgress):
    """Our engine for the bench: on ``--device``, or split evenly over the GPUs ``--devices`` names."""
    from specmemo_core.runtime.engine import Engine

    numbers = parse_devices(args.devices)
    if len(numbers) < 2:
        return Engine.load(args.model, heads=args.heads, tree=None, dtype=_dtype(args), device=args.device,
                           progress=progress, precision=args.dtype, backend=args.backend)
    from specmemo_core.runtime.split import LayerSplit
    from specmemo_core.storage.sources import load_model

    loaded = load_model(args.model, progress=progress)
    split = LayerSplit.even([f"cuda:{n}" for n in numbers], loaded.config.num_hidden_layers)
    return Engine.load(loaded, heads=args.heads, tree=None, dtype=_dtype(args), progress=progress, split=split,
                       precision=args.dtype)


def _check_offload_names(args: argparse.Namespace, names: list[str]) -> None:
    """Offload methods run alone (the model is streamed for all of them), with a valid cap."""
    from specmemo_core.errors import OffloadError
    from specmemo_core.tools.bench_offload import OFFLOAD_METHODS

    offload = [n for n in names if n in OFFLOAD_METHODS]
    if offload and len(offload) != len(names):
        raise OffloadError(f"offload methods ({', '.join(OFFLOAD_METHODS)}) run apart from the others (the model "
                           f"streams for all of them); bench {', '.join(sorted(set(names) - set(offload)))} "
                           "in another run")
    if args.cap_gib not in (None, "half"):
        try:
            ok = float(args.cap_gib) > 0
        except ValueError:
            ok = False
        if not ok:
            raise OffloadError(f"--cap-gib takes a size in GiB (e.g. 1.5) or 'half', got {args.cap_gib!r}")
    if args.cap_gib is not None and (torch.device(args.device).type != "cuda" or not torch.cuda.is_available()):
        raise OffloadError("--cap-gib caps a CUDA GPU's memory and plans for its host link; there is none on "
                           f"{args.device!r}. On CPU run the offload methods as a smoke test with "
                           "--resident-layers N")


def _conversations(args: argparse.Namespace) -> list:
    from specmemo_core.storage.datasets import first_queries, load_prompt_file, mtbench_conversations

    return (first_queries(load_prompt_file(args.prompts), args.queries) if args.prompts
            else mtbench_conversations(args.queries))


def _offload_setup(args: argparse.Namespace, loaded):
    """The offload methods' layout: planned for ``--cap-gib`` on a CUDA GPU (and this
    process capped), or forced by ``--resident-layers`` (a smoke test, any device)."""
    from specmemo_core.errors import OffloadError
    from specmemo_core.tools import bench_offload

    if args.cap_gib is not None:
        from specmemo_core.planning.entry import find_device, inputs_before_load
        from specmemo_core.planning.host import host_link_for
        from specmemo_core.planning.plan_check import cap_device
        from specmemo_core.storage.data_folder import data_dir

        device = find_device(args.device)
        inputs = inputs_before_load(loaded, args.heads, device, link=host_link_for(device, data_dir()))
        choices = bench_offload.bench_choices(max_new_tokens=args.max_new_tokens, precision=args.dtype)
        setup, _ = bench_offload.plan_setup(inputs, choices, args.cap_gib)
        cap_device(args.device, setup.process_cap_bytes)
    elif args.resident_layers is not None:
        setup = bench_offload.forced_setup(loaded.config.num_hidden_layers, args.resident_layers, args.offload_tree)
    else:
        raise OffloadError("the offload methods need --cap-gib GIB (or 'half') on a CUDA GPU, or --resident-layers "
                           "N for a smoke test on any device")
    return replace(setup, tree=args.offload_tree) if args.offload_tree else setup


def _measure_offload(args: argparse.Namespace, names: list[str], progress: StageProgress):
    """(methods, engine, the ``_offload`` setup) of a bench of the offload methods alone."""
    from specmemo_core.runtime.engine import Engine
    from specmemo_core.storage.sources import load_model
    from specmemo_core.tools import bench_offload

    convs = _conversations(args)
    loaded = load_model(args.model, progress=progress)
    setup = _offload_setup(args, loaded)
    dtype = _dtype(args)
    engine = Engine.load(loaded, heads=args.heads, tree=None, dtype=dtype, device=args.device, progress=progress,
                         precision=args.dtype, resident_layers=setup.resident_layers)
    hf = (bench_offload.accelerate_model(loaded, args.device, dtype, setup.accelerate_gpu_bytes)
          if "accelerate-offload" in names else None)
    methods = bench_offload.build_offload_methods(names, engine=engine, hf=hf, conversations=convs, setup=setup,
                                                  max_new_tokens=args.max_new_tokens, precision=args.dtype)
    return methods, engine, convs, setup


def _measure(args: argparse.Namespace, names: list[str], progress: StageProgress,
             skipped: list[dict[str, str]]) -> dict:
    from specmemo_core.tools.bench import report, run_bench, run_info
    from specmemo_core.tools.bench_offload import OFFLOAD_METHODS, identical_to_stream_plain, offload_summary

    setup = None
    if any(n in OFFLOAD_METHODS for n in names):
        methods, engine, convs, setup = _measure_offload(args, names, progress)
    else:
        methods, engine, convs = _resident_methods(args, names, progress)

    def full_report(passes: dict) -> dict:
        result = report(methods, passes)
        if setup is not None:
            for name, same in identical_to_stream_plain(methods, passes).items():
                result[name]["identical_to_stream_plain"] = same
            result["_offload"] = offload_summary(result, setup)
        result["_run"] = run_info(engine.identity.name, args.device, args.dtype, conversations=convs,
                                  max_new_tokens=args.max_new_tokens, repeats=args.repeats, methods=names,
                                  warmup=args.warmup)
        result["_run"]["rounds_done"] = len(next(iter(passes.values())))
        result["_run"]["skipped"] = skipped
        result["_run"]["backend"] = engine.backend
        return result

    def save(passes: dict) -> None:  # after every round: a run cut short keeps what it measured
        tmp = Path(args.save).with_suffix(".tmp")
        tmp.write_text(json.dumps(full_report(passes), indent=1), encoding="utf-8")
        tmp.replace(args.save)

    passes = run_bench(methods, args.repeats, warmup=args.warmup, device=args.device, progress=progress,
                       on_round=save if args.save else None)
    return full_report(passes)


def _resident_methods(args: argparse.Namespace, names: list[str], progress: StageProgress):
    from specmemo_core.runtime.engine import Engine
    from specmemo_core.storage.data_folder import data_dir
    from specmemo_core.tools.bench import HF_METHODS, build_methods
    from specmemo_core.tools.bench_llamacpp import LLAMACPP, llamacpp_method

    convs = _conversations(args)
    dtype = _dtype(args)
    engine = _load_engine(args, progress)
    hf = None
    if any(n in HF_METHODS for n in names):
        from specmemo_core.storage.sources import load_model
        from specmemo_core.tools.train.pipeline import hf_model_from

        hf = hf_model_from(load_model(args.model), args.device, dtype)
    ours = [n for n in names if n != LLAMACPP]
    methods = build_methods(ours, engine, hf, convs, max_new_tokens=args.max_new_tokens, precision=args.dtype,
                            data_folder=data_dir())  # the plan method reads the device timing the chat cached
    if LLAMACPP in names:  # in its place in the order asked for
        methods.insert(names.index(LLAMACPP), llamacpp_method(args.model, engine, convs,
                                                              max_new_tokens=args.max_new_tokens,
                                                              threads=torch.get_num_threads()))
    return methods, engine, convs


def _measure_batches(args: argparse.Namespace, batches: list[int], progress: StageProgress) -> dict:
    """``--batch``: the queries as concurrent requests (``--batch-requests``), through batch
    decoders of each size."""
    from specmemo_core.runtime.chat import end_of_turn_ids
    from specmemo_core.runtime.decoding import GenerationConfig
    from specmemo_core.runtime.engine import resolve_tree
    from specmemo_core.storage.data_folder import data_dir
    from specmemo_core.storage.datasets import first_queries, load_prompt_file, mtbench_conversations
    from specmemo_core.tools.batch_bench import Requests, run_batch_bench
    from specmemo_core.tools.bench import planner_choice, run_info

    convs = (first_queries(load_prompt_file(args.prompts), args.queries) if args.prompts
             else mtbench_conversations(args.queries))
    engine = _load_engine(args, progress)
    requests = Requests.of_conversations(engine.tokenizer, convs, history=args.batch_requests == "conversations",
                                         max_new_tokens=args.max_new_tokens)
    trees = {}

    def tree_for(b: int):
        if args.batch_tree:  # the user's tree at every size
            trees[b] = args.batch_tree
            return resolve_tree(args.batch_tree, engine.heads_folder)
        chosen = planner_choice(engine, args.dtype, args.max_new_tokens, data_folder=data_dir(), batch=b)
        trees[b] = chosen.tree
        return resolve_tree(chosen.tree, engine.heads_folder) if chosen.tree else None

    config = GenerationConfig(max_new_tokens=args.max_new_tokens,
                              stop_token_ids=frozenset(end_of_turn_ids(engine.tokenizer, engine.config)))
    result = run_batch_bench(engine.model, engine.heads, requests, batches=batches, tree_for=tree_for, config=config,
                             repeats=args.repeats, device=args.device,
                             graphs=engine.model.device.type == "cuda" and engine.model.capturable,
                             progress=progress)
    result["_run"] = run_info(engine.identity.name, args.device, args.dtype, conversations=convs,
                              max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                              methods=["plain", "speculative"])
    result["_run"].update(batches=batches, planner_trees={str(b): t for b, t in trees.items()},
                          requests=sum(requests.turns), clients=len(requests.turns),
                          batch_requests=args.batch_requests)
    return result


def _dtype(args: argparse.Namespace) -> torch.dtype:
    """The float dtype our model (and transformers') loads in for ``--dtype``."""
    from specmemo_core.planning.entry import torch_dtype

    return torch_dtype(args.dtype, torch.device(args.device).type)


def _choose_as_the_app(args: argparse.Namespace) -> None:
    """``--dtype auto`` / ``--backend auto``: the precision the planner gives this model on
    ``--device`` (from the file's header, before loading) and the backend for it, as the app
    and chat would load it."""
    from dataclasses import replace

    from specmemo_core.planning.entry import PlanChoices, backend_for, find_device, inputs_before_load, make_plan
    from specmemo_core.storage.sources import open_model

    device, source = find_device(args.device), open_model(args.model)
    precision = None if args.dtype == "auto" else args.dtype
    planned = make_plan(inputs_before_load(source, args.heads, device, link=None),
                        PlanChoices(reply_tokens=args.max_new_tokens, precision=precision))
    if args.dtype == "auto":
        args.dtype = planned.precision if planned.fits else ("fp32" if device.kind == "cpu" else "bf16")
    if args.backend == "auto":
        args.backend = backend_for(source, device, replace(planned, precision=args.dtype)) \
            if args.batch is None and len(parse_devices(args.devices)) < 2 else "torch"


def run(args: argparse.Namespace) -> int:
    from specmemo_core.tools.bench import format_table, plot_report

    if args.batch is not None:
        return _run_batches(args)
    names, skipped = _method_names(args)  # refused before anything is opened
    _choose_as_the_app(args)
    with StageProgress() as progress:
        result = _measure(args, names, progress, skipped)
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
    parse_devices(args.devices)
    if not 1 <= args.max_new_tokens < 4096 or not 1 <= args.repeats <= 100:
        raise SpecMemoError("--max-new-tokens must be 1…4095 and --repeats 1…100")
    _choose_as_the_app(args)
    with StageProgress() as progress:
        result = _measure_batches(args, batches, progress)
    if args.save:
        Path(args.save).write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps(result) if args.json else format_batch_table(result))
    return 0
