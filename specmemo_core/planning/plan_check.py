"""Plans meet the device: start-up timing, trial allocation, and measured verification.

The planner itself is pure; this module does the three things that need the device:
time a forward so the planner knows where a bigger tree stops paying, allocate the
plan's KV cache and tree buffers once before the weights load (so a plan that passes
cannot run out of memory later), and run a planned chat to compare predicted and
measured peak memory.
"""

from __future__ import annotations

import itertools
import logging
import resource
from dataclasses import dataclass
from typing import Any, Callable

import torch

from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.model import CausalLM
from specmemo_core.planning.planner import Plan, StepTime, linear_step_time
from specmemo_core.runtime.tree import load_tree

log = logging.getLogger(__name__)


class PlanDoesNotFit(SpecMemoError):
    """The device refused the plan's trial allocation."""


Progress = Callable[[str, float], None]
TIMING_STAGE = "timing the device"


@dataclass(frozen=True)
class TimingHooks:
    """What a timing run reports and waits on: ``progress(stage, fraction)`` after each
    timed run, and ``pause()`` before it (it may block, e.g. while the app is replying, so
    a background timing neither slows a reply nor is slowed by one)."""

    progress: Progress | None = None
    pause: Callable[[], None] | None = None

    def before_run(self) -> None:
        if self.pause is not None:
            self.pause()

    def done(self, runs: int, total: int) -> None:
        if self.progress is not None:
            self.progress(TIMING_STAGE, min(runs / max(total, 1), 1.0))


