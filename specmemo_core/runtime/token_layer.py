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
from typing import TYPE_CHECKING

import torch

from specmemo_core.runtime import chunked_attention, kernel_probe

if TYPE_CHECKING:
    from specmemo_core.runtime.kv_cache import KVCache
    from specmemo_core.runtime.model import DecoderLayer

FAMILY, FALLBACK = "one-token layer kernels", "a plain step runs the layer's regions"


@dataclass(frozen=True)
class Launch:
    """How the kernels are launched: ``pairs``, ``rows`` and ``warps`` only split the work,
    ``block_k`` also sets the order each output's sum runs in. Chosen from scans of whole
    vicuna-7b steps on the H200 (``bash docs/results/token_layer_gpu.sh tune``: the regions
    ``compiled@PAIRS:ROWS:BLOCK_K:WARPS[:PDL]`` of ``scripts/time_graph_steps.py``)."""

    pairs: int = 2  # weight-row pairs a program of ``norm_pair_matmul`` finishes
    rows: int = 2  # weight rows a program of ``matmul_add`` finishes
    block_k: int = 1024  # input columns a program reads at once
    warps: int = 4
    # programmatic dependent launch: each kernel's programs start (and read their first weight
    # tile) while the kernel before drains; where Triton and the GPU have it (``_dependent_launch``)
    pdl: bool = True


LAUNCH = Launch()


