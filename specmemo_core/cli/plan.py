"""``specmemo plan``: fit the chat to the device (precision, tree, KV cache) before loading it."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, replace

import torch

from specmemo_core.cli.common import StageProgress, add_devices_arg, add_threads_arg, parse_devices
from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.host import ASSUMED_GB_S

_BARE_NUMBER = re.compile(r"\s*\d+(\.\d*)?\s*")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="fit the chat to the device: precision, tree, KV cache; before loading")
    p.add_argument("--model", default="default", help="'default', a model path, or shape:NAME (e.g. shape:vicuna-7b)")
    p.add_argument("--vram", default="auto",
                   help="'auto' (probe the device) or the memory to plan for: 8GB (10^9 bytes), 12GiB or "
                        "12G (2^30 bytes); a bare number is GB (8 = 8GB)")
    p.add_argument("--device", choices=["cpu", "cuda", "rocm", "mps"], default=None)
    add_devices_arg(p)  # with --vram: each card's memory
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--prefer", default="balanced", help="turns, speed, balanced or 0..1")
    p.add_argument("--precision", "--dtype", dest="precision", choices=["fp32", "bf16", "fp16", "int8", "int4"],
                   default=None)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--reply-tokens", type=int, default=256)
    p.add_argument("--tree", default=None, help="plan with this tree only (e.g. medusa-64, 1-10-16-17)")
    p.add_argument("--batch", type=int, default=1,
                   help="conversations decoded together (a server's batch slots), each with --turns of KV cache")
    p.add_argument("--ram", default="auto",
                   help="host RAM the plan may page-lock for decoder layers that do not fit the GPU (e.g. 32 or "
                        "32GB); 'auto': the RAM free now; 0: stream no layer")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="host-to-GPU bandwidth in GB/s for plans that stream layers; default: measured on this "
                        f"machine's GPU (cached), or {ASSUMED_GB_S:g} GB/s for a GPU that is not here")
    p.add_argument("--json", action="store_true")
    p.add_argument("--verify", action="store_true", help="run the plan with synthetic text and measure memory")
    add_threads_arg(p)
    p.set_defaults(run=run)


def vram_size(text: str) -> tuple[str, int]:
    """``--vram`` as written with its unit, and in bytes (``parse_size``); a bare number
    means GB (``8`` is 8GB, not 8 bytes)."""
    from specmemo_core.planning.device import parse_size

    written = f"{text.strip()}GB" if _BARE_NUMBER.fullmatch(text) else text
    return written, parse_size(written)


def prefer_weight(text: str) -> float:
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
    this process at SIZE first, so the run proves the plan fits a GPU of that size. A plan
    that streams layers loads with its resident layers (random weights for ``shape:``)."""
    from specmemo_core.planning.plan_check import cap_device, random_model, verify
    from specmemo_core.runtime.engine import resolve_tree

    device = "cuda" if budget.kind == "cuda" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecMemoError("--verify on a CUDA plan needs a CUDA GPU and a CUDA build of torch")
    if device == "cuda" and args.vram != "auto":
        cap_device(device, budget.total_bytes)
    resident = result.resident_layers if result.streamed_layers else None
    if args.model.startswith("shape:"):  # random weights of that shape, random hydra heads
        from specmemo_core.runtime.heads import random_heads

        model = random_model(shape, result.precision, device, resident_layers=resident)
        heads = (random_heads(4, shape.hidden_size, shape.vocab_size, kind="hydra").to(device=device, dtype=model.dtype)
                 if result.tree else None)
    elif engine is None:  # the plan's own model: on CPU (the planning one was packed for fp32) or streamed
        from specmemo_core.planning.entry import torch_dtype
        from specmemo_core.runtime.engine import Engine

        dtype = torch_dtype(result.precision if result.precision in ("fp32", "fp16") else "bf16")
        engine = Engine.load(args.model, heads="auto", tree=None, dtype=dtype, device=device,
                             precision=result.precision, resident_layers=resident)
        model = engine.model
        heads = engine.heads if result.tree else None
    else:
        from specmemo_core.runtime.quantize import QuantSpec, quantize_model

        model = engine.model.to(device)
        if engine.precision != result.precision:  # loaded in fp32 (no --precision): cast as planned
            if result.precision in ("int8", "int4"):  # weight-only: activations in bf16, as planned
                quantize_model(model, QuantSpec("bf16"))
            quantize_model(model, QuantSpec(result.precision))
        heads = engine.heads.to(device=device, dtype=model.dtype) if (engine.heads and result.tree) else None
    tree = resolve_tree(result.tree, engine.heads_folder if engine is not None else None) if result.tree else None
    check = verify(result, model, heads, tree, prompt_tokens=request.prompt_tokens,
                   reply_tokens=request.reply_tokens, turns=request.turns)
    return check, (_stream_check(model, result.precision) if resident is not None else None)