def time_forward(model: CausalLM, heads: Any = None, big: int = 32, context: int = 128, repeats: int = 3,
                 hooks: TimingHooks = TimingHooks()) -> StepTime:
    """The planner's step-time model from whole decoding steps, timed as this device runs
    them: the static decoder's graph replays on CUDA, the decoder's eager steps elsewhere.

    A plain step, chains of 1 and d levels, a ``big``-node tree and a grown tree are each timed
    whole (drafting, verifying, accepting, committing; the fastest of their steps after the
    first, which warm up or capture), and the cost per node, per drafted level and once
    per drafting, multi-token and grown step are solved from them (``solve_step_time``). Timing bare forwards of 1 and ``big``
    tokens instead, with a line between them, left out what every step pays besides the
    forward and charged small trees the big forward's slope: on this 2-core machine it
    predicted a 9-node step at 2.1× a plain one where the decoder's steps took 1.5×, and
    the planner kept to trees too small to pay. On a shared machine other programs only
    add time, so the fastest step is the cost of the step itself.

    NOTE: kept short (a 128-token history, 3 repeats): attention over 128 or 512 tokens
    costs a few percent of a small model's step, and a timing taken under load is
    re-measured later (``planning.timing``).
    """
    from specmemo_core.runtime.tree import specmemo_pruned_tree

    ids = torch.randint(0, model.spec.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    steps = 2 * repeats + 2
    trees = 3 if heads is None else 6  # plain, lookup chains, then (with heads) chain-1, a chain, a wide tree, a grown one
    done = 0

    def fastest(tree: Any, with_heads: bool = True) -> float:
        nonlocal done
        width = tree.width if tree is not None else 1
        decoder = _timing_decoder(model, heads if tree is not None and with_heads else None, tree,
                                  capacity=context + (tree.num_nodes if tree is not None else 1) + width * steps + 1)
        seconds = _fastest_step(decoder, ids, steps, warmup=2, width=width, hooks=hooks,
                                runs=(done, trees * steps))
        done += steps
        return seconds

    t1 = fastest(None)
    # lookup chains (no heads) time steps of several tokens that draft nothing: what any step
    # past one token pays (``solve_step_time``'s once-per-step cost), apart from the heads' own
    chains = (load_tree("lookup-1"), load_tree(f"lookup-{TIMED_LOOKUP}")) if heads is None else (
        load_tree(f"lookup-{TIMED_LOOKUP}"),)
    timed = [TimedStep(t.num_nodes, t.depth, fastest(t, with_heads=False)) for t in chains]
    if heads is not None:
        drafted = (load_tree("chain-1"), load_tree(f"chain-{min(3, heads.num_heads)}"),
                   specmemo_pruned_tree(levels=min(4, heads.num_heads), node_budget=big))
        timed += [TimedStep(t.num_nodes, t.depth, fastest(t)) for t in drafted]
        grown = load_tree(f"dynamic-{TIMED_GROWN}")  # nodes picked each step from the heads' scores
        timed.append(TimedStep(grown.num_nodes, grown.depth, fastest(grown), grown=True))
    log.info("timed steps (nodes, depth, grown: ms): plain %.3f; %s", t1 * 1e3,
             "; ".join(f"{t.nodes}, {t.depth}, {t.grown}: {t.seconds * 1e3:.3f}" for t in timed))
    return solve_step_time(t1, *timed, big=big)


def _timing_decoder(model: CausalLM, heads: Any, tree: Any, *, capacity: int) -> Any:
    """The decoder a chat runs on this device: graph-captured static steps on CUDA, eager
    steps elsewhere and for a model that streams layers or is split over two devices
    (``Engine.new_session``'s rule)."""
    if model.device.type == "cuda" and model.capturable:
        from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache

        return StaticDecoder(model, new_static_cache(model, capacity), heads, tree, graphs=True)
    from specmemo_core.runtime.decoding import Decoder

    return Decoder(model, model.new_cache(capacity), heads, tree)


@dataclass(frozen=True)
class TimedStep:
    """The fastest whole step on a tree of ``nodes`` nodes drafted ``depth`` levels deep."""

    nodes: int
    depth: int
    seconds: float
    grown: bool = False  # a tree grown each step (``runtime/growth.py``)


# the step model's unknowns beyond a plain step, in the order tried when several fit alike
# (``solve_step_time``): per node, per drafted level, once per step that drafts with heads,
# once per step of more than one token, once per step on a grown tree; every subset, the larger first
_UNKNOWN_SETS = tuple(c for size in range(5, -1, -1) for c in itertools.combinations(range(5), size))
TIMED_LOOKUP = 8  # nodes of the lookup chain ``time_forward`` times (with lookup-1 where there are no heads)
TIMED_GROWN = 16  # nodes of the grown tree it times (with heads)


def solve_step_time(plain: float, *timed: TimedStep, big: int) -> StepTime:
    """The step-time model through a plain step of ``plain`` seconds and timed trees:
    step(n, depth) = plain + slope·(n − 1) + level·depth + once, for any step that drafts,
    ``heads_step``, + once, for any step of n > 1, ``multi_step`` (``planner.linear_step_time``:
    on a GPU a plain step runs fused one-token kernels, so the second token costs more than
    the slope; without the term, lookup chains timed as nearly free and the planner took
    lookup-8 on an H200 at 0.68× plain decoding, ``docs/results/token_layer_h200/``). The
    costs are the non-negative least-squares fit to the trees' extra times: every set of them that the
    trees can determine is fitted with the others at 0, and of the fits with no negative
    cost the closest wins (ties: the earlier set of ``_UNKNOWN_SETS``). Why the term once per
    step: a drafting step pays the heads' context layer and the tree's acceptance whatever
    its size; without it a 2-unknown fit through a chain and a wide tree charged that to
    every level, so on an H200 in fp32 the planner took a 2-level 12-node tree at 1.66×
    plain decoding where 24- and 56-node trees ran 1.85–1.88× (``docs/results/fp32_trees_h200/``).
    A negative cost (noise: a bigger tree timed faster) is never used. A grown tree
    (``TimedStep.grown``) pays, once, what picking its nodes from the heads' scores costs
    (``grow_step``): without it the planner took a grown tree on an H200 whose steps ran 2.2 ms
    against the 1.8 it predicted, slower than plain decoding (``docs/results/tree_rows_h200/``)."""
    rows = torch.tensor([[t.nodes - 1, t.depth, float(t.depth > 0), float(t.nodes > 1), float(t.grown)]
                         for t in timed], dtype=torch.float64)  # [T, 5]
    extra = torch.tensor([t.seconds - plain for t in timed], dtype=torch.float64)  # [T]
    best: tuple[float, torch.Tensor] | None = None
    for free in _UNKNOWN_SETS:
        if len(free) > len(timed) or (free and torch.linalg.matrix_rank(rows[:, free]) < len(free)):
            continue
        costs = torch.zeros(5, dtype=torch.float64)
        if free:
            costs[list(free)] = torch.linalg.lstsq(rows[:, free], extra[:, None]).solution[:, 0]
        if (costs < 0).any():
            continue
        residual = float(((rows @ costs - extra) ** 2).sum())
        if best is None or residual < best[0] - 1e-18:
            best = (residual, costs)
    slope, level, heads_step, multi, grow = (float(c) for c in best[1])
    return linear_step_time(plain, plain + multi + slope * (big - 1), big, level, heads_step, multi_step=multi,
                            grow_step=grow)


def _fastest_step(decoder: Any, prompt: list[int], steps: int, *, warmup: int, width: int,
                  hooks: TimingHooks = TimingHooks(), runs: tuple[int, int] = (0, 0)) -> float:
    """The fastest of ``steps`` decoding steps after the first ``warmup`` (which warm up or
    capture). ``width``: most tokens a step commits; ``runs`` = (runs done before, runs in
    all) for the progress fraction."""
    from specmemo_core.runtime.decoding import GenerationConfig

    times: list[float] = []
    hooks.before_run()
    # a step commits 1 to `width` tokens: room for `steps` steps even if every draft is accepted,
    # after the prefill's own first token (without it a plain run timed one step too few)
    for step in decoder.generate(prompt, GenerationConfig(max_new_tokens=1 + steps * width)):
        if not step.prefill:
            times.append(step.forward_s)
            hooks.done(runs[0] + len(times), runs[1])
            if len(times) == steps:
                break
        hooks.before_run()  # the generator is suspended here: a pause does not land inside a step
    return min(times[warmup:] or times)


def confirm(plan: Plan, device: str | torch.device) -> None:
    """Allocate the plan's KV cache and tree buffers once and free them again.

    On a GPU this is what llama.cpp's fit check does: if the allocator refuses now, the
    plan is refused before the weights load. On a CPU the OS would overcommit, so the
    check compares against the memory the OS reports available instead.
    """
    need = plan.predicted_bytes.get("kv_cache", 0) + plan.predicted_bytes.get("tree_buffers", 0)
    device = torch.device(device)
    if device.type == "cpu":
        import psutil

        free = psutil.virtual_memory().available
        if plan.total_bytes > free:
            raise PlanDoesNotFit(f"the plan needs {plan.total_bytes / 2**30:.2f} GiB but only "
                                 f"{free / 2**30:.2f} GiB of RAM is available: ask for fewer turns")
        return
    try:
        block = torch.empty(need, dtype=torch.uint8, device=device)
        del block
    except torch.OutOfMemoryError as exc:
        raise PlanDoesNotFit(f"the device refused {need / 2**30:.2f} GiB for the KV cache and tree "
                             f"buffers: plan fewer turns or a smaller tree") from exc
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class CardCheck:
    """One card of a split plan (``Plan.split``), run: its predicted bytes less the runtime's
    overhead (which the allocator does not count), and the peak the allocator measured there."""

    device: str
    predicted_bytes: int
    measured_peak_bytes: int
    usable_bytes: int

    @property
    def error(self) -> float:
        """(predicted − measured) / measured: + over-predicts, − under-predicts."""
        return (self.predicted_bytes - self.measured_peak_bytes) / max(self.measured_peak_bytes, 1)


@dataclass(frozen=True)
class Verification:
    predicted_bytes: int
    measured_peak_bytes: int
    measured_terms: dict[str, int]
    fits: bool
    turns_run: int = 0
    context_resets: int = 0  # times the oldest turns left the context (a sliding chat)
    cards: tuple[CardCheck, ...] = ()  # a split plan's cards (CUDA), each measured

    @property
    def error(self) -> float:
        """(predicted − measured) / measured: + over-predicts, − under-predicts."""
        return (self.predicted_bytes - self.measured_peak_bytes) / max(self.measured_peak_bytes, 1)


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def cap_device(device: str | torch.device, cap_bytes: int) -> None:
    """Make a big GPU behave like a small one: the caching allocator refuses (with an
    out-of-memory error) anything past ``cap_bytes`` for this process."""
    device = torch.device(device)
    if device.type != "cuda":
        raise SpecMemoError("a memory cap can only be set on a CUDA GPU")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), index)


