"""A plain decoding step's decoder layer in four matmul kernels and the attention (Triton).

Why: a one-token step on a GPU reads each weight once in a matrix-vector product, and the
~14 kernels a layer ran (norm, q/k/v, rotary, two cache writes, attention, o_proj and its
split-K reduction, norm, gate/up, SiLU, down, copies) left the H200 idle between them:
a 7B-shaped step took 1.6–1.8× its weight reads. Here each matmul kernel does its
neighbours' work on the way in or out (``token_layer_kernels``):

1. rmsnorm → q/k/v → rotary → q out, k and v into the cache at the step's slot;
2. the chunked attention over the cache (``chunked_attention``, two kernels);
3. o_proj + the residual;
4. rmsnorm → gate/up → silu(gate)·up;
5. down_proj + the residual.

Where: a step of one token (x [1, D]) over a static cache (its slot a device tensor), fused
plain weights (``DecoderLayer.fuse``) on the same GPU, the attention that
``chunked_attention`` runs, Triton there and its kernels answering right (``kernel_probe``).
Anything else (trees, prompts, batches, quantized or streamed weights, CPUs) runs the
layer's regions as before. Each sum is over fp32 products in a fixed order (fp32 weights:
IEEE arithmetic throughout), so greedy replies match the trees' in fp32 as cuBLAS's did.
One difference in bf16: the norm's 1/rms scales the matmul's sums (it is one number for the
row, found in the same pass over x), so the normed input is not rounded to bf16 first.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specmemo_core.runtime import chunked_attention, kernel_probe

if TYPE_CHECKING:
    from specmemo_core.runtime.kv_cache import KVCache
    from specmemo_core.runtime.model import DecoderLayer

FAMILY, FALLBACK = "one-token layer kernels", "a plain step runs the layer's regions"


@dataclass(frozen=True)
class Launch:
    """How the kernels are launched (the arithmetic is the same for any: each output's sum runs
    over the same BLOCK_K-wide tiles only if ``block_k`` stays; tuned on the H200 by
    ``scripts/time_token_layer.py``)."""

    pairs: int = 2  # weight-row pairs a program of ``norm_pair_matmul`` finishes
    rows: int = 2  # weight rows a program of ``matmul_add`` finishes
    block_k: int = 1024  # input columns a program reads at once
    warps: int = 4
    # programmatic dependent launch: each kernel's programs start (and read their first weight
    # tile) while the kernel before drains; where Triton has it (``token_layer_kernels``)
    pdl: bool = True
    # a step of several tokens (a tree; ``norm_pair_mm``, ``mm_add``): pairs and rows a program,
    # input columns a tile (``tl.dot`` wants 16 or more of each)
    many_pairs: int = 16
    many_rows: int = 16
    many_block_k: int = 64


LAUNCH = Launch()
MAX_TOKENS = 64  # the most tokens a step runs through the kernels (one tile of rows); more: the regions


@dataclass(frozen=True)
class _Kernels:
    triton: Any
    norm_pair_matmul: Any  # one token
    matmul_add: Any
    norm_pair_mm: Any  # several
    mm_add: Any
    pdl: bool  # Triton has programmatic dependent launch


@functools.cache
def _kernels() -> _Kernels | None:
    """Triton and the kernels, or None where Triton is not installed (CPU-only torch)."""
    try:
        import triton

        from specmemo_core.runtime import token_layer_kernels as k
    except ImportError:
        return None
    return _Kernels(triton, k.norm_pair_matmul, k.matmul_add, k.norm_pair_mm, k.mm_add, k.gdc_wait is not None)


@functools.cache
def revision() -> str:
    """A short hash of this module's and its kernels' source (``planning.timing``)."""
    here = Path(__file__).resolve()
    text = b"".join(f.read_bytes() for f in (here, here.with_name("token_layer_kernels.py")))
    return hashlib.sha256(text).hexdigest()[:12]


def _dense(weight: object, device: torch.device, dtype: torch.dtype) -> bool:
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.device == device  # type: ignore[union-attr]
            and weight.dtype == dtype and weight.stride(-1) == 1)  # type: ignore[union-attr]


def applies(layer: "DecoderLayer", x: torch.Tensor, cache: "KVCache") -> bool:
    """Whether ``run`` runs this layer's step (see the module doc). Only fused layers do, whose
    weights sit still: the kernels read their first weight tile before the kernel ahead has
    finished (a streamed layer, whose weights arrive by copies, is never fused: ``offload.py``)."""
    attn, mlp = layer.self_attn, layer.mlp
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_TOKENS or attn.qkv is None or mlp.gate_up is None:
        return False
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") or _kernels() is None:
        return False
    target = cache.slot_target(attn.layer)
    if (target is None or target[2].shape != (x.shape[0],) or target[0].device != x.device
            or target[0].dtype != x.dtype):
        return False
    weights = (attn.qkv[0], attn.o_proj.weight, mlp.gate_up[0], mlp.down_proj.weight,
               layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if not all(_dense(w, x.device, x.dtype) for w in weights) or not x.is_contiguous():
        return False
    s = attn.spec
    q = x.new_empty(s.num_kv_heads, s.num_heads // s.num_kv_heads * x.shape[0], s.head_dim)
    return (chunked_attention.supports(q, target[0], cache.live_length)
            and (not x.is_cuda or kernel_probe.runs_on(FAMILY, x.device, x.dtype, _probe)))


def run(layer: "DecoderLayer", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor,
        cache: "KVCache", *, launch: Launch = LAUNCH) -> torch.Tensor:
    """The layer's step for the T tokens x [T, D] (cos, signed sin [T, hd]: ``rope_tables``;
    ``bias`` [groups·T, S]: ``attention_bias``): its output [T, D], its k and v in the cache."""
    kernels = _kernels()
    pdl = kernels.pdl and launch.pdl and x.is_cuda and x.shape[0] == 1
    attn, mlp, s = layer.self_attn, layer.mlp, layer.self_attn.spec
    tokens, h, hkv, hd = x.shape[0], s.num_heads, s.num_kv_heads, s.head_dim
    keys, values, slots = cache.slot_target(attn.layer)  # [Hkv, C, hd] ×2, [T]
    q = torch.empty(h, tokens, hd, dtype=x.dtype, device=x.device)  # as [Hkv, groups·T, hd]: the attention's rows
    rope = (cos, sin, slots, keys, values, h, hkv)
    _norm_pairs(kernels, x, layer.input_layernorm, attn.qkv, q, rope=rope, launch=launch, pdl=pdl)
    attended = chunked_attention.attend(q.view(hkv, h // hkv * tokens, hd), keys, values, bias, cache.live_length,
                                        new_tokens=tokens, groups=h // hkv)  # [T, H·hd]
    mid = _matmul_add(kernels, attended, attn.o_proj, x, launch=launch, pdl=pdl)
    hidden = torch.empty(tokens, mlp.gate_up[0].shape[0] // 2, dtype=x.dtype, device=x.device)
    _norm_pairs(kernels, mid, layer.post_attention_layernorm, mlp.gate_up, hidden, rope=None, launch=launch, pdl=pdl)
    return _matmul_add(kernels, hidden, mlp.down_proj, mid, launch=launch, pdl=pdl)


def _norm_pairs(kernels: _Kernels, x: torch.Tensor, norm: torch.nn.Module, fused: tuple, out: torch.Tensor, *,
                rope: tuple | None, launch: Launch, pdl: bool) -> None:
    """out = the pair kernel over rmsnorm(x [T, D]) and the fused weight (and bias) ``fused``:
    with ``rope`` (cos, sin, slots, keys, values, heads, kv heads) the q/k/v one, else gate/up."""
    weight, bias = fused
    tokens, d = x.shape
    cos, sin, slots, keys, values, heads, kv_heads = rope if rope is not None else (x, x, x, x, x, 0, 0)
    half, group = (keys.shape[-1] // 2, keys.shape[-1]) if rope is not None else (weight.shape[0] // 2, 0)
    groups = heads + 2 * kv_heads if rope is not None else 1
    strides = (keys.stride(0), keys.stride(1), values.stride(0), values.stride(1)) if rope is not None else (0,) * 4
    args = (x, norm.weight, weight, weight if bias is None else bias, out, cos, sin, slots, keys, values)
    sizes = (d, half, group, norm.eps, weight.stride(0), *strides, heads, kv_heads)
    flags = dict(ROPE=rope is not None, HAS_BIAS=bias is not None)
    if tokens == 1:
        kernels.norm_pair_matmul[(groups * kernels.triton.cdiv(half, launch.pairs),)](
            *args, *sizes, PAIRS=launch.pairs, BLOCK_K=launch.block_k, PDL=pdl, **flags, num_warps=launch.warps,
            **_pdl(pdl))
    else:
        kernels.norm_pair_mm[(groups * kernels.triton.cdiv(half, launch.many_pairs),)](
            *args, tokens, *sizes, PAIRS=launch.many_pairs, BLOCK_M=_block_m(tokens), BLOCK_K=launch.many_block_k,
            IEEE=x.dtype == torch.float32, **flags, num_warps=launch.warps)


def _matmul_add(kernels: _Kernels, a: torch.Tensor, linear: torch.nn.Linear, residual: torch.Tensor, *,
                launch: Launch, pdl: bool) -> torch.Tensor:
    """residual [T, N] + linear(a [T, K]): one kernel."""
    out = torch.empty_like(residual)
    n, k = linear.weight.shape
    args = (a, linear.weight, linear.weight if linear.bias is None else linear.bias, residual, out)
    if residual.shape[0] == 1:
        kernels.matmul_add[(kernels.triton.cdiv(n, launch.rows),)](
            *args, n, k, linear.weight.stride(0), BLOCK_N=launch.rows, BLOCK_K=launch.block_k,
            HAS_BIAS=linear.bias is not None, PDL=pdl, num_warps=launch.warps, **_pdl(pdl))
    else:
        kernels.mm_add[(kernels.triton.cdiv(n, launch.many_rows),)](
            *args, residual.shape[0], n, k, a.stride(0), linear.weight.stride(0), BLOCK_M=_block_m(residual.shape[0]),
            BLOCK_N=launch.many_rows, BLOCK_K=launch.many_block_k, HAS_BIAS=linear.bias is not None,
            IEEE=a.dtype == torch.float32, num_warps=launch.warps)
    return out


def _block_m(tokens: int) -> int:
    """Rows a several-token kernel's tile holds: the power of two from 16 that holds them all."""
    return max(16, 1 << (tokens - 1).bit_length())