def _verify_split(args: argparse.Namespace, result, request, shape):
    """Run a plan split over several GPUs (``Plan.split``) with synthetic text and measure
    each card. ``--vram SIZE`` caps each card at SIZE first. ``shape:`` models get random
    weights made on each card (random hydra heads on the last); others load split as planned."""
    from specmemo_core.planning.plan_check import cap_device, random_model, verify
    from specmemo_core.runtime.engine import resolve_tree
    from specmemo_core.runtime.split import LayerSplit

    cards = [torch.device(s.device) for s in result.split]
    if not torch.cuda.is_available() or torch.cuda.device_count() <= max(c.index or 0 for c in cards):
        raise SpecMemoError(f"--verify of a plan split over {', '.join(s.device for s in result.split)} needs "
                            "those GPUs here; leave out --verify to see the plan")
    if args.vram != "auto":
        for share in result.split:
            cap_device(share.device, vram_size(args.vram)[1])
    split = LayerSplit.of([s.device for s in result.split], [s.layers for s in result.split])
    folder = None
    if args.model.startswith("shape:"):
        from specmemo_core.runtime.heads import random_heads

        model = random_model(shape, result.precision, split.home, split=split)
        heads = (random_heads(4, shape.hidden_size, shape.vocab_size, kind="hydra").to(device=split.home,
                                                                                       dtype=model.dtype)
                 if result.tree else None)
    else:
        from specmemo_core.planning.entry import torch_dtype
        from specmemo_core.runtime.engine import Engine

        engine = Engine.load(args.model, heads="auto", tree=None, dtype=torch_dtype(result.precision),
                             precision=result.precision, split=split)
        model, heads, folder = engine.model, engine.heads if result.tree else None, engine.heads_folder
    tree = resolve_tree(result.tree, folder) if result.tree else None
    return verify(result, model, heads, tree, prompt_tokens=request.prompt_tokens, reply_tokens=request.reply_tokens,
                  turns=request.turns)


def _stream_check(model, precision: str) -> dict:
    """A streamed model's steps: a 64-node tree's forward against a plain one, and the
    share of the measured host→GPU bandwidth a plain step achieves
    (``tools.offload_probe``: streamed bytes ÷ step time ÷ bandwidth)."""
    from specmemo_core.tools.offload_probe import probe

    found = probe(model, sizes=(1, 64), precision=precision)
    out = asdict(found)
    out["tree64_vs_plain_step"] = round(found.step_s[64] / found.step_s[1], 4)
    return out


def plan_choices(args: argparse.Namespace):
    from specmemo_core.planning.entry import PlanChoices

    return PlanChoices(turns=args.turns, prefer=prefer_weight(args.prefer), prompt_tokens=args.prompt_tokens,
                       reply_tokens=args.reply_tokens, precision=args.precision, tree=args.tree, batch=args.batch)


def _planned_for(args: argparse.Namespace):
    """(the device the model would run on, the one the plan is for: ``--vram`` makes it up)."""

    from specmemo_core.planning.device import DeviceInfo, cpu_device
    from specmemo_core.planning.entry import find_device

    real = find_device(None)
    if args.vram == "auto":
        return real, real
    kind = args.device or ("cuda" if real.kind == "cpu" else real.kind)
    written, size = vram_size(args.vram)
    if real.kind != kind:  # planned for a device that is not here: the model's shape is read on the CPU
        real = cpu_device()
        return real, DeviceInfo(kind, 0, f"{written} {kind}", size, size, "", "cpu")
    return real, replace(real, name=f"{written} {kind}", total_bytes=size, free_bytes=size)


def _shape_inputs(args: argparse.Namespace, target):
    from specmemo_core.planning.entry import PlanInputs, budget_for
    from specmemo_core.planning.memory import HeadsShape, known_shape
    from specmemo_core.planning.planner import specmemo_prior_options

    return PlanInputs(budget_for(target), known_shape(args.model[6:]), HeadsShape("hydra", 4, 1),
                      tuple(specmemo_prior_options()))


