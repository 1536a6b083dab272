"""Layer split as a plan choice: which decoder layers each GPU holds (``runtime/split.py`` runs it).

A model that no single card holds is split by layers over several: the embedding on the
first card, consecutive decoder layers with their KV cache on each, the final norm, LM
head, draft heads and tree buffers on the last. Beside offload (``offload.py``, one card
and host RAM) this is the other answer to a model larger than a card; a plan does one or
the other (NOTE: both together, resident on the cards first and the rest streamed, is
still to come).

accelerate decides the split: ``infer_auto_device_map`` with each card's usable bytes as
``max_memory`` and our decoder layer as the class it must not split. What it places is a
*memory tree*: meta tensors named as our model's modules (``model.embed_tokens``,
``model.layers.i``, ``model.norm``, ``lm_head``), each as large as what the plan puts
beside that module on its card — a layer's weights *and its share of the KV cache*; the LM
head with the draft heads and tree buffers — so the split accounts for the cache as the
weights. What every card holds whatever its layers (the activations of a forward, the
runtime's context and allocator slack, ``memory.overhead_bytes``) is taken from its
``max_memory`` first. accelerate fills the cards in order, so more memory on a card never
gives it fewer layers.

accelerate keeps room on the first card for its largest module, to page modules offloaded
to the CPU back in (its documented rule); we offload nothing through accelerate, so that
room is given back (added to the first card's ``max_memory``).

Planning over several cards (``plan_over_devices``): when one card alone holds the chat
at the precision a split would give, that card's plan is the plan (no border to cross).
Otherwise the chat is planned on the cards' summed memory less what every card after the
first holds again (the planner's precision, tree and KV rules unchanged), then split; when
the pieces do not fit the cards (a layer does not straddle two), the memory is lowered by
what did not fit and the chat planned again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from specmemo_core.errors import SplitError
from specmemo_core.planning.memory import (
    OVERHEAD_FRACTION, ModelShape, activation_bytes, overhead_bytes, weight_bytes,
)
from specmemo_core.planning.offload import layer_bytes

if TYPE_CHECKING:
    from specmemo_core.planning.memory import HeadsShape
    from specmemo_core.planning.planner import Budget, Plan, PlanRequest, StepTime, TreeOption

SPLIT_KINDS = ("cuda", "rocm")  # discrete GPUs; CPU and MPS have one memory


@dataclass(frozen=True)
class Card:
    """One device a plan may split over: its torch name (``cuda:1``) and its memory."""

    device: str
    budget: "Budget"


@dataclass(frozen=True)
class DeviceShare:
    """One card's part of a split plan."""

    device: str  # torch name, e.g. "cuda:1"
    first_layer: int
    layers: int  # decoder layers on it (first_layer … first_layer + layers - 1)
    predicted_bytes: int  # its layers' weights and KV cache, the embedding / LM head, heads and tree it holds,
    # activations and overhead
    usable_bytes: int  # its free memory less the safety margin
    overhead_bytes: int = 0  # of predicted_bytes, the runtime's (context, allocator slack: no tensor of ours)


class SplitDoesNotFitError(SplitError):
    """The plan's pieces do not fit the cards. ``placed``: decoder layers that fit (in order);
    ``shortfall``: bytes that found no card."""

    def __init__(self, message: str, *, placed: int, shortfall: int) -> None:
        self.placed, self.shortfall = placed, shortfall
        super().__init__(message)


