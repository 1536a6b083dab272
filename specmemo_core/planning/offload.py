"""Offload as a plan choice: how many decoder layers stay on the GPU, what the streamed
rest costs in pinned host memory, and how fast a step runs (``runtime/offload.py`` runs it).

Memory terms (ℓ = one decoder layer's bytes at the precision, L layers, N resident):
  on the device  the non-layer weights (embeddings, LM head, final norm) + N·ℓ, and
                 ``buffers``·ℓ of staging slots while any layer streams (N < L), beside
                 the plan's other terms (KV cache, heads, tree buffers, activations,
                 overhead, recomputed on these bytes);
  in host RAM    (L − N)·ℓ pinned, checked against free RAM less ``HostLink.ram_margin``.
The runtime's layer blocks align each tensor to 64 bytes: at most 64 bytes per tensor
more than ℓ (under 600 bytes a layer), left out here.

Time model (SpecOffload): a step streams every streamed layer once, (L − N)·ℓ ÷ the
host→device bandwidth, and computes the tree, ``compute(nodes, depth)`` (the resident
model's step time); copies overlap compute, so a step takes the larger of the two. When
the link dominates, a tree's nodes are nearly free and the tree with the most expected
tokens per step wins (large trees); when compute dominates, the resident rule holds.

Resident layers are chosen before the tree, with the largest candidate tree's memory set
aside, so more GPU memory never gives fewer resident layers; the tree is then the one
with the most predicted tokens/s among those that fit beside them.

Turns ↔ speed (``prefer``, the app's slider): every byte the KV cache takes beyond the
requested turns is a byte of layers that must stream instead. With R_max the resident
layers beside the requested turns' cache and R_ctx those beside a cache of the model's
whole context, a plan keeps ⌊R_ctx + prefer·(R_max − R_ctx)⌋ layers (prefer 1: speed,
every layer that fits; 0: turns, the longest cache) and gives the KV cache what is left.
Both ends grow with memory, so the choice stays monotone in it.

NOTE: int8 and int4 layers stream as torchao's inner tensors (``runtime/offload.py``),
checked on CPU; CUDA's int4 packing (tinygemm) is still to be run streamed on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.memory import PLAIN, ModelShape, TreeShape, overhead_bytes, weight_bytes

if TYPE_CHECKING:
    from specmemo_core.planning.planner import StepTime, TreeOption

OFFLOAD_PRECISIONS = ("bf16", "fp16", "int8", "int4")
OFFLOAD_KINDS = ("cuda", "rocm")  # discrete GPUs; CPU and MPS share the host's memory
STAGING_BUFFERS = 2

TermsFor = Callable[[TreeShape, int], "dict[str, int]"]  # the resident plan's memory terms: (tree, KV tokens)


@dataclass(frozen=True)
class HostLink:
    """The host side of an offloaded plan: free RAM and the measured host→device bandwidth
    (``runtime.host_link.host_to_device_bandwidth``)."""

    free_ram_bytes: int
    bandwidth: float  # bytes/s
    ram_margin: float = 0.10  # of free RAM, left to the system and the app

    def __post_init__(self) -> None:
        if self.free_ram_bytes < 0 or not self.bandwidth > 0 or not 0.0 <= self.ram_margin < 1.0:
            raise SpecMemoError(f"host link needs free RAM ≥ 0, bandwidth > 0 and a margin in [0, 1), got "
                                f"{self.free_ram_bytes}, {self.bandwidth}, {self.ram_margin}")

    @property
    def usable_ram(self) -> int:
        return int(self.free_ram_bytes * (1.0 - self.ram_margin))


@dataclass(frozen=True)
class OffloadLayout:
    """Where the layers live: ``resident_layers`` on the device, the rest streamed."""

    resident_layers: int
    streamed_layers: int
    layer_bytes: int  # ℓ
    resident_weight_bytes: int  # on the device: non-layer weights + resident layers
    staging_bytes: int  # on the device: buffers · ℓ (0 when nothing streams)
    pinned_bytes: int  # in host RAM: streamed layers · ℓ, also the bytes each step streams


@dataclass(frozen=True)
class OffloadChoice:
    layout: OffloadLayout
    tree: TreeOption | None  # None: plain decoding
    device_terms: dict[str, int]  # the plan's memory terms on the device, for ``tree``
    step_s: dict[str, float]  # predicted seconds per step of each candidate (by name; "plain")
    tokens_per_s: float
    kv_tokens: int  # the KV cache beside the resident layers (prefer's share, see the module doc)


@dataclass(frozen=True)
class KvRange:
    """The KV cache an offloaded plan may hold: at least the requested turns' tokens,
    at most the model's context."""

    wanted: int
    most: int

    def __post_init__(self) -> None:
        if not 0 < self.wanted <= self.most:
            raise SpecMemoError(f"KV tokens must satisfy 0 < wanted ≤ most, got {self.wanted} and {self.most}")