def _cards(args: argparse.Namespace, numbers: tuple[int, ...], target) -> tuple:
    """The GPUs ``--devices`` names, as the plan sees them: each card with ``--vram`` of memory
    where given (the cards need not be here), else as probed (``entry.find_devices``); with
    neither ``--devices``, ``--device`` nor ``--vram``, every GPU here."""
    from specmemo_core.planning.entry import budget_for, cards_for, find_devices
    from specmemo_core.planning.split import Card

    if args.vram == "auto" and not numbers and args.device is None:
        return cards_for(find_devices())  # every GPU here (none or one: no cards, one device)
    if len(numbers) < 2:
        return ()
    if args.vram == "auto":
        return cards_for(find_devices(numbers))
    if target.kind == "cpu":
        raise SpecMemoError("--devices splits a model over GPUs; give --device cuda (or rocm) to plan for them")
    return tuple(Card(f"cuda:{n}", budget_for(replace(target, index=n))) for n in numbers)


def _model_inputs(args: argparse.Namespace, real, target, link, cards=()):
    """Read the model into host memory and plan from it; where that plan fits ``target``
    without streaming layers, load it on ``real`` and take the device timing (only where
    the plan is for this kind of device). A plan that streams layers (or fits nowhere) is
    made before anything is placed on a GPU, without timing; so is one split over ``cards``."""
    from specmemo_core.planning.entry import inputs_before_load, make_plan, plan_inputs, torch_dtype
    from specmemo_core.planning.timing import timing_for
    from specmemo_core.runtime.engine import Engine
    from specmemo_core.storage.data_folder import data_dir
    from specmemo_core.storage.sources import open_model

    progress = StageProgress()
    try:
        loaded = open_model(args.model, progress=progress)  # the header: weights are read by Engine.load
        first = inputs_before_load(loaded, "auto", target, link=link, cards=cards)
        planned = make_plan(first, plan_choices(args))
        if (link is not None or cards) and (planned.streamed_layers or planned.split or not planned.fits):
            return first, None
        # loaded and timed at the precision the plan takes (as ``load_planned`` does), so the
        # timing is that precision's: a bf16 plan is not timed in fp32
        precision = args.precision or (planned.precision if planned.fits else None)
        engine = Engine.load(loaded, heads="auto", dtype=torch_dtype(precision, real.kind),
                             device=real.torch_device, progress=progress, precision=precision)
        timing = (timing_for(engine, real.name, data_dir(), precision, progress)
                  if target.kind == real.kind else None)
    finally:
        progress.close()
    return plan_inputs(engine, target, timing, link=link, cards=cards), engine


def _host_link(args: argparse.Namespace, real, target):
    """The host RAM and link bandwidth for ``target`` (``planning.host``): ``--ram`` and
    ``--link-gbps`` where given; else the RAM free now, and the link measured on this
    machine's GPU when the plan is for it (else ``ASSUMED_GB_S``). None off GPUs."""
    from specmemo_core.planning.host import host_link_for
    from specmemo_core.planning.offload import OFFLOAD_KINDS
    from specmemo_core.storage.data_folder import data_dir

    if target.kind not in OFFLOAD_KINDS or (_BARE_NUMBER.fullmatch(args.ram) and float(args.ram) == 0):
        return None
    ram = None if args.ram == "auto" else vram_size(args.ram)[1]
    gbps = args.link_gbps if args.link_gbps is not None or real.kind == target.kind else ASSUMED_GB_S
    return host_link_for(real if real.kind == target.kind else target, data_dir(), ram_bytes=ram,
                         bandwidth=gbps * 1e9 if gbps is not None else None)


def _make_plan(args: argparse.Namespace):
    """The plan through the one plan entry (``planning.entry.make_plan``), as chat and the app make it."""
    from specmemo_core.planning.entry import make_plan

    choices = plan_choices(args)
    request = choices.request()
    numbers = parse_devices(args.devices)
    real, target = _planned_for(args)
    cards = _cards(args, numbers, target)
    link = _host_link(args, real, target)
    engine = None
    if args.model.startswith("shape:"):
        inputs = replace(_shape_inputs(args, target), link=link, cards=cards)
    else:
        inputs, engine = _model_inputs(args, real, target, link, cards)
    shape = inputs.model
    if request.system_tokens + request.tokens_per_turn > shape.max_context:  # else it "fits" with 0 turns
        raise SpecMemoError(f"one turn of {request.tokens_per_turn} tokens (prompt {request.prompt_tokens}, reply "
                            f"{request.reply_tokens}) does not fit the {shape.max_context}-token context of "
                            f"{shape.name}; ask for fewer --prompt-tokens/--reply-tokens")
    result = make_plan(inputs, choices)
    if result.streamed_layers and args.link_gbps is None and real.kind != target.kind:
        result = replace(result, notes=result.notes + (
            f"host link taken as {ASSUMED_GB_S:g} GB/s (no such GPU here to measure); on the GPU, plan there or "
            "give --link-gbps from python -m specmemo_core.tools.offload_probe",))
    return result, request, inputs.budget, shape, engine


