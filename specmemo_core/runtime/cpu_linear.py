"""Linear layers with their weights packed once for oneDNN, for fp32 inference on CPU.

Why: a decoding step multiplies 1–16 token rows by each weight matrix. For such short
inputs PyTorch's default CPU matmul re-lays the whole weight out for its kernel on every
call, so a step reads each weight about twice, and 2–4 rows cost 1.3–1.5× one row.
oneDNN lets the weight be laid out once, ahead of time (what ``torch.compile`` does
with frozen weights on CPU, here without compiling). Measured on a 2-core EPYC with the
default model, fp32, forward plus LM head: 1 token 53.6 → 35.4 ms, 8 tokens 70.1 → 40.1
ms, so a verify over 8 tree nodes costs 1.13× a plain step instead of 1.31×.

The packed layout is inference-only (no autograd) and fp32-only (oneDNN's bf16 path
needs AVX-512 BF16 to pay). A packed LM head tied to the embedding becomes a separate
copy (the embedding lookup needs the plain layout): ``memory.weight_bytes`` counts it.

Beside int4 decoder layers (``quantize.py``) the LM head is held as int8 rows instead
(``Int8RowLinear``): it is a small model's largest matrix (the default model's 49,152 ×
576 is 113 MB in fp32, more than its whole int4 decoder), and ATen's int8 kernel scores
it in 1.6 ms where fp32 takes 9.5 (2-core AVX2 EPYC, one row).
"""

from __future__ import annotations

import torch
from torch import nn

BATCH_HINT = 8  # rows the packed layout is tuned for: a small tree's verify forward


def packing_available() -> bool:
    """True where this torch build has oneDNN and its linear-packing ops."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``nn.Linear``'s inference forward over a weight packed once for oneDNN."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


class Int8RowLinear(nn.Module):
    """``nn.Linear``'s inference forward over int8 weights with one scale per output row
    (symmetric: the largest magnitude of a row maps to 127), through ATen's
    ``_weight_int8pack_mm``. Its input is cast to bf16 (the kernel's fast path takes bf16
    only) and its output back to the input's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        rows = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("scale", scale.bfloat16(), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.rows, self.scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rows"


def _packable(module: nn.Module) -> bool:
    if type(module) is not nn.Linear:
        return False
    w = module.weight  # a torchao-quantized Linear holds a tensor subclass here: not packed
    return type(w) in (torch.Tensor, nn.Parameter) and w.device.type == "cpu" and w.dtype == torch.float32


def pack_linears(root: nn.Module, *, int8_head: bool = False) -> int:
    """Replace every fp32 CPU ``nn.Linear`` under ``root`` by a ``PackedLinear``; returns
    how many. Quantized (torchao) and non-CPU layers are left alone; so is everything
    where oneDNN is missing. ``int8_head``: ``root.lm_head`` becomes an ``Int8RowLinear``
    instead (what an int4 model runs on CPU). Pack last: after this the weights cannot be
    quantized, cast or trained."""
    replaced = 0
    head = getattr(root, "lm_head", None)
    if int8_head and _packable(head):
        root.lm_head = Int8RowLinear(head)
        replaced = 1
    if not packing_available():
        return replaced
    targets = [(parent, name, child) for parent in root.modules()
               for name, child in parent.named_children() if _packable(child)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return replaced + len(targets)
