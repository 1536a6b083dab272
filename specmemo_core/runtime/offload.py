"""Layer streaming: run a model whose decoder layers do not all fit the device.

The first ``resident`` decoder layers, the embeddings, the final norm, the LM head (and,
outside this module, the KV cache and draft heads) stay on the device. Every other
layer is packed once into one flat block of host memory (page-locked when the device is
a GPU), in the dtype its weights already have. A forward then runs the resident layers and
streams the rest: before streamed layer j runs, its block is copied into staging slot
``j mod slots`` on the device, and layer j+1's copy is in flight while layer j computes.
The last layers' release lets the *next* forward's first copies start at once, so they
travel while the step accepts, commits and the heads draft.

Vocabulary
----------
layer block   one streamed layer's parameters, back to back (``LayerLayout``), 64-byte aligned.
staging slot  one layer block's worth of device memory; ≥ 2 of them rotate.
shell         a ``DecoderLayer`` whose parameters are views into one staging slot: made
              once per streamed layer (it knows its layer index, so it writes its own
              KV-cache layer), it computes with whatever was last copied into its slot.

The copies go through a ``host_link.Link``: a side stream and events on CUDA/ROCm (the
host never waits per layer), synchronous copies on CPU. The model's forward asks
``CausalLM.decoder_layers`` for its layers, so the one decoding step (``step.py``), the
decoders and the engine run a streamed model unchanged.

Quantized weights (torchao's int8 and int4 tensor subclasses) stream in their stored
form: a layer block holds their inner tensors (``__tensor_flatten__``: the int8/uint8
data, scales, zero points), and a shell rebuilds each weight over views of its slot with
``__tensor_unflatten__``, PyTorch's own protocol for such tensors; fewer bytes cross the link.

NOTE: the q/k/v and gate/up fusion (``DecoderLayer.fuse``) is not applied to shells: a
streamed step waits on the link, not on kernel launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from specmemo_core.errors import OffloadError
from specmemo_core.runtime.host_link import Copy, Link, host_buffer, link_for
from specmemo_core.runtime.model import CausalLM, DecoderLayer, ModelSpec

ALIGN = 64  # bytes: every tensor of a layer block starts at a multiple of this


@dataclass(frozen=True)
class Slice:
    """One tensor of a layer block: a parameter, or one inner tensor of a quantized one."""

    name: str  # the parameter's name in the layer, e.g. "self_attn.q_proj.weight"
    part: str | None  # the inner tensor of a tensor subclass ("qdata", "scale", …); None: the parameter
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the block's start

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Wrapped:
    """How to rebuild a tensor-subclass parameter (a torchao quantized weight) from its
    inner tensors: its class, flatten context, size and stride."""

    name: str
    cls: type
    ctx: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _tensors(name: str, p: torch.Tensor) -> list[tuple[str | None, torch.Tensor]]:
    """The plain tensors that hold parameter ``p``: itself, or a subclass's inner tensors."""
    if is_traceable_wrapper_subclass(p):
        parts = [(part, getattr(p, part)) for part in p.__tensor_flatten__()[0]]  # torchao's inner tensors
    else:
        parts = [(None, p)]
    for part, t in parts:
        if type(t) not in (torch.Tensor, nn.Parameter):
            raise OffloadError(f"layer parameter {name} is stored as {type(t).__name__}, which cannot be "
                               "streamed; plan bf16, int8 or int4 weights")
    return parts