@dataclass(frozen=True)
class Pieces:
    """Bytes of each module of the memory tree (see the module doc)."""

    embed: int
    layer: int  # one decoder layer's weights and KV cache
    norm: int
    head: int  # LM head (a copy of the embedding when tied), draft heads, tree buffers
    per_card: int  # what every card holds whatever its layers: activations and the runtime's base overhead

    @classmethod
    def of(cls, shape: ModelShape, precision: str, terms: dict[str, int], *, kind: str) -> "Pieces":
        b = activation_bytes(precision)
        embed, norm = shape.vocab_size * shape.hidden_size * b, shape.hidden_size * b
        rest = weight_bytes(replace(shape, num_layers=0), precision, device_kind=kind) - embed - norm
        head = shape.vocab_size * shape.hidden_size * b if shape.tie_word_embeddings else rest
        kv = -(-terms.get("kv_cache", 0) // max(shape.num_layers, 1))
        return cls(embed, layer_bytes(shape, precision, kind) + kv, norm,
                   head + terms.get("heads", 0) + terms.get("tree_buffers", 0),
                   terms.get("activations", 0) + overhead_bytes(kind, 0))

    def card_bytes(self, *, layers: int, embed: bool, head: bool, kind: str) -> tuple[int, int]:
        """A card's predicted bytes (its modules, activations and overhead) and of them the overhead."""
        modules = layers * self.layer + (self.embed if embed else 0) + ((self.norm + self.head) if head else 0)
        overhead = overhead_bytes(kind, modules)
        return modules + self.per_card - overhead_bytes(kind, 0) + overhead, overhead


class _Held(nn.Module):
    """A module of the memory tree: ``nbytes`` bytes on the meta device (nothing allocated)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.held = nn.Parameter(torch.empty(nbytes, dtype=torch.uint8, device="meta"), requires_grad=False)


class DecoderLayerBytes(_Held):
    """A decoder layer in the memory tree (its weights and KV cache): the class not to split."""


def _memory_tree(pieces: Pieces, num_layers: int) -> nn.Module:
    """Meta tensors named and sized as the modules of our model on their cards (module doc)."""
    root = nn.Module()
    root.model = nn.Module()
    root.model.embed_tokens = _Held(pieces.embed)
    root.model.layers = nn.ModuleList(DecoderLayerBytes(pieces.layer) for _ in range(num_layers))
    root.model.norm = _Held(pieces.norm)
    root.lm_head = _Held(pieces.head)
    return root


def split_layers(shape: ModelShape, precision: str, cards: Sequence[Card], terms: dict[str, int], *,
                 safety_margin: float) -> tuple[DeviceShare, ...]:
    """Each card's decoder layers for a plan of ``terms`` (its KV cache, heads, tree,
    activations) at ``precision``, by ``accelerate.infer_auto_device_map`` over the memory
    tree; the cards that hold nothing are left out. Raises ``SplitDoesNotFitError`` saying
    what would fit when the cards do not hold every piece."""
    from accelerate import infer_auto_device_map

    kind = cards[0].budget.kind
    pieces = Pieces.of(shape, precision, terms, kind=kind)
    usable = [int(c.budget.free_bytes * (1.0 - safety_margin)) for c in cards]
    room = [max(0, int((u - pieces.per_card) / (1.0 + OVERHEAD_FRACTION))) for u in usable]
    room[0] += max(pieces.embed, pieces.layer, pieces.norm, pieces.head)  # accelerate's offload room, given back
    device_map = infer_auto_device_map(_memory_tree(pieces, shape.num_layers), max_memory=dict(enumerate(room)),
                                       no_split_module_classes=[DecoderLayerBytes.__name__], clean_result=False)

    def card_of(name: str):
        parts = name.split(".")
        for n in range(len(parts), 0, -1):  # accelerate may name a whole subtree ("model.layers", "model")
            if ".".join(parts[:n]) in device_map:
                return device_map[".".join(parts[:n])]
        return "disk"

    layer_cards = [card_of(f"model.layers.{i}") for i in range(shape.num_layers)]
    embed_card, head_card = card_of("model.embed_tokens"), card_of("lm_head")
    placed = next((i for i, c in enumerate(layer_cards) if not isinstance(c, int)), shape.num_layers)
    if placed < shape.num_layers or not isinstance(embed_card, int) or not isinstance(head_card, int):
        return _refuse(shape, precision, cards, pieces, usable, placed)
    shares = []
    for index in range(embed_card, head_card + 1):
        mine = [i for i, c in enumerate(layer_cards) if c == index]
        if not mine and index not in (embed_card, head_card):
            continue
        first = mine[0] if mine else (shares[-1].first_layer + shares[-1].layers if shares else 0)
        predicted, overhead = pieces.card_bytes(layers=len(mine), embed=index == embed_card,
                                                head=index == head_card, kind=kind)
        shares.append(DeviceShare(cards[index].device, first, len(mine), predicted, usable[index], overhead))
    return tuple(shares)


def _refuse(shape: ModelShape, precision: str, cards: Sequence[Card], pieces: Pieces, usable: list[int],
            placed: int) -> tuple[DeviceShare, ...]:
    need = pieces.card_bytes(layers=shape.num_layers, embed=True, head=True, kind=cards[0].budget.kind)[0] + (
        len(cards) - 1) * pieces.per_card
    shortfall = max(need - sum(usable), pieces.layer)  # at least a layer: what a border may leave unused
    names = ", ".join(c.device for c in cards)
    raise SplitDoesNotFitError(
        f"{shape.name} at {precision} with this KV cache needs about {_gib(need)} over {names} but "
        f"{_gib(sum(usable))} is usable: they hold {placed} of its {shape.num_layers} decoder layers "
        f"({_gib(pieces.layer)} each with its KV cache); ask for fewer turns, choose a lower precision (int8 or "
        "int4 weights), free memory on the cards, add a card, or use a smaller model",
        placed=placed, shortfall=shortfall)


def plan_over_devices(cards: Sequence[Card], model: ModelShape, heads: "HeadsShape | None", request: "PlanRequest",
                      trees: Sequence["TreeOption"] = (), step_time: "StepTime | None" = None) -> "Plan":
    """The plan over ``cards`` (see the module doc): one card's when one holds the chat at
    the precision a split would give (the card with the most free memory among those; its
    ``Plan.split`` is that one card, every layer on it), else a plan on their summed memory
    with its layers split (``Plan.split``: each card's share); refused (with what would fit)
    when even split they do not hold it. Pure, as ``planner.plan``."""
    from specmemo_core.planning.planner import plan

    if not cards:
        raise SplitError("plan over at least one device")
    if len(cards) == 1 or cards[0].budget.kind not in SPLIT_KINDS:
        return plan(cards[0].budget, model, heads, request, trees, step_time)
    alone = [(card, p) for card in cards if (p := plan(card.budget, model, heads, request, trees, step_time)).fits]
    best = min(alone, key=lambda a: (_quality(a[1].precision), -a[0].budget.free_bytes), default=None)
    split, reason = _split_plan(cards, model, heads, request, trees, step_time)
    if best is not None and (split is None or _quality(best[1].precision) <= _quality(split.precision)):
        card, one = best
        whole = DeviceShare(card.device, 0, model.num_layers, one.total_bytes, one.budget_bytes,
                            one.predicted_bytes.get("overhead", 0))
        return replace(one, split=(whole,), notes=one.notes + (f"fits {card.device} alone: not split",))
    if split is not None:
        return split
    refused = plan(cards[0].budget, model, heads, request, trees, step_time)
    return replace(refused, suggestions=((reason,) if reason else ()) + refused.suggestions)


def _quality(precision: str) -> int:
    from specmemo_core.planning.planner import QUALITY_ORDER

    return QUALITY_ORDER.index(precision) if precision in QUALITY_ORDER else QUALITY_ORDER.index("bf16")


def _split_plan(cards: Sequence[Card], model: ModelShape, heads: "HeadsShape | None", request: "PlanRequest",
                trees: Sequence["TreeOption"], step_time: "StepTime | None") -> "tuple[Plan | None, str]":
    """The chat planned on the cards' summed memory less what the cards after the first hold
    twice (the runtime's base overhead and a forward's activations), then split; planned
    again on less while the split does not fit (module doc). None and the last reason when
    nothing fits."""
    from specmemo_core.planning.planner import Budget, plan

    kind, margin = cards[0].budget.kind, request.safety_margin
    free = sum(c.budget.free_bytes for c in cards)
    total = sum(c.budget.total_bytes for c in cards)
    held_twice, lost, reason = 0, 0, ""
    for _ in range(model.num_layers + 4):
        budget = free - int((held_twice + lost) / (1.0 - margin))
        if budget <= 0:
            break
        whole = plan(Budget(kind, total, budget, " + ".join(c.device for c in cards)), model, heads, request, trees,
                     step_time)
        if not whole.fits:
            break
        twice = (len(cards) - 1) * (overhead_bytes(kind, 0) + whole.predicted_bytes.get("activations", 0))
        if twice > held_twice:
            held_twice = twice
            continue
        try:
            shares = split_layers(model, whole.precision, cards, whole.predicted_bytes, safety_margin=margin)
        except SplitDoesNotFitError as refused:
            reason, lost = str(refused), lost + refused.shortfall
            continue
        note = f"split over {len(shares)} devices: " + describe(shares)
        return replace(whole, split=shares, notes=whole.notes + (note,)), reason
    return None, reason


def describe(shares: Sequence[DeviceShare]) -> str:
    return "; ".join(f"{s.device}: {_layers(s)}, {_gib(s.predicted_bytes)} of {_gib(s.usable_bytes)}" for s in shares)


def _layers(share: DeviceShare) -> str:
    if not share.layers:
        return "no layers"
    return f"layers {share.first_layer}–{share.first_layer + share.layers - 1} ({share.layers})"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