def shape_config(shape: Any) -> Any:
    """A transformers Llama config with ``shape``'s numbers (for random-weight models)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings, max_position_embeddings=shape.max_context,
        rms_norm_eps=1e-5,
    )


def random_model(shape: Any, precision: str, device: str | torch.device, seed: int = 0, *,
                 resident_layers: int | None = None, split: Any = None) -> CausalLM:
    """A model of ``shape``'s architecture with random weights, built a layer at a time on
    ``device`` and quantized as it goes, so a 7B model in int4 never needs its bf16 size.
    ``resident_layers``: keep that many decoder layers on ``device`` and stream the rest
    (``runtime/offload.py``): each streamed layer is made on ``device`` and packed into
    host memory at once, so the device never holds more than one of them. ``split`` (a
    ``runtime.split.LayerSplit``): each part is made on its own device (``device`` is then
    ignored), so no card ever holds more than its share.

    Weights ~ N(0, 0.02²), norms 1: activations stay finite, and memory is all a plan
    check needs from it."""
    from specmemo_core.runtime.model import ModelSpec, rope_inverse_frequencies
    from specmemo_core.runtime.offload import offload_layers
    from specmemo_core.runtime.quantize import QuantSpec, quantize_layer

    device = torch.device(device) if split is None else split.home
    config = shape_config(shape)
    spec = ModelSpec.from_config(config)
    quant = QuantSpec(precision)
    around = torch.float32 if device.type == "cpu" else torch.bfloat16  # int8/int4 as Engine.load has them
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, around)
    with torch.device("meta"):
        model = CausalLM(spec, (torch.empty(spec.head_dim // 2), 1.0))
    at = _layer_devices(spec.num_layers, device, split)
    gens: dict[torch.device, torch.Generator] = {}

    def materialize(module: torch.nn.Module, where: torch.device = device) -> None:
        gen = gens.setdefault(where, torch.Generator(device=where).manual_seed(seed))
        module.to_empty(device=where, recurse=False)
        for name, p in module.named_parameters(recurse=False):
            data = (torch.ones(p.shape, dtype=dtype, device=where) if "norm" in type(module).__name__.lower()
                    else torch.randn(p.shape, generator=gen, dtype=torch.float32, device=where).mul_(0.02).to(dtype))
            setattr(module, name, torch.nn.Parameter(data, requires_grad=False))

    def build(layer: torch.nn.Module, where: torch.device = device) -> None:
        for module in layer.modules():
            materialize(module, where)
        if quant.quantized:
            quantize_layer(layer, quant)

    materialize(model.model.embed_tokens, device if split is None else split.first)
    for module in (model.model.norm, model.lm_head):
        materialize(module)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for i, layer in enumerate(model.model.layers[:resident_layers]):
        build(layer, at[i])
    inv_freq, scale = rope_inverse_frequencies(config)
    model.inv_freq = inv_freq.to(device)
    model.rope_scale = scale
    if resident_layers is not None:
        offload_layers(model, resident_layers=resident_layers, device=device, prepare=build)
    if split is not None:
        from specmemo_core.runtime.split import split_model

        split_model(model, split)  # everything already sits on its device: this places the borders
    if precision == "int4" and torch.device(device).type == "cpu" and resident_layers is None and split is None:
        _int8_head(model)  # the LM head as the engine holds it beside int4 layers on a CPU
    return model.eval().requires_grad_(False)


def _int8_head(model: CausalLM) -> None:
    from specmemo_core.runtime.cpu_linear import pack_linears

    pack_linears(model, int8_head=True)


def _layer_devices(num_layers: int, device: torch.device, split: Any) -> list[torch.device]:
    """Each decoder layer's device, for ``random_model``."""
    if split is None:
        return [device] * num_layers
    return [d for d, n in zip(split.devices, split.layers) for _ in range(n)]