@dataclass(frozen=True)
class LayerLayout:
    """Where each tensor of a decoder layer sits in its flat block of bytes."""

    slices: tuple[Slice, ...]
    wrapped: tuple[Wrapped, ...]  # the parameters that are tensor subclasses
    nbytes: int  # the block's size, padding included

    @classmethod
    def of(cls, layer: nn.Module) -> "LayerLayout":
        slices, wrapped, offset = [], [], 0
        for name, p in layer.named_parameters():
            if is_traceable_wrapper_subclass(p):
                wrapped.append(Wrapped(name, type(p), p.__tensor_flatten__()[1], tuple(p.size()), tuple(p.stride())))
            for part, t in _tensors(name, p):
                piece = Slice(name, part, t.dtype, tuple(t.shape), offset)
                slices.append(piece)
                offset += -(-piece.nbytes // ALIGN) * ALIGN
        if any(True for _ in layer.buffers()):
            raise OffloadError("a decoder layer with buffers cannot be streamed; load the model unpacked")
        return cls(tuple(slices), tuple(wrapped), offset)

    def view(self, block: torch.Tensor, piece: Slice) -> torch.Tensor:
        """``piece``'s tensor inside ``block`` (uint8 [nbytes]): a view, no copy."""
        return block[piece.offset:piece.offset + piece.nbytes].view(piece.dtype).view(piece.shape)

    def pack(self, layer: nn.Module, block: torch.Tensor) -> None:
        """Copy ``layer``'s parameters into ``block`` (uint8 [nbytes])."""
        tensors = {(name, part): t for name, p in layer.named_parameters() for part, t in _tensors(name, p)}
        if set(tensors) != {(piece.name, piece.part) for piece in self.slices}:
            raise OffloadError("the decoder layers differ in their parameters; every streamed layer must "
                               "have the same shapes")
        for piece in self.slices:
            p = tensors[piece.name, piece.part]
            if p.dtype != piece.dtype or tuple(p.shape) != piece.shape:
                raise OffloadError(f"layer parameter {piece.name} is {p.dtype} {tuple(p.shape)}, the first "
                                   f"streamed layer's is {piece.dtype} {piece.shape}: layers must match")
            self.view(block, piece).copy_(p.detach())

    def shell(self, spec: ModelSpec, index: int, block: torch.Tensor) -> DecoderLayer:
        """Decoder layer ``index`` whose parameters are views into ``block`` (a staging slot)."""
        with torch.device("meta"):
            shell = DecoderLayer(spec, index)
        views: dict[str, dict[str | None, torch.Tensor]] = {}
        for piece in self.slices:
            views.setdefault(piece.name, {})[piece.part] = self.view(block, piece)
        params = {name: parts[None] for name, parts in views.items() if None in parts}
        for w in self.wrapped:
            params[w.name] = w.cls.__tensor_unflatten__(views[w.name], w.ctx, w.size, w.stride)
        for name, tensor in params.items():
            owner, attr = name.rsplit(".", 1)
            setattr(shell.get_submodule(owner), attr, nn.Parameter(tensor, requires_grad=False))
        from specmemo_core.runtime.quantize import use_int4_cpu_kernel

        use_int4_cpu_kernel(shell)  # CPU int4 weights run as the resident layers' do
        return shell.eval()


class LayerStreamer:
    """Streams layer blocks from host memory through rotating staging slots (see the
    module doc); a ``model.LayerSource``. Copy ``s`` (counting over every forward) is of
    streamed layer ``s mod L``, into slot ``(s mod L) mod slots``; it is sent once the
    layer that last used that slot has run, at most ``slots`` ahead of the compute."""

    def __init__(self, host: torch.Tensor, staging: torch.Tensor, shells: Sequence[nn.Module], link: Link) -> None:
        if staging.shape[0] < 2:
            raise OffloadError("layer streaming needs at least 2 staging buffers (one computes, one fills)")
        self.host = host  # [L, B] uint8: every streamed layer's block, pinned for a GPU
        self.staging = staging  # [slots, B] uint8 on the device
        self.shells = list(shells)  # shell j computes on slot j mod slots
        self.link = link
        self.slots = staging.shape[0]
        self._sent = 0  # copies sent so far
        self._done = 0  # streamed layers run (and their slots released) so far
        self._holder = [-1] * self.slots  # the last copy sent into each slot

    @property
    def pinned_bytes(self) -> int:
        return self.host.numel()

    @property
    def staging_bytes(self) -> int:
        return self.staging.numel()

    def layers(self) -> Iterator[nn.Module]:
        """The streamed layers of one forward, each yielded once its block has arrived (on
        a GPU: once the compute stream waits for it); a slot is released when the caller
        asks for the next layer, i.e. after the layer it held has been enqueued."""
        count = len(self.shells)
        if self._done % count:  # the last forward stopped midway (an error): start afresh
            self._restart()
        for j, shell in enumerate(self.shells):
            self._send_ready()
            slot = j % self.slots
            self.link.wait_arrival(slot)
            yield shell
            self.link.release(slot)
            self._done += 1
        self._send_ready()  # the next forward's first layers: in flight while this step finishes

    def _send_ready(self) -> None:
        """Send every copy whose slot is free, in order, up to ``slots`` ahead."""
        count = len(self.shells)
        while self._sent - self._done < self.slots:
            layer = self._sent % count
            slot = layer % self.slots
            if self._holder[slot] >= self._done:  # its current layer has not run yet
                return
            self.link.send(slot, self.staging[slot], self.host[layer])
            self._holder[slot] = self._sent
            self._sent += 1

    def _restart(self) -> None:
        self.link.drain()
        self._sent = self._done = 0
        self._holder = [-1] * self.slots


def offload_layers(model: CausalLM, *, resident_layers: int, device: torch.device | str, buffers: int = 2,
                   copy: Copy | None = None, prepare: Callable[[nn.Module], None] | None = None) -> LayerStreamer:
    """Keep the first ``resident_layers`` decoder layers and the rest of ``model`` on
    ``device``; move the other layers into one host block each (pinned for a GPU) and
    stream them through ``buffers`` staging slots (``copy``: the link's copy function,
    see ``host_link.link_for``). Call with the weights in their final dtype, in host
    memory, or made one streamed layer at a time by ``prepare(layer)`` just before it is
    packed (a random-weight model built on the GPU: ``plan_check.random_model``); the
    streamed layers' own tensors are dropped (a state dict the caller still holds keeps
    its copy). Returns the streamer, which the model's forward now uses."""
    device = torch.device(device)
    layers = model.model.layers
    if not 0 <= resident_layers < len(layers):
        raise OffloadError(f"resident layers must be between 0 and {len(layers) - 1} for a model of "
                           f"{len(layers)} layers, got {resident_layers}; with all resident, do not offload")
    streamed = list(layers[resident_layers:])
    if prepare is not None:
        prepare(streamed[0])
    layout = LayerLayout.of(streamed[0])
    host = host_buffer((len(streamed), layout.nbytes), device)
    for j, layer in enumerate(streamed):
        if prepare is not None and j:
            prepare(layer)
        layout.pack(layer, host[j])
        layer.to("meta")  # frees the layer's own copy
    model.model.layers = nn.ModuleList(layers[:resident_layers])
    model.to(device)
    staging = torch.empty((buffers, layout.nbytes), dtype=torch.uint8, device=device)
    shells = [layout.shell(model.spec, resident_layers + j, staging[j % buffers]) for j in range(len(streamed))]
    streamer = LayerStreamer(host, staging, shells, link_for(device, buffers, copy))
    model.streamed = streamer
    return streamer