def _pdl(pdl: bool) -> dict[str, bool]:
    """The launch option, given only when on (a Triton without it takes no such option)."""
    return {"launch_pdl": True} if pdl else {}


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels build and give torch's answer on ``device`` in ``dtype``
    (``kernel_probe``): a small layer (3 query heads over 1 key/value head, head dim 32,
    biases) one token and three over 40 cached slots, against its eager regions with SDPA."""
    try:  # one token and three (a tree's kernels)
        runs = [(probe_step(device, dtype, kernels=True, tokens=t), probe_step(device, dtype, kernels=False, tokens=t))
                for t in (1, 3)]
    except Exception as e:  # noqa: BLE001 - any failure to build or launch means: the regions
        return kernel_probe.failed(FAMILY, device, e, FALLBACK)
    # relative to each tensor's largest value: a bf16 output near 16 is off by its last bit at 0.125
    error = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1.0)).item()
                for got, want in runs for a, b in zip(got, want))
    return error < 0.02 or kernel_probe.wrong(FAMILY, device, error, FALLBACK)


def probe_step(device: torch.device, dtype: torch.dtype, *, kernels: bool, tokens: int = 1) -> tuple[torch.Tensor, ...]:
    """The probe's layer step of ``tokens`` (a causal chain): its output [T, D] and the cache's
    keys and values [1, Hkv, C, hd], by ``run`` (``kernels``) or by the layer's eager regions."""
    import dataclasses

    from specmemo_core.runtime.model import EAGER_REGIONS, DecoderLayer, ModelSpec, attention_bias, rope_tables
    from specmemo_core.runtime.static_decoding import StaticKVCache

    spec = ModelSpec(model_type="qwen2", vocab_size=8, hidden_size=96, intermediate_size=160, num_layers=1,
                     num_heads=3, num_kv_heads=1, head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-5,
                     qkv_bias=True, o_bias=True, mlp_bias=True, max_position_embeddings=128)
    g = torch.Generator().manual_seed(0)
    layer = DecoderLayer(spec, 0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "layernorm" in name else 0.0))
    layer = layer.to(device, dtype)
    layer.fuse()
    layer.regions = dataclasses.replace(EAGER_REGIONS, chunked_attention=False, one_token_launch=None)
    cache = StaticKVCache(1, 1, 32, 128, dtype, device)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.length, cache.length_t = 40, torch.tensor(40, device=device)
    positions, mask = cache.prepare(torch.arange(tokens, device=device), None, 128)
    cos, sin = rope_tables(*_rope(device), positions, dtype)
    bias = attention_bias(mask, spec, dtype)
    x = torch.randn(tokens, 96, generator=g).to(device, dtype)
    with torch.no_grad():
        out = run(layer, x, cos, sin, bias, cache) if kernels else layer(x, cos, sin, bias, cache)
    return out, cache.k, cache.v


def _rope(device: torch.device) -> tuple[torch.Tensor, float]:
    return 1.0 / (10000.0 ** (torch.arange(0, 32, 2, device=device).float() / 32)), 1.0
