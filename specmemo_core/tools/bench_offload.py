"""``specmemo bench`` for models larger than the GPU: accelerate's CPU offload against our
streamed layers, in one process, on the same workload as every bench method (``bench.py``).

Methods
-------
accelerate-offload   transformers ``generate`` (greedy) on a model dispatched by accelerate
                     (``infer_auto_device_map`` with ``max_memory``: what does not fit the GPU
                     stays in host RAM and is copied in, layer by layer, at every forward):
                     the baseline users know. Its GPU share is the weight bytes our plan keeps
                     there (resident layers and staging slots), so both hold the same weights.
stream-plain         our decoder on the streamed model (``runtime/offload.py``), plain decoding.
stream-tree          the same with the shipped heads on the planner's offload tree.
stream-random-heads  the same tree's heads part (its lookup chain left out: a chain copies
                     from the conversation, so it is accepted whatever the heads) with
                     random-weight heads: their drafts are almost never accepted, so it
                     measures what verifying the tree costs when the link bounds a step (the
                     claim: next to nothing beside ``stream-plain``; the tree's gain comes from
                     acceptance, not from a side effect).

The layout comes from the planner (``planning.entry.make_plan``) for a GPU of ``cap_bytes``
(``--cap-gib``; ``half``: the largest cap at which at most half the decoder layers stay on
the GPU), and this process is capped with ``plan_check.cap_device`` as ``plan --verify`` is,
at the plan's GPU memory plus accelerate's share and ``GENERATE_HEADROOM`` (both models stay
loaded so the methods interleave; our layout is the plan's whatever the process cap). On CPU there is no link to measure: the methods run only with a forced layout
(``--resident-layers``) and a named tree, as a smoke test of the plumbing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

import torch

from specmemo_core.errors import OffloadError
from specmemo_core.planning.entry import PlanChoices
from specmemo_core.tools.bench import BENCH_CONTEXT, Method, hf_runner, ours_runner, predicted_memory

OFFLOAD_METHODS = ("accelerate-offload", "stream-plain", "stream-tree", "stream-random-heads")
CAP_STEP = 16 * 2**20  # bytes: the resolution of the ``half`` cap
SMOKE_TREE = "chain-3"  # the tree of a CPU smoke test when none is named
GENERATE_HEADROOM = 256 * 2**20  # the process cap's room for transformers' generate (its cache, activations)


@dataclass(frozen=True)
class OffloadSetup:
    """Where the layers live for the offload methods, and why."""

    resident_layers: int
    streamed_layers: int
    tree: str | None  # the streamed methods' tree (the planner's offload tree on a GPU)
    cap_bytes: int | None  # the GPU the plan is made for; None: a forced layout (CPU smoke test)
    accelerate_gpu_bytes: int | None  # accelerate's max_memory on the GPU
    process_cap_bytes: int | None  # this process's cap: the plan's bytes + accelerate's share + headroom
    predicted_tokens_per_s: float | None
    link_gb_s: float | None
    note: str = ""


def bench_choices(*, max_new_tokens: int, precision: str) -> PlanChoices:
    """The plan's request for the bench: turns enough for a ``BENCH_CONTEXT``-token cache
    (each conversation's), every layer that fits kept on the GPU (prefer speed)."""
    per_turn = 200 + 12 + max_new_tokens  # PlanChoices' prompt estimate and template markers
    return PlanChoices(turns=-(-BENCH_CONTEXT // per_turn), prefer=1.0, reply_tokens=max_new_tokens,
                       precision=precision)


def half_layers_cap(inputs: Any, choices: PlanChoices, *, step: int = CAP_STEP) -> int:
    """The largest GPU memory (to ``step`` bytes) at which the plan for ``inputs`` streams and
    keeps at most half the decoder layers on the GPU; resident layers grow with memory
    (``planning/offload.py``), so a bisection finds it."""
    from specmemo_core.planning.entry import make_plan
    from specmemo_core.planning.planner import Budget

    layers = inputs.model.num_layers
    half = layers // 2

    def resident(steps: int) -> int:  # -1: nothing fits; all layers: nothing streams (monotone in memory)
        cap = steps * step
        p = make_plan(replace(inputs, budget=Budget(inputs.budget.kind, cap, cap, f"{cap} bytes")), choices)
        return -1 if not p.fits else (layers if p.resident_layers is None else p.resident_layers)

    hi = 1
    while resident(hi) <= half:  # the first cap (in doublings) that keeps more than half
        hi *= 2
        if hi * step > 2**44:
            raise OffloadError("no GPU memory keeps more than half the layers: the plan does not stream them")
    lo = 0  # resident(lo) ≤ half < resident(hi): bisect for the largest cap that keeps at most half
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if resident(mid) <= half else (lo, mid)
    if lo == 0 or resident(lo) < 0:
        raise OffloadError(f"no GPU memory streams {inputs.model.name} with at most {half} of its {layers} layers "
                           "resident (the non-layer weights and the KV cache alone need more); check --ram and --dtype")
    return lo * step


def plan_setup(inputs: Any, choices: PlanChoices, cap: str) -> tuple[OffloadSetup, Any]:
    """The offload plan for a GPU of ``cap`` GiB (``half``: ``half_layers_cap``), and the
    setup of the methods that follows from it; refused when the plan does not stream."""
    from specmemo_core.planning.entry import PlanDoesNotFitError, make_plan
    from specmemo_core.planning.planner import Budget

    cap_bytes = half_layers_cap(inputs, choices) if cap == "half" else int(float(cap) * 2**30)
    budget = Budget(inputs.budget.kind, cap_bytes, cap_bytes, f"{cap_bytes / 2**30:.2f} GiB cap")
    chosen = make_plan(replace(inputs, budget=budget), choices)
    if not chosen.fits:
        raise PlanDoesNotFitError(chosen)
    if not chosen.streamed_layers:
        raise OffloadError(f"the whole model fits {cap_bytes / 2**30:.2f} GiB: nothing to stream; give a smaller "
                           "--cap-gib (or 'half')")
    on_gpu = chosen.predicted_bytes["weights"] + chosen.predicted_bytes["staging"]
    link = inputs.link.bandwidth / 1e9 if inputs.link is not None else None
    return OffloadSetup(chosen.resident_layers, chosen.streamed_layers, chosen.tree, cap_bytes, on_gpu,
                        chosen.total_bytes + on_gpu + GENERATE_HEADROOM, chosen.predicted_tokens_per_s, link), chosen


def forced_setup(num_layers: int, resident_layers: int, tree: str | None) -> OffloadSetup:
    """A layout given by hand (no plan, no link): the CPU smoke test."""
    if not 0 <= resident_layers < num_layers:
        raise OffloadError(f"--resident-layers must be between 0 and {num_layers - 1}, got {resident_layers}")
    return OffloadSetup(resident_layers, num_layers - resident_layers, tree or SMOKE_TREE, None, None, None, None,
                        None, "forced layout, no plan: a smoke test of the methods, not a measurement")


def accelerate_model(loaded: Any, device: str, dtype: torch.dtype, gpu_bytes: int | None) -> Any:
    """transformers' model over ``loaded``'s weights, dispatched by accelerate: ``gpu_bytes``
    of it on the GPU, the rest in host RAM (copied in at each forward). On CPU every module
    maps to the CPU (``device_map`` ``{"": "cpu"}``)."""
    from accelerate import dispatch_model, infer_auto_device_map

    from specmemo_core.tools.train.pipeline import hf_model_from

    hf = hf_model_from(loaded, "cpu", dtype)
    if torch.device(device).type != "cuda":
        return dispatch_model(hf, device_map={"": "cpu"})
    index = torch.device(device).index or 0
    layer_class = type(hf.model.layers[0]).__name__
    device_map = infer_auto_device_map(hf, max_memory={index: gpu_bytes, "cpu": 2**40},
                                       no_split_module_classes=[layer_class], dtype=dtype)
    return dispatch_model(hf, device_map=device_map, main_device=index)


def with_random_heads(engine: Any) -> Any:
    """``engine`` with random-weight heads of the same kind and count as its own (or 5)."""
    from specmemo_core.runtime.heads import random_heads

    spec = engine.model.spec
    count, kind = (engine.heads.num_heads, engine.heads.spec.kind) if engine.heads is not None else (5, "medusa")
    heads = random_heads(count, spec.hidden_size, spec.vocab_size, kind=kind, seed=1)
    return replace(engine, heads=heads.to(device=engine.model.device, dtype=engine.model.dtype))


def random_heads_tree(tree: Any) -> Any:
    """The control's tree: ``tree``'s heads' nodes alone (a lookup-only tree keeps its chain:
    it has nothing else to verify)."""
    return tree.with_lookup(0) if tree.lookup and tree.drafts else tree


def build_offload_methods(names: Sequence[str], *, engine: Any, hf: Any, conversations: Sequence[Sequence[str]],
                          setup: OffloadSetup, max_new_tokens: int, precision: str) -> list[Method]:
    """The offload methods by name: ``engine`` streams ``setup``'s layers, ``hf`` is the
    accelerate-dispatched model (None when not asked for)."""
    from specmemo_core.runtime.chat import end_of_turn_ids
    from specmemo_core.runtime.engine import resolve_tree

    tree = resolve_tree(setup.tree, engine.heads_folder) if setup.tree else None
    kind = engine.model.device.type
    streaming = f"{setup.resident_layers} layers resident, {setup.streamed_layers} streamed"

    def ours(name: str, eng: Any, chosen: Any, note: str) -> Method:
        buffers, total = predicted_memory(eng.model, eng.heads, chosen, precision, kind)
        run = ours_runner(eng, conversations, chosen, max_new_tokens=max_new_tokens)
        return Method(name, run, chosen.name if chosen is not None else None,
                      chosen.num_nodes if chosen is not None else 1, buffers, total, f"{streaming}; {note}")

    methods = []
    for name in names:
        if name == "accelerate-offload":
            if hf is None:
                raise OffloadError("accelerate-offload needs the accelerate-dispatched transformers model")
            stops = end_of_turn_ids(engine.tokenizer, engine.config)
            device = torch.device(engine.model.device)
            methods.append(Method(name, hf_runner(hf, engine.tokenizer, stops, conversations, max_new_tokens,
                                                  input_device=device),
                                  note=(f"accelerate device_map, {setup.accelerate_gpu_bytes} bytes on the GPU"
                                        if setup.accelerate_gpu_bytes else "accelerate device_map: all on the CPU")
                                  + "; re-prefills the conversation every turn"))
        elif name == "stream-plain":
            methods.append(ours(name, engine, None, "plain decoding"))
        elif name in ("stream-tree", "stream-random-heads"):
            if tree is None:
                raise OffloadError(f"{name} needs a tree: the plan chose plain decoding")
            if name == "stream-tree":
                tree.check_heads(engine.heads)
                methods.append(ours(name, engine, tree, "shipped heads"))
            else:
                methods.append(ours(name, with_random_heads(engine), random_heads_tree(tree),
                                    "random-weight heads, no lookup chain"))
        else:
            raise OffloadError(f"unknown offload method {name!r}: choose from {', '.join(OFFLOAD_METHODS)}")
    return methods


def offload_summary(result: dict, setup: OffloadSetup) -> dict:
    """The ``_offload`` entry of the report: the layout, the cap, and the ratios that answer
    the question (tree vs accelerate, tree vs stream-plain, random heads vs stream-plain)."""
    def speed(name: str) -> float | None:
        return result[name]["tokens_per_s"]["median"] if name in result else None

    def ratio(a: str, b: str) -> float | None:
        x, y = speed(a), speed(b)
        return round(x / y, 3) if x is not None and y else None

    return asdict(setup) | {
        "cap_gib": round(setup.cap_bytes / 2**30, 3) if setup.cap_bytes else None,
        "tokens_per_s": {name: speed(name) for name in OFFLOAD_METHODS if name in result},
        "tokens_per_step": {name: result[name]["tokens_per_step"] for name in OFFLOAD_METHODS if name in result},
        "tree_vs_accelerate": ratio("stream-tree", "accelerate-offload"),
        "tree_vs_stream_plain": ratio("stream-tree", "stream-plain"),
        "random_heads_vs_stream_plain": ratio("stream-random-heads", "stream-plain"),
        "stream_plain_vs_accelerate": ratio("stream-plain", "accelerate-offload"),
    }


def identical_to_stream_plain(methods: Sequence[Method], passes: dict) -> dict[str, int | None]:
    """Replies of each method equal token for token to ``stream-plain``'s (greedy: they must be)."""
    from specmemo_core.tools.bench import identical_count

    if "stream-plain" not in passes:
        return {m.name: None for m in methods}
    base = passes["stream-plain"][-1].replies
    return {m.name: identical_count(passes[m.name][-1].replies, base) for m in methods}