def verify(plan: Plan, model: CausalLM, heads: Any, tree: Any, *, prompt_tokens: int, reply_tokens: int,
           turns: int, seed: int = 0) -> Verification:
    """Run the planned chat with synthetic text (prefill + ``turns`` turns) and measure.

    The prefill is a synthetic document that fills the planned KV cache but for one
    turn, so the worst case the plan allows (a prefill chunk and tree steps at full
    context) is measured, not just the first few thousand tokens. Then each turn adds
    ``prompt_tokens`` random tokens and generates ``reply_tokens``; when the next turn
    would not fit the cache, the oldest turns (the document first) leave the context
    and the rest is prefilled again, as the app does in a long chat, so every requested
    turn runs.

    CUDA: ``torch.cuda.max_memory_allocated`` against the predicted total less the
    runtime overhead term (which the allocator does not count). CPU: the process's peak
    resident memory against the predicted total.
    """
    from specmemo_core.runtime.decoding import Decoder, GenerationConfig

    device = model.device
    if device.type == "cuda":
        for card in {device, *(torch.device(s.device) for s in plan.split)}:
            torch.cuda.synchronize(card)
            torch.cuda.reset_peak_memory_stats(card)
        torch.cuda.empty_cache()
    cache = model.new_cache(plan.kv_tokens + plan.tree_nodes)
    decoder = Decoder(model, cache, heads if plan.tree else None, tree if plan.tree else None)
    gen = torch.Generator().manual_seed(seed)
    kept: list[list[int]] = []  # the turns in the context, each prompt + reply
    document = plan.kv_tokens - plan.tree_nodes - prompt_tokens - reply_tokens - 1
    if document > 0:
        kept.append(torch.randint(0, model.spec.vocab_size, (document,), generator=gen).tolist())
    resets = 0
    config = GenerationConfig(max_new_tokens=reply_tokens)
    for _ in range(turns):
        prompt = torch.randint(0, model.spec.vocab_size, (prompt_tokens,), generator=gen).tolist()
        while kept and sum(map(len, kept)) + prompt_tokens + reply_tokens + plan.tree_nodes > plan.kv_tokens:
            kept.pop(0)
            resets += 1
        if prompt_tokens + reply_tokens + plan.tree_nodes > plan.kv_tokens:
            raise SpecMemoError(f"one turn of {prompt_tokens + reply_tokens} tokens does not fit the planned "
                                f"{plan.kv_tokens}-token KV cache")
        turn = list(prompt)
        history = [t for k in kept for t in k] + turn
        for step in decoder.generate(history, config):
            turn += list(step.token_ids)
        kept.append(turn)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    measured = {
        "weights": _module_bytes(model),
        "heads": _module_bytes(heads) if (heads is not None and plan.tree) else 0,
        "kv_cache": cache.nbytes,
    }
    if model.streamed is not None:  # staging slots on the device; the streamed layers are in host memory
        measured["staging"] = model.streamed.staging_bytes
    peak = peak_bytes(device)
    predicted = plan.total_bytes - (plan.predicted_bytes.get("overhead", 0) if device.type == "cuda" else 0)
    cards = _card_checks(plan) if device.type == "cuda" else ()
    fits = all(c.measured_peak_bytes <= c.usable_bytes for c in cards) if cards else peak <= plan.budget_bytes
    return Verification(predicted, peak, measured, fits, turns, resets, cards)


def _card_checks(plan: Plan) -> tuple[CardCheck, ...]:
    """Each card of a split plan, measured after its run (none for a plan on one device)."""
    checks = []
    for share in plan.split:
        card = torch.device(share.device)
        torch.cuda.synchronize(card)
        checks.append(CardCheck(share.device, share.predicted_bytes - share.overhead_bytes, peak_bytes(card),
                                share.usable_bytes))
    return tuple(checks)


def _module_bytes(module: torch.nn.Module) -> int:
    from specmemo_core.runtime.quantize import held_bytes

    return held_bytes(module)
