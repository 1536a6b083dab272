"""Layer split: one model's decoder layers over several devices, in contiguous segments.

Vocabulary
----------
segment  a run of consecutive decoder layers on one device, with its layers' KV cache
         (``split_cache.SplitCache``) and its own copy of the rope frequencies; a first or
         last segment may hold no layer (a card with only the embedding or the LM head).
home     the last segment's device: the final norm, the LM head, the draft heads, the tree
         buffers and the decoding step's own tensors (root, draft state, the cache's token
         ids and lengths) live there; ``CausalLM.device`` of a split model is its home.
border   where one segment ends and the next begins: the hidden state [..., T, D] moves
         to the next device, once per forward (``CausalLM.forward``).

The embedding sits on the first device. Per forward, the token ids cross to it once; at
each segment the positions and mask cross once and its rope tables and attention bias are
made there, once for all its layers. A tied LM head (SmolLM2's) needs the embedding
matrix on the home device too: when the first and the home device differ it becomes a
copy there (vocab × hidden bytes more, which ``planning.split`` counts).

The same code runs whatever the devices: on a CPU-only machine ``["cpu", "cpu"]`` takes
every border (the moves are no-ops), which is how the CPU tests check that a split model
decodes token for token as the unsplit one; on one GPU ``cuda:0, cuda:0`` does the same.

Why our own placement and not ``accelerate.dispatch_model``: dispatch wraps the forward of
every module of the device map (each decoder layer, the embedding, the norm, the LM head)
in an ``AlignDevicesHook`` that walks the call's arguments and sends each tensor to the
module's device: Python work per layer and per step on a step that, for a small model,
is bound by such host work rather than by arithmetic, and a check (or a copy) of cos, sin
and the bias at every layer where our forward moves them once per segment. Hooks also put
a split model's step outside what our step code controls (CUDA-graph capture on one card
needs every copy in the step to be known). accelerate still decides *where* the layers go
(``planning.split``: ``infer_auto_device_map``); this module only moves modules with
``.to(device)`` once, at load. Measured on the 2-core CPU this was written on (no GPU): an
``AlignDevicesHook`` on each of the 30 decoder layers of a tiny model (hidden 64) took a
1-token forward from 6.7 to 7.7 ms, +32 µs a layer per step, all of it host time that an
eager GPU step also pays (NOTE: not yet measured on a GPU).

NOTE: a split across two different devices steps eagerly (no CUDA graph: one graph cannot
hold kernels of two devices); a split whose segments share one device is captured as usual.
NOTE: a split model does not stream layers from host memory (``offload.py``) yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from specmemo_core.errors import SplitError
from specmemo_core.runtime.model import CausalLM, Segment


@dataclass(frozen=True)
class LayerSplit:
    """Which device runs which decoder layers: segment i holds ``layers[i]`` consecutive
    layers on ``devices[i]`` (the first segment from layer 0)."""

    devices: tuple[torch.device, ...]
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.devices or len(self.devices) != len(self.layers):
            raise SplitError(f"a layer split needs one layer count per device, got {len(self.devices)} devices "
                             f"and {len(self.layers)} counts")
        if any(n < 0 for n in self.layers):
            raise SplitError(f"layer counts of a split cannot be negative, got {list(self.layers)}")

    @classmethod
    def of(cls, devices: Sequence[torch.device | str], layers: Sequence[int]) -> "LayerSplit":
        return cls(tuple(torch.device(d) for d in devices), tuple(layers))

    @classmethod
    def even(cls, devices: Sequence[torch.device | str], num_layers: int) -> "LayerSplit":
        """``num_layers`` over ``devices`` as evenly as possible, the first ones taking one more."""
        n = len(devices)
        if not 1 <= n <= num_layers:
            raise SplitError(f"{num_layers} decoder layers cannot be split over {n} devices; name at most "
                             f"{num_layers} devices")
        return cls.of(devices, [num_layers // n + (i < num_layers % n) for i in range(n)])

    @property
    def num_layers(self) -> int:
        return sum(self.layers)

    @property
    def first(self) -> torch.device:
        return self.devices[0]

    @property
    def home(self) -> torch.device:
        return self.devices[-1]

    @property
    def one_device(self) -> bool:
        """Every segment on the same device (two segments on one card): graph capture works."""
        return len(set(self.devices)) == 1

    def bounds(self) -> list[tuple[int, int]]:
        """Each segment's layers as [start, stop)."""
        out, start = [], 0
        for n in self.layers:
            out.append((start, start + n))
            start += n
        return out

    def describe(self) -> str:
        return ", ".join(f"{d}: layers {a}–{b - 1}" for d, (a, b) in zip(self.devices, self.bounds()))


@dataclass(frozen=True)
class Placement:
    """A placed split: the split and each segment's rope frequencies on its device (copied
    once, at placement). ``CausalLM.placement``."""

    split: LayerSplit
    inv_freqs: tuple[torch.Tensor, ...]  # [hd/2] per segment, on its device

    @property
    def home(self) -> torch.device:
        return self.split.home

    def segments(self, layers: nn.ModuleList) -> Iterator[Segment]:
        for device, (start, stop), inv_freq in zip(self.split.devices, self.split.bounds(), self.inv_freqs):
            yield Segment(device, layers[start:stop], inv_freq)


class BorderEmbedding:
    """The embedding as the home device sees it: token ids [..., T] cross to the embedding's
    device and their vectors [..., T, D] come back (the draft heads that embed the tokens
    they draft, hydra's, run on the home device). Not a module: it holds no weights of its own."""

    def __init__(self, embed: nn.Embedding, home: torch.device) -> None:
        self.embed, self.home = embed, home

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens.to(self.embed.weight.device)).to(self.home)


def split_model(model: CausalLM, split: LayerSplit) -> CausalLM:
    """Place ``model`` (its weights in their final dtype, on any device) over ``split``'s
    devices: the embedding on the first, each segment's layers on its device, the final
    norm and the LM head on the home device (see the module doc). Returns ``model``, whose
    forward now crosses the borders. Call before packing (``cpu_linear``) or fusing the
    projections (``CausalLM.fuse_projections``)."""
    if model.streamed is not None:
        raise SplitError("a model whose layers stream from host memory cannot also be split over devices yet; "
                         "plan it on one device, or on devices that hold every layer")
    if model.placement is not None:
        raise SplitError("this model is already split; load it again to split it otherwise")
    if split.num_layers != model.spec.num_layers:
        raise SplitError(f"the split places {split.num_layers} decoder layers but the model has "
                         f"{model.spec.num_layers}; give the layer counts of every device, summing to it")
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    model.model.embed_tokens.to(split.first)
    for device, (start, stop) in zip(split.devices, split.bounds()):
        for layer in model.model.layers[start:stop]:
            layer.to(device)
    model.model.norm.to(split.home)
    if tied and split.first != split.home:  # the LM head reads the embedding matrix on the home device: a copy
        model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.to(split.home), requires_grad=False)
    elif not tied:
        model.lm_head.to(split.home)
    inv_freq = model.inv_freq
    model.inv_freq = inv_freq.to(split.home)
    model.placement = Placement(split, tuple(inv_freq.to(d) for d in split.devices))
    return model
