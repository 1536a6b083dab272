"""The planner: fit the whole chat to the device before the first token.

``plan(device, model, heads, request)`` is a pure function. It decides precision, tree
and KV-cache size so that the requested turns fit the device's *free* memory (less a
safety margin), and says what would fit when nothing does — before anything loads.

Rules, in order:
1. Tokens per turn = prompt estimate + chat-template overhead + max reply length; the
   KV cache is capped at the model's context length (longer chats slide, app issue).
2. Precision: the best-quality one (fp32/bf16 > int8 > int4) whose weights, heads, the
   requested KV cache, a plain step's buffers, activations and overhead fit. A higher
   precision is taken only if it costs no turns and no tree nodes against the next one
   down, so more memory never gives fewer turns or a smaller tree.
3. What memory is left after that is split by ``prefer`` (0 = turns, 1 = speed): the
   speed share caps the tree's buffers, the rest extends the KV cache (more turns).
4. Tree: among the candidate trees whose buffers fit the speed share, the one with the
   highest predicted tokens/s = expected tokens per step (from the heads' calibration;
   without it, SpecMemo's pruning prior) ÷ step time (from the device's start-up
   timing when given; else the tree is the largest that fits, SpecMemo-style).
5. Batch: ``request.batch`` conversations decoded together (``runtime/batch.py``) each
   get the KV cache one would (the KV term scales with B), and a step verifies B trees
   in one forward, timed as a forward of B × N tokens: as B grows the step stops being
   bound by launches and weight reads, extra nodes cost their share, and the tree chosen
   shrinks (to plain decoding where drafts no longer pay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.decoding import PREFILL_CHUNK
from specmemo_core.runtime.tree import heads_can_draft
from specmemo_core.planning.offload import (OFFLOAD_KINDS, OFFLOAD_PRECISIONS, HostLink, KvRange, choose_offload,
                                            offload_refusal)
from specmemo_core.planning.split import DeviceShare
from specmemo_core.planning.memory import (
    INT4_GROUP_SIZE, OVERHEAD_FRACTION, PLAIN, HeadsShape, ModelShape, TreeShape, activation_peak_bytes,
    around_precision, heads_bytes, kv_bytes, overhead_bytes, tree_buffer_bytes, weight_bytes,
)

QUALITY_ORDER = ("fp32", "bf16", "int8", "int4")  # best first; fp16 only when asked for
TREE_SIZES = (64, 48, 32, 24, 16, 12, 8, 6, 4, 1)
# Extra tokens per step a lookup chain of N nodes adds to a heads' tree: measured with the
# default model's shipped heads on 24 held-out ShareGPT queries (12 conversations × 2
# turns, 96 new tokens, CPU fp32; docs/results/lookup_gain_heldout_cpu.json):
# calibrated-6 1.83 → +lookup-3 2.29; calibrated-48 2.41 → +lookup-8 3.21. Longer chains
# (a copied loop keeps looping, so they pay on replies that repeat): 8's figure scaled as the
# shipped calibration's walk scales it (calibrated-48 +3/8/16/32/64: +0.49/0.92/1.10/1.19/1.23,
# alone 1.60/1.76/1.81/1.84/1.85; docs/results/lookup_long_cpu/calibration_cpu.json). NOTE: a
# workload constant, not a property of the heads; chats that rewrite or edit gain more
# (MT-Bench: +1.2 with 8; dynamic-48's chain at 32, not 8: +0.59, docs/results/lookup_long_cpu/).
LOOKUP_GAIN = {64: 1.07, 32: 1.04, 16: 0.96, 8: 0.80, 3: 0.46}
LOOKUP_ALONE = {64: 1.71, 32: 1.70, 16: 1.68, 8: 1.62, 3: 1.48}  # a chain alone (no heads), same runs
# Bytes a KV-cache token costs with the overhead term that grows with it, plus 1% so the
# first guess of the cache size rarely needs the rounding loop in ``_layout``.
KV_TOKEN_GROWTH = 1.0 + OVERHEAD_FRACTION + 0.01


@dataclass(frozen=True)
class Budget:
    """The memory the plan may use: free bytes of one device (what others hold is theirs)."""

    kind: str  # "cuda" | "rocm" | "mps" | "cpu"
    total_bytes: int
    free_bytes: int
    name: str = ""
    bf16_matmul: bool = False  # a CPU with bf16 matrix units (``DeviceInfo.bf16_matmul``): see ``precisions_for``

    def __post_init__(self) -> None:
        if self.free_bytes <= 0 or self.total_bytes <= 0 or self.free_bytes > self.total_bytes:
            raise SpecMemoError(f"device memory must be positive with free ≤ total, got {self.free_bytes} of "
                                f"{self.total_bytes} bytes")


@dataclass(frozen=True)
class PlanRequest:
    turns: int = 20
    prompt_tokens: int = 200  # expected user message length per turn
    reply_tokens: int = 256  # max reply length
    template_tokens: int = 12  # chat-template markers per turn (user + assistant)
    system_tokens: int = 40
    prefer: float = 0.5  # 0 = more turns, 1 = more speed
    precision: str | None = None  # None: the planner chooses
    safety_margin: float = 0.10  # of free memory, left unused
    max_tree_nodes: int = 64
    sampling: bool = False  # temperature > 0: typical acceptance keeps every node's distribution
    batch: int = 1  # conversations decoded together, each with its own KV cache (runtime/batch.py)

    def __post_init__(self) -> None:
        if not isinstance(self.batch, int) or self.batch < 1:
            raise SpecMemoError(f"batch must be a whole number ≥ 1 of conversations, got {self.batch!r}")
        if not isinstance(self.turns, int) or self.turns < 1:
            raise SpecMemoError(f"turns must be a whole number ≥ 1, got {self.turns!r}")
        if not (0.0 <= self.prefer <= 1.0):
            raise SpecMemoError(f"prefer must be between 0 (turns) and 1 (speed), got {self.prefer!r}")
        if min(self.prompt_tokens, self.reply_tokens) < 1 or self.template_tokens < 0 or self.system_tokens < 0:
            raise SpecMemoError("token counts per turn must be positive")
        if not (0.0 <= self.safety_margin < 0.9):
            raise SpecMemoError("safety margin must be between 0 and 0.9")

    @property
    def tokens_per_turn(self) -> int:
        return self.prompt_tokens + self.template_tokens + self.reply_tokens


@dataclass(frozen=True)
class TreeOption:
    """A candidate tree: its size, depth, expected tokens per verify step, and its widest
    drafting level (``Tree.widest_drafting_level``; None: as many as its nodes)."""

    name: str
    nodes: int
    depth: int
    expected_accepted: float
    widest: int | None = None
    grown: bool = False  # grown each step (``runtime/growth.py``), one tree per conversation

    @property
    def shape(self) -> TreeShape:
        return TreeShape(self.nodes, self.depth, self.widest)


@dataclass(frozen=True)
class Plan:
    fits: bool
    device: str
    precision: str
    heads_used: int
    tree: str | None  # None: plain decoding
    tree_nodes: int
    kv_tokens: int  # per conversation (one batch slot)
    turns: int  # whole turns the KV cache holds, per conversation
    predicted_bytes: dict[str, int] = field(default_factory=dict)
    budget_bytes: int = 0
    predicted_tokens_per_s: float | None = None
    suggestions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # offloaded plans (planning/offload.py): decoder layers on the device (None: all of
    # them), layers streamed from host memory, and the pinned host bytes they take
    resident_layers: int | None = None
    streamed_layers: int = 0
    pinned_host_bytes: int = 0
    batch: int = 1  # conversations the plan holds at once, ``kv_tokens`` each
    # split plans (planning/split.py): each card's decoder layers and bytes; (): one device
    split: tuple[DeviceShare, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(self.predicted_bytes.values())


StepTime = Callable[..., float]  # (tree nodes, depth, grown=False) -> seconds per verify step


def memory_terms(model: ModelShape, heads: HeadsShape | None, *, precision: str, kind: str, kv_tokens: int,
                 tree: TreeShape = PLAIN, sampling: bool = False, batch: int = 1) -> dict[str, int]:
    """Every term of the memory model for ``batch`` chats of ``kv_tokens`` each on ``tree``
    (``memory.py``): a step verifies ``batch`` trees at once; a prompt is prefilled alone."""
    chunk = min(PREFILL_CHUNK, max(kv_tokens, 1))
    nodes = tree.nodes
    slot = kv_tokens + nodes  # one conversation's slots, its tree's scratch included
    around = around_precision(precision, kind)
    terms = {
        "weights": weight_bytes(model, precision, device_kind=kind),
        "heads": heads_bytes(heads, model, around, batch * slot) if nodes > 1 else 0,
        "kv_cache": kv_bytes(model, batch * slot, around),
        # on CPU the LM head is packed for oneDNN (fp32) and scored whole
        "tree_buffers": tree_buffer_bytes(model, tree, slot, around, heads=heads, sampling=sampling,
                                          whole_head=kind == "cpu", batch=batch),
        "activations": max(activation_peak_bytes(model, chunk, slot, around, kind),
                           activation_peak_bytes(model, batch * nodes, slot, around, kind)),
    }
    terms["overhead"] = overhead_bytes(kind, sum(terms.values()))
    return terms


# A tree is taken only where its predicted speed beats plain decoding's by more than this: the
# step model errs by up to 10% a step, and not alike for a tree and for plain steps (H200, the
# default model: a plain step 7% and a tree's 4–8% slower than predicted at a 1,000-token context,
# docs/results/tree_rows_h200/step_model_grown.jsonl; in the overlapped bench the plain step came
# 4% faster and `calibrated-24+lookup-8`'s ~11% slower, so the tree predicted 7% ahead ran 0.93×
# plain, docs/results/overlap_h200/). Within the model's error plain decoding is the safer pick:
# the same text, no heads' memory.
TREE_MARGIN = 0.10


def _choose_tree(options: Sequence[TreeOption], afford: Callable[[TreeOption], bool],
                 step_time: StepTime | None) -> TreeOption | None:
    fitting = [t for t in options if afford(t)]
    if not fitting:
        return None
    if step_time is None:
        return max(fitting, key=lambda t: (t.nodes, t.expected_accepted))
    plain = 1.0 / step_time(1, 0)
    best = max(fitting, key=lambda t: (t.expected_accepted / step_time(t.nodes, t.depth, t.grown), -t.nodes))
    speed = best.expected_accepted / step_time(best.nodes, best.depth, best.grown)
    return best if speed > plain * (1.0 + TREE_MARGIN) else None


def batch_step_time(step_time: StepTime | None, batch: int) -> StepTime | None:
    """A step over ``batch`` sequences on trees of N nodes, timed as one forward of
    ``batch`` × N tokens (drafting: one pass per level for the whole batch)."""
    if step_time is None or batch == 1:
        return step_time
    return lambda nodes, depth, grown=False: step_time(batch * nodes, depth, grown)


def _layout(budget: Budget, model: ModelShape, heads: HeadsShape | None, request: PlanRequest, *,
            trees: Sequence[TreeOption], precision: str, step_time: StepTime | None) -> Plan:
    """The plan at one precision (fits=False if even a plain step with the turns does not fit)."""
    usable = int(budget.free_bytes * (1.0 - request.safety_margin))
    want_tokens = min(request.system_tokens + request.turns * request.tokens_per_turn, model.max_context)
    step_time = batch_step_time(step_time, request.batch)

    def terms_for(kv_tokens: int, tree: TreeShape = PLAIN) -> dict[str, int]:
        return memory_terms(model, heads, precision=precision, kind=budget.kind, kv_tokens=kv_tokens, tree=tree,
                            sampling=request.sampling, batch=request.batch)

    base = terms_for(want_tokens)
    if sum(base.values()) > usable:
        return Plan(False, budget.kind, precision, 0, None, 1, 0, 0, base, usable, batch=request.batch)
    spare = usable - sum(base.values())
    speed_share = spare * request.prefer
    options = usable_trees(trees, heads, request)

    def afford(t: TreeOption) -> bool:
        extra = sum(terms_for(want_tokens, t.shape).values())
        return extra - sum(base.values()) <= max(speed_share, 0)

    tree = _choose_tree(options, afford, step_time)
    shape = tree.shape if tree else PLAIN
    nodes, depth = shape.nodes, shape.depth
    terms = terms_for(want_tokens, shape)
    # What is left (the turns share) extends every conversation's KV cache, up to the model's context.
    per_token = kv_bytes(model, request.batch, around_precision(precision, budget.kind)) * KV_TOKEN_GROWTH
    extra_tokens = int((usable - sum(terms.values())) // per_token)
    kv_tokens = min(model.max_context, want_tokens + max(extra_tokens, 0))
    terms = terms_for(kv_tokens, shape)
    while sum(terms.values()) > usable and kv_tokens > want_tokens:  # rounding of the overhead term
        kv_tokens = max(want_tokens, kv_tokens - 64)
        terms = terms_for(kv_tokens, shape)
    turns = max(0, (kv_tokens - request.system_tokens) // request.tokens_per_turn)
    speed = None
    if step_time is not None:
        speed = request.batch * (tree.expected_accepted if tree else 1.0) / step_time(nodes, depth,
                                                                                     tree is not None and tree.grown)
    notes = ()
    if request.system_tokens + request.turns * request.tokens_per_turn > model.max_context:
        notes = (f"{request.turns} turns of {request.tokens_per_turn} tokens exceed the model's "
                 f"{model.max_context}-token context: older turns will leave the context",)
    return Plan(True, budget.kind, precision, heads_count(heads, depth) if tree else 0,
                tree.name if tree else None, nodes, kv_tokens, turns, terms, usable, speed, (), notes,
                batch=request.batch)


def usable_trees(trees: Sequence[TreeOption], heads: HeadsShape | None, request: PlanRequest) -> list[TreeOption]:
    """The candidates a request may take: within its node cap and draftable by ``heads``."""
    return [t for t in trees if t.nodes <= request.max_tree_nodes
            and heads_can_draft(t.depth, heads, grown=t.grown)]


def heads_count(heads: HeadsShape | None, depth: int) -> int:
    return min(heads.num_heads, depth) if heads is not None else 0


def precisions_for(budget: Budget, model: ModelShape | None = None) -> tuple[str, ...]:
    """The precisions a plan may choose on ``budget``'s device, best first. A GPU never runs
    fp32 unasked (bf16 is its native speed at the same quality). A CPU prefers fp32, except
    one with bf16 matrix instructions (AMX-BF16 or AVX512-BF16, ``device.BF16_MATMUL_FLAGS``),
    where bf16 comes first: measured with the default model, bf16's perplexity on the MT-Bench
    text is fp32's within 0.05% (11.061 against 11.056, ``docs/results/quantization_cpu_xeon.json``),
    while its tree nodes are far cheaper, so the planner affords the trees that pay: its
    method ran 1.66× faster in bf16 than in fp32 on a 2-core AMX Xeon (``docs/results/bf16_cpu/``)
    and 1.27× on a 2-core AVX512-BF16 EPYC (``docs/results/bf16_cpu_epyc/``), runs alternating.
    Without them bf16 gains nothing sure on a CPU (one thread on a 2-core AVX2 EPYC: 17.2 tok/s
    against fp32's 16.4, ``docs/results/quantization_cpu.json``; an earlier run on an EPYC
    whose flags were not recorded had its plain steps 2.6× slower than fp32's).

    A model whose file holds 4-bit weights (``ModelShape.stored_bits``: a Q4_0/Q4_1/Q4_K
    GGUF) runs as int4, and only so, on a CPU: int4 in groups of 32 finds a Q4_0/Q4_1 grid
    again, so it holds the file's own weights, not a rounding of them, where fp32 only
    widens them at 8× the bytes each step reads (``runtime/quantize.py``); being the
    smallest, it fits wherever anything does."""
    if budget.kind != "cpu":
        return QUALITY_ORDER[1:]
    if model is not None and model.stored_bits == 4 and int4_fits(model):
        return ("int4",)
    return ("bf16", "fp32") + QUALITY_ORDER[2:] if budget.bf16_matmul else QUALITY_ORDER


def int4_fits(model: ModelShape) -> bool:
    """Every decoder matrix takes the int4 kernels' group of 32 inputs and 16-row packing."""
    return all(i % INT4_GROUP_SIZE == 0 and o % 16 == 0 for o, i in model.layer_linear_params())


def plan(budget: Budget, model: ModelShape, heads: HeadsShape | None, request: PlanRequest,
         trees: Sequence[TreeOption] = (), step_time: StepTime | None = None, *,
         link: HostLink | None = None) -> Plan:
    """Choose precision, tree and KV size for ``request`` on ``budget`` (pure; see module doc).
    ``link``: the host's free RAM and host→device bandwidth; given, a GPU plan that fits at
    no precision streams the layers that do not fit (``_offloaded``) before it is refused."""
    precisions = (request.precision,) if request.precision else precisions_for(budget, model)
    candidates = [_layout(budget, model, heads, request, trees=trees, precision=p, step_time=step_time)
                  for p in precisions]
    fitting = [c for c in candidates if c.fits]
    offload = link is not None and budget.kind in OFFLOAD_KINDS
    if not fitting and offload:
        streamable = [p for p in precisions if p in OFFLOAD_PRECISIONS] or [OFFLOAD_PRECISIONS[0]]  # not fp32
        offloaded = _offloaded(budget, model, heads, request, streamable, trees=trees, step_time=step_time, link=link)
        if offloaded is not None:
            return offloaded
        refused = _refusal(budget, model, heads, request, candidates[-1])
        return replace(refused, suggestions=_offload_reasons(budget, model, heads, request, streamable[-1], link)
                       + refused.suggestions)
    if not fitting:
        return _refusal(budget, model, heads, request, candidates[-1])
    chosen = fitting[-1]  # lowest quality that fits; raise it while that costs nothing
    for better in reversed(fitting[:-1]):
        if better.turns >= chosen.turns and better.tree_nodes >= chosen.tree_nodes:
            chosen = better
        else:
            break
    return chosen


def _offloaded(budget: Budget, model: ModelShape, heads: HeadsShape | None, request: PlanRequest,
               precisions: Sequence[str], *, trees: Sequence[TreeOption], step_time: StepTime | None,
               link: HostLink) -> Plan | None:
    """The best-quality plan at a streamable precision that streams the layers the GPU
    cannot hold (``offload.choose_offload``: resident layers by ``request.prefer``, the KV
    cache beside them, at least the requested turns, then the tree for its time model).
    Without a measured ``step_time`` the compute is taken as free (a transfer-bound
    estimate). None when none fits."""
    usable = int(budget.free_bytes * (1.0 - request.safety_margin))
    kv = KvRange(min(request.system_tokens + request.turns * request.tokens_per_turn, model.max_context),
                 model.max_context)
    options = usable_trees(trees, heads, request)
    for precision in precisions:
        def terms_for(tree: TreeShape, kv_tokens: int, precision: str = precision) -> dict[str, int]:
            return memory_terms(model, heads, precision=precision, kind=budget.kind, kv_tokens=kv_tokens, tree=tree,
                                sampling=request.sampling, batch=request.batch)

        choice = choose_offload(model, precision, usable_bytes=usable, link=link, terms_for=terms_for,
                                compute=batch_step_time(step_time, request.batch) or (lambda nodes, depth, grown=False: 0.0),
                                trees=options, kv=kv, prefer=request.prefer, kind=budget.kind)
        if choice is None:
            continue
        where, tree = choice.layout, choice.tree
        notes = () if step_time else ("no step timing: tokens/s assumes the link, not the compute, bounds a step",)
        return Plan(True, budget.kind, precision, heads_count(heads, tree.depth) if tree else 0,
                    tree.name if tree else None, tree.nodes if tree else 1, choice.kv_tokens,
                    max(0, (choice.kv_tokens - request.system_tokens) // request.tokens_per_turn),
                    choice.device_terms, usable, choice.tokens_per_s * request.batch, (), notes,
                    resident_layers=where.resident_layers, streamed_layers=where.streamed_layers,
                    pinned_host_bytes=where.pinned_bytes, batch=request.batch)
    return None


def _offload_reasons(budget: Budget, model: ModelShape, heads: HeadsShape | None, request: PlanRequest,
                     precision: str, link: HostLink) -> tuple[str, ...]:
    """Why streaming layers at ``precision`` fits neither the GPU nor GPU + RAM, and what would."""
    kv_tokens = min(request.system_tokens + request.turns * request.tokens_per_turn, model.max_context)
    terms = memory_terms(model, heads, precision=precision, kind=budget.kind, kv_tokens=kv_tokens,
                         sampling=request.sampling, batch=request.batch)
    usable = int(budget.free_bytes * (1.0 - request.safety_margin))
    return offload_refusal(model, precision, usable_bytes=usable, link=link, terms=terms, kind=budget.kind)


def _refusal(budget: Budget, model: ModelShape, heads: HeadsShape | None, request: PlanRequest,
             smallest: Plan) -> Plan:
    """Nothing fits: say what would, before anything is loaded."""
    usable = int(budget.free_bytes * (1.0 - request.safety_margin))
    precision = smallest.precision
    fixed = memory_terms(model, heads, precision=precision, kind=budget.kind, kv_tokens=0, sampling=request.sampling,
                         batch=request.batch)
    around = around_precision(precision, budget.kind)
    per_turn = kv_bytes(model, request.tokens_per_turn * request.batch, around)  # a turn of every conversation
    suggestions = []
    room = usable - sum(fixed.values())
    if room > per_turn:
        turns = int(room // (per_turn * KV_TOKEN_GROWTH))
        suggestions.append(f"ask for at most {turns} turns (of {request.tokens_per_turn} tokens) at {precision}"
                           + (f" for each of {request.batch} conversations" if request.batch > 1 else ""))
    want = min(request.system_tokens + request.turns * request.tokens_per_turn, model.max_context)
    conversations = int(room // (kv_bytes(model, want, around) * KV_TOKEN_GROWTH)) if room > 0 else 0
    if 1 <= conversations < request.batch:
        suggestions.append(f"decode fewer conversations at once: {conversations} fit with {request.turns} turns each")
    if request.precision and request.precision != "int4":
        suggestions.append("let the planner choose the precision (int8 / int4 weights)")
    need = sum(smallest.predicted_bytes.values())
    suggestions.append(f"free memory: the plan needs {_gib(need)} but {_gib(usable)} is usable "
                       f"({_gib(budget.free_bytes)} free, {int(request.safety_margin * 100)}% kept back)")
    suggestions.append("use a smaller model")
    return Plan(False, budget.kind, precision, 0, None, 1, 0, 0, smallest.predicted_bytes, usable, None,
                tuple(suggestions), batch=request.batch)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def linear_step_time(t1: float, t_big: float, big: int, draft_level: float = 0.0, heads_step: float = 0.0, *,
                     multi_step: float = 0.0, grow_step: float = 0.0) -> StepTime:
    """Step time from a start-up timing: a forward of 1 and of ``big`` tokens, linear in
    between, plus ``draft_level`` seconds per tree level drafted and, once, ``heads_step``
    for any step that drafts with the heads at all (depth > 0: their context layer, the
    tree's acceptance; a lookup chain alone and plain steps do not pay it), once,
    ``multi_step`` for any step of more than one token (on a GPU a plain step runs each layer
    as fused one-token kernels, ``runtime/token_layer.py``, which a tree's step cannot use),
    and, once, ``grow_step`` for a step on a tree grown each step (``grown``: ``runtime/growth.py``
    picks the nodes from the heads' scores, a pass a fixed tree does not run)."""
    slope = (t_big - t1 - multi_step) / max(big - 1, 1)
    return lambda nodes, depth, grown=False: (t1 + (multi_step + slope * (nodes - 1) if nodes > 1 else 0.0)
                                              + draft_level * depth + (heads_step if depth > 0 else 0.0)
                                              + (grow_step if grown else 0.0))


def specmemo_prior_options(max_depth: int = 4) -> list[TreeOption]:
    """Trees without calibration: SpecMemo's pruned tree cut to each size.

    NOTE: their acceptance is a prior, not a measurement: head j (0-based) right at rank
    r with probability 0.35 × 0.85^j / (r + 1), roughly plain Medusa heads' held-out
    accuracy. Calibrated heads replace it with measured path rates.
    """
    from specmemo_core.runtime.tree import specmemo_pruned_tree

    options: dict[str, TreeOption] = {}
    for n in TREE_SIZES:
        if n == 1:
            continue
        t = specmemo_pruned_tree(levels=max_depth, node_budget=n)
        options.setdefault(t.name, TreeOption(t.name, t.num_nodes, t.depth, prior_expected_accepted(t),
                                              t.widest_drafting_level))
    return list(options.values())


def prior_expected_accepted(tree) -> float:
    """Expected tokens per step of ``tree`` under the uncalibrated prior (see above)."""
    return 1.0 + sum(math.prod(0.35 * 0.85 ** j / (r + 1) for j, r in enumerate(p)) for p in tree.paths)


def tree_options(record: dict | None) -> list[TreeOption]:
    """The candidate trees: the heads' calibrated ones (else SpecMemo's prior), each also
    with a lookup chain (``lookup.py``) of every length in ``LOOKUP_GAIN``, and the chains
    alone (the only speculation for a model without heads); each at the tokens per step
    the calibration walked on its text (``record["tokens_per_step"]``) where it has them,
    else from path rates and the constants. A chain's nodes are charged
    by the step time like any others, so the chain is taken where nodes are nearly free
    (a GPU replaying graphs) and left where they cost more than its extra tokens bring."""
    base = calibrated_options(record) if record else specmemo_prior_options()
    walked = (record or {}).get("tokens_per_step", {})  # measured step by step on the calibration's text
    chained = [TreeOption(f"{t.name}+lookup-{n}", t.nodes + n, t.depth,
                          walked.get(f"{t.name}+lookup-{n}", t.expected_accepted + gain), t.widest, t.grown)
               for t in base for n, gain in LOOKUP_GAIN.items()
               if not t.grown or f"{t.name}+lookup-{n}" in walked]  # a grown tree only at a walked figure
    alone = [TreeOption(f"lookup-{n}", n + 1, 0, walked.get(f"lookup-{n}", accepted), 1)
             for n, accepted in LOOKUP_ALONE.items()]
    return base + chained + alone


def calibrated_options(record: dict, sizes: Sequence[int] = TREE_SIZES) -> list[TreeOption]:
    """Trees of each size built from the heads' calibration (their measured acceptance),
    and the grown trees of each size it walked (``dynamic-N``: a grown tree is offered
    only at the tokens per step measured for it, never at an assumed figure)."""
    from specmemo_core.runtime.calibration import expected_accepted, tree_from_calibration
    from specmemo_core.runtime.tree import load_tree

    rates = {tuple(p): r for p, r in record["paths"]}
    walked = record.get("tokens_per_step", {})
    options = []
    for n in sizes:
        if n <= 1:
            continue
        t = tree_from_calibration(record, n)
        accepted = walked.get(f"calibrated-{n}", expected_accepted(t, rates))
        options.append(TreeOption(f"calibrated-{n}", t.num_nodes, t.depth, accepted, t.widest_drafting_level))
        if f"dynamic-{n}" in walked:
            g = load_tree(f"dynamic-{n}")
            options.append(TreeOption(g.name, g.num_nodes, g.depth, walked[g.name], g.widest_drafting_level, True))
    return options