@functools.cache
def _kernels():
    """Triton and the kernels, or None where Triton is not installed (CPU-only torch)."""
    try:
        import triton

        from specmemo_core.runtime.token_layer_kernels import gdc_wait, matmul_add, norm_pair_matmul
    except ImportError:
        return None
    return triton, norm_pair_matmul, matmul_add, gdc_wait is not None


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
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):  # a CPU step leaves at once
        return False
    if x.dim() != 2 or x.shape[0] != 1 or attn.qkv is None or mlp.gate_up is None or _kernels() is None:
        return False
    target = cache.slot_target(attn.layer)
    if target is None or target[2].shape != (1,) or target[0].device != x.device or target[0].dtype != x.dtype:
        return False
    weights = (attn.qkv[0], attn.o_proj.weight, mlp.gate_up[0], mlp.down_proj.weight,
               layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if not all(_dense(w, x.device, x.dtype) for w in weights) or not x.is_contiguous():
        return False
    s = attn.spec
    q = x.new_empty(s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim)
    return (chunked_attention.supports(q, target[0], cache.live_length)
            and (not x.is_cuda or kernel_probe.runs_on(FAMILY, x.device, x.dtype, _probe)))


def run(layer: "DecoderLayer", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor,
        cache: "KVCache", *, launch: Launch = LAUNCH) -> torch.Tensor:
    """The layer's step for the one token x [1, D] (cos, signed sin [1, hd]: ``rope_tables``;
    ``bias`` [groups, S]: ``attention_bias``): its output [1, D], its k and v in the cache."""
    triton, norm_pair_matmul, matmul_add, pdl = _kernels()
    pdl = pdl and launch.pdl and x.is_cuda and _dependent_launch(x.device)
    attn, mlp, s = layer.self_attn, layer.mlp, layer.self_attn.spec
    h, hkv, hd, d = s.num_heads, s.num_kv_heads, s.head_dim, s.hidden_size
    keys, values, slot = cache.slot_target(attn.layer)  # [Hkv, C, hd] ×2, [1]
    (w_qkv, b_qkv), (w_gu, b_gu) = attn.qkv, mlp.gate_up
    q = torch.empty(h * hd, dtype=x.dtype, device=x.device)
    pairs, block_k, warps = launch.pairs, launch.block_k, launch.warps
    norm_pair_matmul[((h + 2 * hkv) * triton.cdiv(hd // 2, pairs),)](
        x, layer.input_layernorm.weight, w_qkv, w_qkv if b_qkv is None else b_qkv, q, cos, sin, slot, keys, values,
        d, hd // 2, hd, layer.input_layernorm.eps, w_qkv.stride(0), keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1), h, hkv,
        PAIRS=pairs, BLOCK_K=block_k, ROPE=True, HAS_BIAS=b_qkv is not None, PDL=pdl, num_warps=warps, **_pdl(pdl))
    attended = chunked_attention.attend(q.view(hkv, h // hkv, hd), keys, values, bias, cache.live_length,
                                        new_tokens=1, groups=h // hkv)  # [1, H·hd]
    mid = _matmul_add(matmul_add, attended, attn.o_proj, x, launch, pdl)
    inter = w_gu.shape[0] // 2
    hidden = torch.empty(inter, dtype=x.dtype, device=x.device)
    norm_pair_matmul[(triton.cdiv(inter, pairs),)](
        mid, layer.post_attention_layernorm.weight, w_gu, w_gu if b_gu is None else b_gu, hidden, x, x, slot,
        x, x, d, inter, 0, layer.post_attention_layernorm.eps, w_gu.stride(0), 0, 0, 0, 0, 0, 0,
        PAIRS=pairs, BLOCK_K=block_k, ROPE=False, HAS_BIAS=b_gu is not None, PDL=pdl, num_warps=warps, **_pdl(pdl))
    return _matmul_add(matmul_add, hidden, mlp.down_proj, mid, launch, pdl)


def _matmul_add(matmul_add, a: torch.Tensor, linear: torch.nn.Linear, residual: torch.Tensor,
                launch: Launch, pdl: bool) -> torch.Tensor:
    """residual [1, N] + linear(a [K]): one kernel."""
    out = torch.empty_like(residual)
    n, k = linear.weight.shape
    matmul_add[((n + launch.rows - 1) // launch.rows,)](
        a, linear.weight, linear.weight if linear.bias is None else linear.bias, residual, out, n, k,
        linear.weight.stride(0), BLOCK_N=launch.rows, BLOCK_K=launch.block_k, HAS_BIAS=linear.bias is not None,
        PDL=pdl, num_warps=launch.warps, **_pdl(pdl))
    return out


@functools.cache
def _dependent_launch(device: torch.device) -> bool:
    """Whether ``device`` takes programmatic dependent launch: an NVIDIA GPU of compute
    capability 9 or more (Hopper on). Laptops' Ada and Ampere cards and AMD's do not (the
    kernels' ``griddepcontrol`` would not build, and the probe would turn the kernels off)."""
    return supports_dependent_launch(torch.cuda.get_device_capability(device), hip=torch.version.hip is not None)


def supports_dependent_launch(capability: tuple[int, int], *, hip: bool) -> bool:
    return not hip and capability[0] >= 9


def _pdl(pdl: bool) -> dict[str, bool]:
    """The launch option, given only when on (a Triton without it takes no such option)."""
    return {"launch_pdl": True} if pdl else {}


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels build and give torch's answer on ``device`` in ``dtype``
    (``kernel_probe``): a small layer (3 query heads over 1 key/value head, head dim 32,
    biases) one token over 40 cached slots, against its eager regions with SDPA."""
    try:
        got, want = (probe_step(device, dtype, kernels=k) for k in (True, False))
    except Exception as e:  # noqa: BLE001 - any failure to build or launch means: the regions
        return kernel_probe.failed(FAMILY, device, e, FALLBACK)
    # relative to each tensor's largest value: a bf16 output near 16 is off by its last bit at 0.125
    error = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1.0)).item()
                for a, b in zip(got, want))
    return error < 0.02 or kernel_probe.wrong(FAMILY, device, error, FALLBACK)


def probe_step(device: torch.device, dtype: torch.dtype, *, kernels: bool) -> tuple[torch.Tensor, ...]:
    """The probe's layer step: its output [1, D] and the cache's keys and values [1, Hkv, C, hd],
    by ``run`` (``kernels``) or by the layer's eager regions."""
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
    positions, mask = cache.prepare(torch.zeros(1, dtype=torch.long, device=device), None, 128)
    cos, sin = rope_tables(*_rope(device), positions, dtype)
    bias = attention_bias(mask, spec, dtype)
    x = torch.randn(1, 96, generator=g).to(device, dtype)
    with torch.no_grad():
        out = run(layer, x, cos, sin, bias, cache) if kernels else layer(x, cos, sin, bias, cache)
    return out, cache.k, cache.v


def _rope(device: torch.device) -> tuple[torch.Tensor, float]:
    return 1.0 / (10000.0 ** (torch.arange(0, 32, 2, device=device).float() / 32)), 1.0
