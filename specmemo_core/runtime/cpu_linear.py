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


def _packable(module: nn.Module) -> bool:
    if type(module) is not nn.Linear:
        return False
    w = module.weight  # a torchao-quantized Linear holds a tensor subclass here: not packed
    return type(w) in (torch.Tensor, nn.Parameter) and w.device.type == "cpu" and w.dtype == torch.float32


def pack_linears(root: nn.Module) -> int:
    """Replace every fp32 CPU ``nn.Linear`` under ``root`` by a ``PackedLinear``; returns
    how many. Quantized (torchao) and non-CPU layers are left alone; so is everything
    where oneDNN is missing. Pack last: after this the weights cannot be quantized, cast
    or trained."""
    if not packing_available():
        return 0
    targets = [(parent, name, child) for parent in root.modules()
               for name, child in parent.named_children() if _packable(child)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
