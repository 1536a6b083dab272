"""Weight-only quantization of our ``CausalLM`` (int8 and 4-bit), through torchao.

Why weight-only: decoding one token at a time is bound by reading the weights, so
storing them in 8 or 4 bits cuts the bytes read (and the memory the planner must find)
while activations, the KV cache and the attention math stay in the activation dtype.

Why torchao: it is PyTorch's own quantization library; its ``quantize_`` swaps each
``nn.Linear.weight`` for a tensor subclass in place, so our forward (``self.q_proj(x)``
…) runs unchanged and no module of ours is replaced.

Which kernels run (torchao 0.18):

- int8, CPU and CUDA: ``Int8WeightOnlyConfig`` — symmetric per output row (one scale a
  row; ``group_size`` is not used). The matmul casts the int8 rows to the activation
  dtype on the fly, so it saves memory, not time, on CPU.
- int4, CPU: torchao's *prototype* ``PrototypeInt4WeightOnlyConfig`` (``Int4OpaqueTensor``,
  ATen's ``_weight_int4pack_mm_for_cpu``). NOTE: the stable ``Int4WeightOnlyConfig`` of
  0.18 has no CPU path (its packings need mslk or CUDA's tinygemm), so the CPU path may
  move in a later torchao; we pin the minor version. The kernel is fast with bf16
  activations only (576 → 1536, one row, 2-core AVX2 EPYC: 106 µs in bf16, 2,026 µs in
  fp32), so each weight is quantized from its float32 values (a 4-bit GGUF's grid is
  found again exactly) with its scales and zero points then stored in bf16, and its layer
  becomes an ``Int4CpuLinear``: bf16 into the kernel, the model's fp32 out of it, so norms,
  rotary, attention and the KV cache stay fp32. Each row of a several-token call is what
  that token alone gets, bit for bit; attention over a tree's slots is not (fp32 sums of
  other lengths), and rounding each matmul's input to bf16 magnifies that, so on the
  default model a speculative reply can leave plain int4's at a near-tie, as in bf16.
- int4, CUDA: stable ``Int4WeightOnlyConfig`` with the tinygemm packing
  (``TILE_PACKED_TO_4D``), which takes bf16 activations only: a float32/float16 model is
  cast to bf16 first. It pads each layer's input width to a multiple of 1024, so narrow
  models save less than 4x over bf16 (SmolLM2-135M: 576 -> 1024); ``weight_bytes`` counts
  the padding.

The embedding and, by default, ``lm_head`` keep the activation dtype: small models (the
default SmolLM2-135M) tie ``lm_head`` to the embedding, so quantizing ``lm_head`` would
*add* a quantized copy next to the full-precision embedding the forward still needs.
Draft heads also read ``lm_head`` and the embedding directly.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.memory import INT4_GROUP_SIZE
from specmemo_core.runtime.host_heap import release_free_heap
from specmemo_core.runtime.model import CausalLM

PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)  # what both int4 kernels (CPU and CUDA tinygemm) take
_FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class QuantSpec:
    """How to store the model's weights.

    ``group_size``: input features sharing one int4 scale/zero point (smaller = more
    accurate, more scale bytes); it must divide every decoder layer's input width. 32 by
    default: GGUF's Q4_0/Q4_1 use blocks of 32 along the same axis, so int4 then re-finds
    the grid a 4-bit GGUF (the default model) was stored on instead of rounding it again
    (measured: 64 raised the default model's perplexity ~30 %, 32 left it unchanged).
    ``quantize_lm_head``: also quantize the LM head (see the module docstring for why
    this is off by default).
    """

    precision: str
    group_size: int = INT4_GROUP_SIZE
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise SpecMemoError(
                f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}"
            )
        if self.group_size not in INT4_GROUP_SIZES:
            raise SpecMemoError(
                f"int4 group size {self.group_size} is not supported; choose one of "
                f"{', '.join(map(str, INT4_GROUP_SIZES))}"
            )

    @property
    def quantized(self) -> bool:
        return self.precision in ("int8", "int4")


@contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao logs a warning for every CUDA-only extension it cannot load on a CPU-only
    torch; those are expected here and would only alarm the user."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _torchao():
    with _quiet_import():
        try:
            import torchao.quantization as aoq
        except ImportError as e:
            raise SpecMemoError(
                "int8/int4 weights need the torchao package: run 'pip install torchao==0.18.*' "
                "in the app's Python environment, or choose fp32/bf16/fp16"
            ) from e
    return aoq


def _cast(model: CausalLM, dtype: torch.dtype) -> None:
    """Cast weights only: ``inv_freq`` stays float32, because bf16 keeps 8 significant
    bits, which would put a RoPE angle at position p off by up to about p/512 radians."""
    inv_freq = model.inv_freq
    model.to(dtype)
    model.inv_freq = inv_freq


def _check_int4_shapes(spec: QuantSpec, targets: dict[str, nn.Linear]) -> None:
    """The int4 kernels need the group size to divide each layer's input width and the
    output width to be a multiple of 16 (CPU packing); say so before torchao asserts."""
    def fits(g: int) -> list[str]:
        return sorted(n for n, m in targets.items() if m.in_features % g or m.out_features % 16)

    bad = fits(spec.group_size)
    if bad:
        ok = [g for g in INT4_GROUP_SIZES if not fits(g)]
        fix = f"use group size {' or '.join(map(str, ok))}" if ok else "use int8"
        raise SpecMemoError(
            f"int4 with group size {spec.group_size} does not fit layer(s) {', '.join(bad[:3])} (input "
            f"width must divide by the group size, output width by 16): {fix}"
        )


def _int4_config(aoq, device: torch.device, group_size: int):
    if device.type == "cpu":
        with _quiet_import():
            from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        return PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)
    if device.type == "cuda":
        from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat

        return aoq.Int4WeightOnlyConfig(
            group_size=group_size, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D,
            set_inductor_config=False,
        )
    raise SpecMemoError(
        f"int4 weights run on CPU and NVIDIA GPUs only, not on {device.type}; use int8 or bf16 there"
    )


def quantize_model(model: CausalLM, spec: QuantSpec) -> CausalLM:
    """Store ``model``'s weights as ``spec`` says, in place, and return it.

    fp32/bf16/fp16 cast every weight; int8/int4 quantize every decoder ``nn.Linear``
    (and ``lm_head`` when asked) and keep the rest in the model's current dtype. Run it
    once, on a freshly loaded model, on the device it will run on.
    """
    if spec.precision in _FLOAT_DTYPES:
        _cast(model, _FLOAT_DTYPES[spec.precision])
        return model
    if any(is_traceable_wrapper_subclass(p) for p in model.parameters()):
        raise SpecMemoError("this model is already quantized; load it again to quantize it differently")
    device = model.device
    if spec.precision == "int4" and device.type == "cuda" and model.dtype != torch.bfloat16:
        _cast(model, torch.bfloat16)  # tinygemm takes bf16 activations only
    targets = {f"model.layers.{name}": m for name, m in model.model.layers.named_modules()
               if isinstance(m, nn.Linear)}
    if spec.quantize_lm_head:
        if model.spec.tie_word_embeddings:
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
        targets["lm_head"] = model.lm_head
    _quantize_linears(model, targets, spec, device)
    use_int4_cpu_kernel(model)
    return model


def quantize_layer(layer: nn.Module, spec: QuantSpec) -> nn.Module:
    """Quantize one decoder layer's ``nn.Linear`` weights in place (``spec`` int8/int4).

    For building a large model a layer at a time (``plan_check.random_model``): the
    whole model never sits in 16 bits at once, so a 7B model can be built in int4 on a
    GPU that could not hold it in bf16."""
    if not spec.quantized:
        raise SpecMemoError(f"quantize_layer takes int8 or int4, not {spec.precision}")
    targets = {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
    device = next(layer.parameters()).device
    _quantize_linears(layer, targets, spec, device)
    use_int4_cpu_kernel(layer)
    return layer


def quantize_on_arrival(spec: QuantSpec, *, dtype: torch.dtype,
                        device: torch.device) -> tuple[torch.dtype, Callable[[str, nn.Module], None]]:
    """The dtype to fill a model in and the ``filled`` callback of ``CausalLM.from_tensors``
    that stores it as ``spec`` says (int8/int4) while it is read: each decoder ``nn.Linear``
    is quantized as soon as its weight arrives, so a model streamed from its file never
    holds more than one float weight matrix beside its quantized ones. The same layers and
    kernels as ``quantize_model`` (LM head: see the module docstring; ``quantize_lm_head``
    is for ``quantize_model``)."""
    if not spec.quantized or spec.quantize_lm_head:
        raise SpecMemoError(f"quantize_on_arrival takes int8 or int4 without the LM head, not {spec}")
    if spec.precision == "int4" and device.type == "cuda":
        dtype = torch.bfloat16  # tinygemm takes bf16 activations only
    decoder, config = "model.layers.", _config(spec, device)  # also lets torch.load read torchao's tensors

    def filled(name: str, module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and name.startswith(decoder):
            _quantize_linears(module, {name: module}, spec, device, config)
            release_free_heap()  # the quantization's temporaries, between the weights kept

    return dtype, filled


def quantized_weights(model: CausalLM) -> dict[str, torch.Tensor]:
    """The decoder's quantized ``nn.Linear`` weights by state-dict name (torchao tensors)."""
    return {f"model.layers.{name}.weight": m.weight for name, m in model.model.layers.named_modules()
            if isinstance(m, nn.Linear) and is_traceable_wrapper_subclass(m.weight)}


class Int4CpuLinear(nn.Linear):
    """An ``nn.Linear`` over a CPU int4 weight with bf16 scales (``_quantize_linears``), run
    by ATen's kernel straight from the weight's packed data: bf16 in, the input's dtype out.

    Why not through the weight's own dispatch: torchao's tensor subclass costs ~48 µs of
    Python a call (576 → 1536, one row: 127 µs against the kernel's 78), about 10 ms of
    a default-model step's 210 matmuls. The weight stays the parameter (same names, state
    dict and cache), its inner tensors read at each call (a streamed layer's are swapped,
    ``offload.py``)."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.group = int(linear.weight.block_size[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        w = self.weight  # NOTE: Int4OpaqueTensor's inner tensors (qdata, scale_and_zero): a third-party probe
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, w.qdata, self.group, w.scale_and_zero).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def use_int4_cpu_kernel(root: nn.Module) -> int:
    """Make every ``nn.Linear`` under ``root`` holding a CPU int4 weight with bf16 scales an
    ``Int4CpuLinear``; returns how many. Run once the model is whole (``quantize_model``,
    ``quantize_layer``, ``model_build.build_model``)."""
    targets = [(parent, name, child) for parent in root.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and is_traceable_wrapper_subclass(child.weight)
               and child.weight.device.type == "cpu" and child.weight.dtype == torch.bfloat16]
    for parent, name, child in targets:
        setattr(parent, name, Int4CpuLinear(child))
    return len(targets)


def _quantize_linears(root: nn.Module, targets: dict[str, nn.Linear], spec: QuantSpec,
                      device: torch.device, config: object | None = None) -> None:
    """``config``: torchao's config for ``spec`` on ``device`` (``_config``), made once by a
    caller that quantizes often."""
    aoq = _torchao()
    if spec.precision == "int4":
        _check_int4_shapes(spec, targets)
    config = config if config is not None else _config(spec, device)
    chosen = set(targets.values())
    with _quiet_import():
        aoq.quantize_(root, config, filter_fn=lambda m, _name: m in chosen)
    if spec.precision == "int4" and device.type == "cpu":
        for linear in chosen:  # a bias stays in the model's dtype (Int4CpuLinear adds it there)
            linear.weight = nn.Parameter(_with_bf16_scales(linear.weight), requires_grad=False)


def _with_bf16_scales(weight: torch.Tensor) -> torch.Tensor:
    """A CPU int4 weight (``Int4OpaqueTensor``) with its scales and zero points in bf16,
    the dtype the kernel's fast path takes its activations in (torchao keeps them in the
    dtype it quantized from)."""
    with _quiet_import():
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor
    if weight.dtype == torch.bfloat16:
        return weight
    return Int4OpaqueTensor(qdata=weight.qdata, scale_and_zero=weight.scale_and_zero.bfloat16(),
                            block_size=weight.block_size, shape=weight.shape, act_pre_scale=None)


def _config(spec: QuantSpec, device: torch.device) -> object:
    """torchao's config for ``spec`` on ``device``. Making it imports the tensor class it
    makes, which registers it with torch.load(weights_only=True) (``quantized_cache``)."""
    aoq = _torchao()
    if spec.precision == "int8":
        return aoq.Int8WeightOnlyConfig(set_inductor_config=False)
    return _int4_config(aoq, device, spec.group_size)


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s own data; a torchao subclass is the sum of its inner tensors
    (packed values, scales, zero points), found through the subclass protocol."""
    if is_traceable_wrapper_subclass(t):
        names, _ctx = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)  # torchao's inner tensors: a third-party probe
    return t.numel() * t.element_size()


def held_bytes(model: nn.Module) -> int:
    """Bytes a module's parameters and buffers hold, measured from the tensors themselves
    (``memory.weight_bytes`` predicts them from the shapes).

    A tied weight (``lm_head`` = embedding) counts once.
    """
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += _tensor_bytes(t)
    return total


def linear_weight_bytes(model: CausalLM) -> int:
    """Bytes of the decoder layers' ``nn.Linear`` weights alone (what int8/int4 shrink)."""
    return sum(
        _tensor_bytes(m.weight) for m in model.model.layers.modules() if isinstance(m, nn.Linear)
    )