def layer_bytes(shape: ModelShape, precision: str, device_kind: str = "cuda") -> int:
    """ℓ: one decoder layer's weights (its linears and two norms), by ``weight_bytes``' own rules."""
    one = weight_bytes(replace(shape, num_layers=1), precision, device_kind=device_kind)
    return one - weight_bytes(replace(shape, num_layers=0), precision, device_kind=device_kind)


def layout(shape: ModelShape, precision: str, resident_layers: int, *, buffers: int = STAGING_BUFFERS,
           device_kind: str = "cuda") -> OffloadLayout:
    if not 0 <= resident_layers <= shape.num_layers:
        raise SpecMemoError(f"resident layers must be between 0 and {shape.num_layers}, got {resident_layers}")
    per_layer = layer_bytes(shape, precision, device_kind)
    streamed = shape.num_layers - resident_layers
    total = weight_bytes(shape, precision, device_kind=device_kind)
    return OffloadLayout(resident_layers, streamed, per_layer, total - streamed * per_layer,
                         buffers * per_layer if streamed else 0, streamed * per_layer)


def device_terms(terms: dict[str, int], where: OffloadLayout, kind: str) -> dict[str, int]:
    """The resident plan's ``terms`` with the weights cut to the resident part, the staging
    slots added and the overhead recomputed on the result."""
    out = {k: v for k, v in terms.items() if k != "overhead"}
    out["weights"] = where.resident_weight_bytes
    out["staging"] = where.staging_bytes
    out["overhead"] = overhead_bytes(kind, sum(out.values()))
    return out


def resident_layers_that_fit(shape: ModelShape, precision: str, *, usable_bytes: int, terms: dict[str, int],
                             kind: str = "cuda", buffers: int = STAGING_BUFFERS) -> int | None:
    """The most resident layers whose device terms (``device_terms`` of ``terms``) fit
    ``usable_bytes``; None when not even 0 do. Monotone in ``usable_bytes``."""
    def fits(n: int) -> bool:
        where = layout(shape, precision, n, buffers=buffers, device_kind=kind)
        return sum(device_terms(terms, where, kind).values()) <= usable_bytes

    if fits(shape.num_layers):
        return shape.num_layers
    if not fits(0):
        return None
    lo, hi = 0, shape.num_layers - 1  # fits(lo); find the largest n ≤ hi that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def offloaded_step_time(compute: StepTime, streamed_bytes: int, bandwidth: float) -> StepTime:
    """Seconds per step: the larger of the streamed bytes' transfer and the tree's compute."""
    transfer = streamed_bytes / bandwidth
    return lambda nodes, depth, grown=False: max(transfer, compute(nodes, depth, grown))