def _print_plan(out: dict, result, request, budget, shape, verified: bool) -> int:
    gib = lambda n: f"{n / 2**30:8.3f} GiB"  # noqa: E731
    if len(result.split) > 1:  # each card's share on its own line below
        print(f"devices  {', '.join(s.device for s in result.split)}: {gib(result.budget_bytes).strip()} usable "
              "together")
    else:
        print(f"device   {budget.kind} {budget.name}: {gib(budget.free_bytes)} free, {gib(result.budget_bytes)} usable")
    print(f"model    {shape.name}   turns wanted {request.turns} x {request.tokens_per_turn} tokens"
          + (f", for each of {request.batch} conversations decoded together" if request.batch > 1 else ""))
    if not result.fits:
        print("does not fit. What would:")
        for s in result.suggestions:
            print(f"  - {s}")
        return 3
    print(f"plan     precision {result.precision}, tree {result.tree or 'none (plain decoding)'} "
          f"({result.tree_nodes} nodes, {result.heads_used} heads), KV cache {result.kv_tokens} tokens "
          f"= {result.turns} turns")
    if result.streamed_layers:
        print(f"layers   {result.resident_layers} on the device, {result.streamed_layers} streamed from host RAM "
              f"({gib(result.pinned_host_bytes).strip()} page-locked)")
    for share in result.split:
        layers = (f"layers {share.first_layer}–{share.first_layer + share.layers - 1} ({share.layers})"
                  if share.layers else "no layers")
        print(f"gpu      {share.device}: {layers}, {gib(share.predicted_bytes).strip()} of "
              f"{gib(share.usable_bytes).strip()} usable")
    if result.predicted_tokens_per_s:
        print(f"speed    {result.predicted_tokens_per_s:.1f} tokens/s predicted")
    for term, n in result.predicted_bytes.items():
        print(f"  {term:<14}{gib(n)}")
    print(f"  {'total':<14}{gib(result.total_bytes)}")
    for note in result.notes:
        print(f"note: {note}")
    if verified:
        print(f"verify   predicted {gib(out['predicted_bytes_total'])}, measured peak {gib(out['measured_peak_bytes'])}")
        for term, n in out["measured_terms"].items():
            print(f"  measured {term:<10}{gib(n)}  (predicted {gib(result.predicted_bytes[term])})")
        for card in out.get("cards") or ():
            print(f"  {card['device']:<8} predicted {gib(card['predicted_bytes'])}, measured peak "
                  f"{gib(card['measured_peak_bytes'])} ({card['error']:+.1%})")
        streaming = out.get("stream_check")
        if streaming:
            fraction = streaming["link_fraction"]
            print(f"stream   plain step {streaming['step_s'][1]:.4f} s, "
                  f"64-node tree {streaming['tree64_vs_plain_step']:.2f}x of it; link use "
                  + (f"{fraction:.0%} of {streaming['bandwidth_gb_s']:.1f} GB/s" if fraction is not None else "n/a (no GPU)"))
    return 0


def run(args: argparse.Namespace) -> int:
    result, request, budget, shape, engine = _make_plan(args)
    out = asdict(result)
    if args.verify and result.batch > 1:
        raise SpecMemoError("--verify runs one conversation; leave out --batch to check the plan's memory")
    if args.verify and result.fits:
        if budget.kind != "cuda" or result.streamed_layers or result.split:
            engine = None  # freed before the check loads the plan's own model (see _verify_plan)
        check, streaming = (_verify_split(args, result, request, shape), None) if result.split else \
            _verify_plan(args, result, request, budget, shape, engine)
        out.update(predicted_bytes_total=check.predicted_bytes, measured_peak_bytes=check.measured_peak_bytes,
                   measured_terms=check.measured_terms, fits=result.fits and check.fits,
                   turns_run=check.turns_run, context_resets=check.context_resets, stream_check=streaming,
                   cards=[dict(asdict(c), error=round(c.error, 4)) for c in check.cards])
    if args.json:
        print(json.dumps(out))
        return 0 if result.fits else 3
    return _print_plan(out, result, request, budget, shape, args.verify and result.fits)