def choose_offload(shape: ModelShape, precision: str, *, usable_bytes: int, link: HostLink, terms_for: TermsFor,
                   compute: StepTime, trees: Sequence[TreeOption], kv: KvRange, prefer: float = 1.0,
                   kind: str = "cuda", buffers: int = STAGING_BUFFERS) -> OffloadChoice | None:
    """Resident layers (``prefer``'s share, module doc), the KV cache beside them, then the
    tree with the most predicted tokens/s; None when the plan fits neither the GPU (not
    even 0 resident layers) nor the RAM (``offload_refusal`` says why and what would fit)."""
    biggest = max(trees, key=lambda t: t.nodes, default=None)
    sizing = biggest.shape if biggest else PLAIN  # memory set aside for the largest tree

    def most_layers(tree: TreeShape, tokens: int) -> int | None:
        return resident_layers_that_fit(shape, precision, usable_bytes=usable_bytes, kind=kind, buffers=buffers,
                                        terms=terms_for(tree, tokens))

    r_max = most_layers(sizing, kv.wanted)
    if r_max is None:  # the largest tree does not fit beside 0 layers: smaller trees may
        sizing = PLAIN
        r_max = most_layers(PLAIN, kv.wanted)
    if r_max is None:
        return None
    r_ctx = min(most_layers(sizing, kv.most) or 0, r_max)
    per_layer = layer_bytes(shape, precision, kind)
    fewest = max(0, shape.num_layers - link.usable_ram // per_layer)  # fewer would not fit the RAM
    resident = max(int(r_ctx + prefer * (r_max - r_ctx)), fewest)
    if resident > r_max:
        return None
    where = layout(shape, precision, resident, buffers=buffers, device_kind=kind)

    def fits(tree: TreeShape, tokens: int) -> bool:
        return sum(device_terms(terms_for(tree, tokens), where, kind).values()) <= usable_bytes

    kv_tokens = _most_kv_tokens(lambda tokens: fits(sizing, tokens), kv)
    step = offloaded_step_time(compute, where.pinned_bytes, link.bandwidth)
    fitting = [t for t in trees if fits(t.shape, kv_tokens)]
    step_s = {"plain": step(1, 0), **{t.name: step(t.nodes, t.depth, t.grown) for t in fitting}}
    best = max(fitting, key=lambda t: (t.expected_accepted / step_s[t.name], -t.nodes), default=None)
    if best is not None and best.expected_accepted / step_s[best.name] <= 1.0 / step_s["plain"]:
        best = None
    speed = best.expected_accepted / step_s[best.name] if best else 1.0 / step_s["plain"]
    terms = device_terms(terms_for(best.shape if best else PLAIN, kv_tokens), where, kind)
    return OffloadChoice(where, best, terms, step_s, speed, kv_tokens)


def _most_kv_tokens(fits: Callable[[int], bool], kv: KvRange) -> int:
    """The most KV tokens in ``kv`` that ``fits`` (``kv.wanted`` fits by construction)."""
    lo, hi = kv.wanted, kv.most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def offload_refusal(shape: ModelShape, precision: str, *, usable_bytes: int, link: HostLink,
                    terms: dict[str, int], kind: str = "cuda", buffers: int = STAGING_BUFFERS) -> tuple[str, ...]:
    """Why an offloaded plan at ``precision`` fits neither the GPU nor GPU + RAM (``terms``:
    the resident plan's terms for plain decoding), and what would fit."""
    per_layer, layers = layer_bytes(shape, precision, kind), shape.num_layers
    resident = resident_layers_that_fit(shape, precision, usable_bytes=usable_bytes, terms=terms, kind=kind,
                                        buffers=buffers)
    if resident is None:
        need = sum(device_terms(terms, layout(shape, precision, 0, buffers=buffers, device_kind=kind),
                                kind).values())
        return (f"even with every decoder layer in host RAM, {shape.name} at {precision} needs {_gib(need)} on the "
                f"GPU (embeddings, LM head, KV cache {_gib(terms.get('kv_cache', 0))}, {buffers} staging layers of "
                f"{_gib(per_layer)}) but {_gib(usable_bytes)} is usable",
                "ask for fewer turns (a smaller KV cache), choose a lower precision (int8 or int4 weights), free "
                "GPU memory, or use a smaller model")
    ram_layers = min(layers - resident, link.usable_ram // per_layer)
    pinned = (layers - resident) * per_layer
    return (f"with {resident} of {shape.name}'s {layers} layers on the GPU, the other {layers - resident} need "
            f"{_gib(pinned)} of pinned RAM but {_gib(link.usable_ram)} is usable ({_gib(link.free_ram_bytes)} free, "
            f"{int(link.ram_margin * 100)}% kept back)",
            f"what fits: {resident + ram_layers} of its {layers} layers at {precision} ({resident} on the GPU, "
            f"{ram_layers} in RAM); free {_gib(pinned - link.usable_ram)} more RAM, choose a lower precision "
            f"(int8 or int4 weights), ask for fewer turns (more layers then fit the GPU), or use a smaller model")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
