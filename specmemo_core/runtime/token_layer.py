"""A decoding step's decoder layer in fused kernels (Triton) around the chunked attention.

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

A step of several tokens (a tree's nodes, a short prompt chunk) may run the same five
steps as tiles on the tensor cores (``Launch.row_tiles``; ``norm_pair_rows``,
``matmul_add_rows``: each weight tile read once for up to 64 tokens), its kernels as many as
a one-token step's and the norms' own two (``norm_scale_rows``: x·g and 1/rms once per token,
``Launch.tile_prenorm``), where cuBLAS's matmuls and the regions around them run about twelve:
for a small 16-bit layer (the default) such a step is bound by launches, not by weight reads,
and a large one (7B) takes wider tiles with more weight loads in flight (``tile_shape``), which
read its weights faster than cuBLAS at 64 rows did. An fp32 step of several tokens keeps cuBLAS's
matmuls and the compiled regions after the attention, but its first half is three kernels: the
norm, the q/k/v matmul and ``rotate_rows`` (1's rotary and cache write, for every token), where
the regions ran seven.

Where: a step over a static cache (its slots a device tensor), fused plain weights
(``DecoderLayer.fuse``) on the same GPU, unbatched, the attention that
``chunked_attention`` runs, Triton there and its kernels answering right (``kernel_probe``).
Anything else (batches, quantized or streamed weights, CPUs) runs the
layer's regions as before. Each sum is over fp32 products in a fixed order (fp32 weights:
IEEE arithmetic throughout), so greedy replies match the trees' in fp32 as cuBLAS's did.
One difference in bf16: the norm's 1/rms scales the matmul's sums (it is one number for the
row, found in the same pass over x), so the normed input is not rounded to bf16 first.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from specmemo_core.runtime import chunked_attention, kernel_probe

if TYPE_CHECKING:
    from specmemo_core.runtime.kv_cache import KVCache
    from specmemo_core.runtime.model import DecoderLayer

FAMILY, FALLBACK = "decoding-step layer kernels", "a decoding step runs the layer's regions"


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
    # where ``pdl`` is on, the attention's two kernels launch so too in a small layer's one-token
    # step, as ``chunked_attention_kernels.dependent_launch`` says (0 none, 1 wait then let the next
    # start, 2 let it start then wait): (1, 1) made the default model's plain step slower on an H100
    # (0.613 ms against 0.585, large_tiles_h100/pdl/)
    pdl_attention: tuple[int, int] = (0, 0)
    # the attention's, its merge's and the tiles' modes in a step of several tokens and in any step
    # of a large layer (past ``tile_layer_bytes``). On an H100, each waiting first and then letting
    # the next start: vicuna-7b's plain step 5.070 ms against 5.117 with none, its medusa-64 step
    # 6.757 against 6.913; the default model's medusa-64 step 1.101 against 1.131
    busy_pdl: tuple[int, int, int] = (1, 1, 1)
    # a step of several tokens through the tile kernels (``norm_pair_rows``, ``matmul_add_rows``):
    # five kernels and the attention's two a layer, where cuBLAS's matmuls, ``rotate_rows`` and
    # the compiled regions run about twelve. None: for 16-bit layers (fp32's IEEE products on the
    # tensor cores are slow); True or False: always or never (tests, timings). On an H100 the
    # default model's medusa-64 step ran 1.63 ms against 1.80 (tile_rows_h100/), vicuna-7b's 7.22
    # against 7.63 with the large layers' tiles below (large_tiles_h100/)
    row_tiles: bool | None = None
    tile_n: int = 16  # weight rows (pairs of them for the norm's kernels) a tile program finishes (32: 10% slower)
    tile_k: int = 0  # input columns it reads at once (also its sums' order); 0: 128 for K ≥ 1,024, else 64
    tile_warps: int = 4
    # its weight loads in flight (3 left the tiles ~25% behind cuBLAS's), fewer where the GPU's
    # shared memory per block holds fewer (``_stages``: a laptop's ~100 KB)
    tile_stages: int = 5
    # a layer past ``tile_layer_bytes`` (its four matmuls' weights) takes wider tiles with more loads
    # in flight: on an H100 a vicuna-7b medusa-64 step ran 7.22 ms with 32 rows and 6 stages, 7.89
    # with 16 and 5 (and 7.63 through cuBLAS); the default model's 7 MB layers: 16 and 5
    tile_layer_bytes: int = 64 << 20
    large_tile_n: int = 32
    large_tile_stages: int = 6
    # a large layer's o_proj and down_proj tiles (``matmul_add_rows``), where they differ (0: as above):
    # their 32 weight rows a program read the tokens' tile twice for each weight byte
    large_add_n: int = 0
    large_add_stages: int = 0
    # a large layer's q/k/v tiles' pairs where they differ (0: ``large_tile_n``): vicuna-7b's 32 pairs
    # make 192 programs, 1.45 of an H100's 132 SMs' waves (16: 384, 2.9 waves; to time it)
    large_qkv_n: int = 0
    # and their stages where they differ (0: ``large_tile_stages``): at 3, two programs fit an SM's
    # shared memory, so all 192 of vicuna-7b's run at once: on an H100 its 64-node chain step ran
    # 5.986 ms against 6.047 (2 stages: 6.172; gate/up at 3 too: 6.837; waves_h100/)
    large_qkv_stages: int = 3
    # the norm's x·g and 1/rms by a kernel of their own before each norm tile kernel (one program a
    # token) instead of inside it, where every program redid them for its rows: on an H100 the
    # default model's medusa-64 step ran 1.197 ms against 1.335 (chain_pdl_h100/scan/)
    tile_prenorm: bool = True
    tile_m: int = 0  # tokens a tile program takes (16, 32 or 64); 0: as few tiles as hold the step's tokens
    # query rows a program of the attention's first kernel scores at most (16, 32 or 64; 0: the widest
    # whose programs fill the GPU's SMs, ``chunked_attention.busy_rows``; the others only to time it)
    attention_block_m: int = 0
    # stages of the attention's slot loop (0: by its rows, ``chunked_attention.STAGES_*``) and slots a
    # program of it attends over (0: ``chunked_attention.SPLIT``; a multiple of its CHUNK), to time them
    attention_stages: int = 0
    attention_split: int = 0
    # a 16-bit tile step's attention writes its chunks' partial outputs in 16 bits (half the traffic
    # between its two kernels: 32 KB a program of 64 rows in fp32) instead of fp32: on an H100
    # vicuna-7b's 64-node chain step ran 6.109 ms against 6.206 (prefetch_h100/levers/)
    attention_partials16: bool = True
    # in a step of several tokens, where PDL launches a kernel while the one ahead drains: the columns of
    # each weight row a tile program asks L2 for before it waits (``prefetch_rows``; 0 none, at most K;
    # GPU only). On an H100 vicuna-7b's 64-node step ran 6.202 ms against 6.268 without (1,024: 6.248;
    # all of K flooded L2: +1 ms), the default model's 20-node step 1.038 against 1.080 (256: 1.028);
    # the attention's programs asking for their keys and values so: slower (prefetch_h100/)
    tile_prefetch: int = 512
    # the tile programs load their ending's inputs (residual, biases, 1/rms, rotary tables, slots) before
    # their loop, not after it, where every program of a wave waited for them at once: on an H100
    # vicuna-7b's 64-node chain step ran 5.950 ms with q/k/v at 3 stages against 5.986 (waves_h100/)
    tile_early_ending: bool = True


LAUNCH = Launch()
TILE_M = 64  # the most tokens a tile program takes (``_tile_m``)


class _Kernels(NamedTuple):
    triton: Any
    norm_pair_matmul: Any
    matmul_add: Any
    rotate_rows: Any
    norm_pair_rows: Any
    matmul_add_rows: Any
    norm_scale_rows: Any
    dependent_launch: bool  # this Triton has programmatic dependent launch


@functools.cache
def _kernels() -> _Kernels | None:
    """Triton and the kernels, or None where Triton is not installed (CPU-only torch)."""
    try:
        import triton

        from specmemo_core.runtime.token_layer_kernels import (gdc_wait, matmul_add, matmul_add_rows, norm_pair_matmul,
                                                               norm_pair_rows, norm_scale_rows, rotate_rows)
    except ImportError:
        return None
    return _Kernels(triton, norm_pair_matmul, matmul_add, rotate_rows, norm_pair_rows, matmul_add_rows,
                    norm_scale_rows, gdc_wait is not None)


@functools.cache
def revision() -> str:
    """A short hash of this module's and its kernels' source (``kernel_probe.source_revision``)."""
    return kernel_probe.source_revision(__file__, "token_layer_kernels.py")


def _dense(weight: object, device: torch.device, dtype: torch.dtype) -> bool:
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.device == device  # type: ignore[union-attr]
            and weight.dtype == dtype and weight.stride(-1) == 1)  # type: ignore[union-attr]


def applies(layer: "DecoderLayer", x: torch.Tensor, cache: "KVCache") -> bool:
    """Whether ``run`` runs this layer's step of the tokens x [T, D] (see the module doc). Only
    fused layers do, whose weights sit still: the one-token kernels read their first weight
    tile before the kernel ahead has finished (a streamed layer, whose weights arrive by
    copies, is never fused: ``offload.py``)."""
    attn, mlp = layer.self_attn, layer.mlp
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):  # a CPU step leaves at once
        return False
    if x.dim() != 2 or attn.qkv is None or mlp.gate_up is None or _kernels() is None:
        return False
    tokens = x.shape[0]
    target = cache.slot_target(attn.layer)
    if (target is None or target[2].shape != (tokens,) or target[0].device != x.device
            or target[0].dtype != x.dtype):
        return False
    weights = (attn.qkv[0], attn.o_proj.weight, mlp.gate_up[0], mlp.down_proj.weight,
               layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if not all(_dense(w, x.device, x.dtype) for w in weights) or not x.is_contiguous():
        return False
    s = attn.spec
    return (chunked_attention.fits(target[0], cache.live_length, rows=s.num_heads // s.num_kv_heads * tokens,
                                   head_dim=s.head_dim, device=x.device, dtype=x.dtype)
            and (not x.is_cuda or kernel_probe.runs_on(FAMILY, x.device, x.dtype, _probe)))


def run(layer: "DecoderLayer", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor,
        cache: "KVCache", *, finish: Callable[..., torch.Tensor], launch: Launch = LAUNCH) -> torch.Tensor:
    """The layer's step for the tokens x [T, D] (cos, signed sin [T, hd]: ``rope_tables``;
    ``bias`` [groups·T, S]: ``attention_bias``): its output [T, D], its k and v in the cache.
    ``finish``: the layer's region after the attention (``LayerRegions.finish``), which a
    step of several tokens runs where it keeps cuBLAS (not ``row_tiles``)."""
    kernels = _kernels()
    tiles = x.shape[0] > 1 and row_tiles(layer, x, launch)
    pdl = kernels.dependent_launch and launch.pdl and x.is_cuda and _dependent_launch(x.device)
    attention_pdl, tiles_pdl = _pdl_modes(layer, x.shape[0], launch) if pdl else ((0, 0), 0)
    if x.shape[0] > 1 and not tiles:
        return finish(layer, _attend_rows(kernels, layer, x, cos=cos, sin=sin, bias=bias, cache=cache), x)
    if tiles:  # the same five steps for T tokens at once: each weight tile read once for them all
        large = _large(layer, launch)
        norm_pairs = functools.partial(_norm_pair_rows, kernels, launch=launch, pdl=tiles_pdl,
                                       shape=tile_shape_of(launch, large=large))
        qkv_pairs = functools.partial(norm_pairs, shape=tile_shape_of(launch, large=large, qkv=True))
        matmul_add = functools.partial(_matmul_add_rows, kernels, launch=launch, pdl=tiles_pdl,
                                       shape=tile_shape_of(launch, large=large, add=True))
    else:
        norm_pairs = qkv_pairs = functools.partial(_norm_pairs, kernels, launch=launch, pdl=pdl)
        matmul_add = functools.partial(_matmul_add, kernels.matmul_add, launch=launch, pdl=pdl)
    attn, mlp, s = layer.self_attn, layer.mlp, layer.self_attn.spec
    h, hkv, hd, t = s.num_heads, s.num_kv_heads, s.head_dim, x.shape[0]
    keys, values, slots = cache.slot_target(attn.layer)  # [Hkv, C, hd] ×2, [T]
    q = torch.empty(h, t, hd, dtype=x.dtype, device=x.device)
    rope = (cos.contiguous(), sin.contiguous(), slots, keys, values, h, hkv)
    qkv_pairs(x, layer.input_layernorm, attn.qkv, q, rope=rope)
    partials = x.dtype if tiles and launch.attention_partials16 and x.element_size() == 2 else torch.float32
    attended = chunked_attention.attend(q.view(hkv, h // hkv * t, hd), keys, values, bias, cache.live_length,
                                        new_tokens=t, groups=h // hkv, pdl=attention_pdl,
                                        block_m=launch.attention_block_m, partials=partials,
                                        stages=launch.attention_stages or None,
                                        split=launch.attention_split or chunked_attention.SPLIT)  # [T, H·hd]
    mid = matmul_add(attended, attn.o_proj, x)
    hidden = torch.empty(t, mlp.gate_up[0].shape[0] // 2, dtype=x.dtype, device=x.device)
    norm_pairs(mid, layer.post_attention_layernorm, mlp.gate_up, hidden, rope=None)
    return matmul_add(hidden, mlp.down_proj, mid)


def _pdl_modes(layer: "DecoderLayer", tokens: int, launch: Launch) -> tuple[tuple[int, int], int]:
    """The attention's two kernels' and the tiles' dependent launch modes for a step of ``tokens``
    of ``layer``: ``Launch.busy_pdl`` for several tokens or a large layer, else ``pdl_attention``."""
    if tokens > 1 or _large(layer, launch):
        attend, merge, tiles = launch.busy_pdl
        return (attend, merge), tiles
    return launch.pdl_attention, 0  # a one-token step has no tiles


def row_tiles(layer: "DecoderLayer", x: torch.Tensor, launch: Launch) -> bool:
    """Whether a step of several tokens x [T, D] of ``layer`` runs as tiles (``Launch.row_tiles``):
    by default in 16 bits, a large layer's (``tile_shape``) for at most one tile of tokens
    (``TILE_M``): a longer prompt chunk would read its weights again for every further tile,
    where cuBLAS reads them once and is bound by arithmetic."""
    if launch.row_tiles is not None:
        return launch.row_tiles
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return x.shape[0] <= TILE_M or not _large(layer, launch)


class TileShape(NamedTuple):
    n: int  # weight rows (pairs for the norm's kernels) a program finishes
    stages: int  # weight loads in flight, at most (``_stages`` takes fewer where they do not fit)


def tile_shape(layer: "DecoderLayer", launch: Launch) -> TileShape:
    """The tiles of ``layer``'s steps (``tile_shape_of``): large ones past ``launch.tile_layer_bytes`` of weights."""
    return tile_shape_of(launch, large=_large(layer, launch))


def tile_shape_of(launch: Launch, *, large: bool, add: bool = False, qkv: bool = False) -> TileShape:
    """The tiles of a layer, ``large`` or not (``add``: o_proj's and down_proj's, ``Launch.large_add_n``;
    ``qkv``: q/k/v's, ``large_qkv_n`` and ``large_qkv_stages``; a small layer's are all alike)."""
    if not large:
        return TileShape(launch.tile_n, launch.tile_stages)
    n, stages = launch.large_tile_n, launch.large_tile_stages
    if add:
        return TileShape(launch.large_add_n or n, launch.large_add_stages or stages)
    if qkv:
        return TileShape(launch.large_qkv_n or n, launch.large_qkv_stages or stages)
    return TileShape(n, stages)


def _large(layer: "DecoderLayer", launch: Launch) -> bool:
    """Whether ``layer`` is a large one (past ``launch.tile_layer_bytes``): its tiles, its prompt
    chunks' matmuls and its dependent launch follow from that (``tile_shape``, ``row_tiles``,
    ``_pdl_modes``)."""
    return _layer_bytes(layer) > launch.tile_layer_bytes


def _layer_bytes(layer: "DecoderLayer") -> int:
    """The bytes of the layer's four (fused) matmuls' weights."""
    weights = (layer.self_attn.qkv[0], layer.self_attn.o_proj.weight, layer.mlp.gate_up[0], layer.mlp.down_proj.weight)
    return sum(w.numel() * w.element_size() for w in weights)


def _stages(shape: TileShape, *, block_m: int, block_k: int, weight_rows: int, x: torch.Tensor) -> int:
    """The tile kernel's stages that fit the GPU (``kernel_probe.fitting_stages``): a tile of the
    tokens and one of the weights each, as Triton buffers them (6 stages of a 7B layer's q/k/v tiles
    ask 192 KB, 5 of the small ones 120)."""
    stage_bytes = (block_m + weight_rows) * block_k * x.element_size()
    return kernel_probe.fitting_stages(shape.stages, stage_bytes=stage_bytes,
                                       shared_bytes=kernel_probe.shared_bytes(x.device))


def _tile_m(tokens: int, launch: Launch) -> int:
    """Tokens a tile program takes: ``launch.tile_m``, else the tensor cores' least (16) up to ``TILE_M``."""
    return launch.tile_m or (16 if tokens <= 16 else (32 if tokens <= 32 else TILE_M))


def _tile_k(launch: Launch, k_cols: int) -> int:
    return launch.tile_k or (128 if k_cols >= 1024 else 64)


def _norm_pair_rows(kernels: _Kernels, x: torch.Tensor, norm: torch.nn.Module, fused: tuple, out: torch.Tensor, *,
                    rope: tuple | None, launch: Launch, shape: TileShape, pdl: int) -> None:
    """``_norm_pairs`` for x [T, D] through ``norm_pair_rows`` (after ``norm_scale_rows`` where
    ``launch.tile_prenorm``): with ``rope`` q into out [H, T, hd] and k, v into the cache, else
    silu(gate)·up into out [T, I]."""
    weight, bias = fused
    (cos, sin, slots, keys, values, heads, kv_heads), (half, group, groups), strides = _ending(x, weight, rope)
    cdiv, block_m = kernels.triton.cdiv, _tile_m(x.shape[0], launch)
    scale = norm.weight
    if launch.tile_prenorm:  # x·g and the 1/rms by a kernel of their own first
        xg, scale = torch.empty_like(x), torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        kernels.norm_scale_rows[(x.shape[0],)](x, norm.weight, xg, scale, x.shape[-1], norm.eps, x.stride(0),
                                               xg.stride(0), BLOCK_D=kernels.triton.next_power_of_2(x.shape[-1]),
                                               PDL=pdl, **chunked_attention.pdl_option(pdl > 0))
        x = xg
    block_k = _tile_k(launch, x.shape[-1])
    stages = _stages(shape, block_m=block_m, block_k=block_k, weight_rows=2 * shape.n, x=x)
    kernels.norm_pair_rows[(groups * cdiv(half, shape.n), cdiv(x.shape[0], block_m))](
        x, scale, weight, weight if bias is None else bias, out, cos, sin, slots, keys, values,
        x.shape[0], x.shape[-1], half, group, norm.eps, x.stride(0), weight.stride(0), cos.stride(0), out.stride(0),
        *strides, heads, kv_heads, BLOCK_M=block_m, PAIRS=shape.n, BLOCK_K=block_k,
        ROPE=rope is not None, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, PDL=pdl,
        PRENORMED=launch.tile_prenorm, EARLY=launch.tile_early_ending, **_prefetch(launch, x, weight.shape[-1], pdl),
        num_warps=launch.tile_warps,
        num_stages=stages, **chunked_attention.pdl_option(pdl > 0))


def _matmul_add_rows(kernels: _Kernels, a: torch.Tensor, linear: torch.nn.Linear, residual: torch.Tensor, *,
                     launch: Launch, shape: TileShape, pdl: int) -> torch.Tensor:
    """residual [T, N] + linear(a [T, K]) through ``matmul_add_rows``."""
    out = torch.empty_like(residual)
    (n, k), tokens = linear.weight.shape, a.shape[0]
    cdiv, block_m, block_k = kernels.triton.cdiv, _tile_m(tokens, launch), _tile_k(launch, k)
    stages = _stages(shape, block_m=block_m, block_k=block_k, weight_rows=shape.n, x=a)
    kernels.matmul_add_rows[(cdiv(n, shape.n), cdiv(tokens, block_m))](
        a, linear.weight, linear.weight if linear.bias is None else linear.bias, residual, out, tokens, n, k,
        a.stride(0), linear.weight.stride(0), residual.stride(0), out.stride(0), BLOCK_M=block_m,
        BLOCK_N=shape.n, BLOCK_K=block_k, HAS_BIAS=linear.bias is not None,
        IEEE=a.dtype == torch.float32, PDL=pdl, EARLY=launch.tile_early_ending, **_prefetch(launch, a, k, pdl),
        num_warps=launch.tile_warps, num_stages=stages, **chunked_attention.pdl_option(pdl > 0))
    return out


def _prefetch(launch: Launch, x: torch.Tensor, k_cols: int, pdl: int) -> dict[str, int]:
    """A tile kernel's PREFETCH and LINE (``Launch.tile_prefetch``, where it waits for the kernel ahead,
    ``pdl``, on a GPU: the interpreter runs no PTX): the columns asked a weight row, a power of two of
    whole 128-byte lines within K."""
    line = 128 // x.element_size()
    if not (launch.tile_prefetch and pdl and x.is_cuda) or k_cols < line:
        return {}
    return {"PREFETCH": max(1 << (min(launch.tile_prefetch, k_cols).bit_length() - 1), line), "LINE": line}


def _attend_rows(kernels: _Kernels, layer: "DecoderLayer", x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor,
                 bias: torch.Tensor, cache: "KVCache") -> torch.Tensor:
    """A step of T > 1 tokens up to o_proj: norm, the fused q/k/v matmul, ``rotate_rows`` (q out,
    k and v into the cache at the step's slots) and the attention: [T, H·hd]."""
    attn, s = layer.self_attn, layer.self_attn.spec
    h, hkv, hd, t = s.num_heads, s.num_kv_heads, s.head_dim, x.shape[0]
    keys, values, slots = cache.slot_target(attn.layer)  # [Hkv, C, hd] ×2, [T]
    qkv = F.linear(layer.input_layernorm(x), *attn.qkv)  # [T, (H + 2·Hkv)·hd]
    q = torch.empty(h, t, hd, dtype=x.dtype, device=x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    kernels.rotate_rows[(t, h + 2 * hkv)](
        qkv, q, cos, sin, slots, keys, values, t, hd // 2, h, hkv, qkv.stride(0), cos.stride(0),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        HALF=kernels.triton.next_power_of_2(hd // 2))
    return chunked_attention.attend(q.view(hkv, h // hkv * t, hd), keys, values, bias, cache.live_length,
                                    new_tokens=t, groups=h // hkv)  # [T, H·hd]


def _ending(x: torch.Tensor, weight: torch.Tensor, rope: tuple | None) -> tuple[tuple, tuple, tuple]:
    """The norm kernels' ending arguments: ``rope`` (cos, sin, slots, keys, values, heads, kv
    heads; x in their place where there is none: they go unread), then the pair count, the
    head dim and the head groups (the programs' first axis: one for gate/up), then the cache's
    strides."""
    if rope is None:
        return (x,) * 5 + (0, 0), (weight.shape[0] // 2, 0, 1), (0, 0, 0, 0)
    keys, values, heads, kv_heads = rope[3], rope[4], rope[5], rope[6]
    return (rope, (keys.shape[-1] // 2, keys.shape[-1], heads + 2 * kv_heads),
            (keys.stride(0), keys.stride(1), values.stride(0), values.stride(1)))


def _norm_pairs(kernels: _Kernels, x: torch.Tensor, norm: torch.nn.Module, fused: tuple, out: torch.Tensor, *,
                rope: tuple | None, launch: Launch, pdl: bool) -> None:
    """out = ``norm_pair_matmul`` over rmsnorm(x [1, D]) and the fused weight (and bias)
    ``fused``: with ``rope`` (cos, sin, slot, keys, values, heads, kv heads) the q/k/v one,
    else the gate/up one."""
    weight, bias = fused
    (cos, sin, slot, keys, values, heads, kv_heads), (half, group, programs), strides = _ending(x, weight, rope)
    kernels.norm_pair_matmul[(programs * kernels.triton.cdiv(half, launch.pairs),)](
        x, norm.weight, weight, weight if bias is None else bias, out, cos, sin, slot, keys, values,
        x.shape[-1], half, group, norm.eps, weight.stride(0), *strides, heads, kv_heads,
        PAIRS=launch.pairs, BLOCK_K=launch.block_k, ROPE=rope is not None, HAS_BIAS=bias is not None, PDL=pdl,
        num_warps=launch.warps, **chunked_attention.pdl_option(pdl))


def _matmul_add(matmul_add, a: torch.Tensor, linear: torch.nn.Linear, residual: torch.Tensor,
                launch: Launch, pdl: bool) -> torch.Tensor:
    """residual [1, N] + linear(a [1, K]): one kernel."""
    out = torch.empty_like(residual)
    n, k = linear.weight.shape
    matmul_add[((n + launch.rows - 1) // launch.rows,)](
        a, linear.weight, linear.weight if linear.bias is None else linear.bias, residual, out, n, k,
        linear.weight.stride(0), BLOCK_N=launch.rows, BLOCK_K=launch.block_k, HAS_BIAS=linear.bias is not None,
        PDL=pdl, num_warps=launch.warps, **chunked_attention.pdl_option(pdl))
    return out


@functools.cache
def _dependent_launch(device: torch.device) -> bool:
    """Whether ``device`` takes programmatic dependent launch: an NVIDIA GPU of compute
    capability 9 or more (Hopper on). Laptops' Ada and Ampere cards and AMD's do not (the
    kernels' ``griddepcontrol`` would not build, and the probe would turn the kernels off)."""
    return supports_dependent_launch(torch.cuda.get_device_capability(device), hip=torch.version.hip is not None)


def supports_dependent_launch(capability: tuple[int, int], *, hip: bool) -> bool:
    return not hip and capability[0] >= 9


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels build and give torch's answer on ``device`` in ``dtype``
    (``kernel_probe``): a small layer (3 query heads over 1 key/value head, head dim 32,
    biases) one token and then three (a chain) over 40 cached slots, against its eager
    regions with SDPA."""
    try:
        got, want = (probe_step(device, dtype, kernels=k) for k in (True, False))
    except Exception as e:  # noqa: BLE001 - any failure to build or launch means: the regions
        return kernel_probe.failed(FAMILY, device, e, FALLBACK)
    # relative to each tensor's largest value: a bf16 output near 16 is off by its last bit at 0.125
    error = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1.0)).item()
                for a, b in zip(got, want))
    return error < 0.02 or kernel_probe.wrong(FAMILY, device, error, FALLBACK)


def probe_step(device: torch.device, dtype: torch.dtype, *, kernels: bool,
               launch: Launch = LAUNCH) -> tuple[torch.Tensor, ...]:
    """The probe's layer steps: the outputs of a one-token step [1, D] and of the three-token step
    after it [3, D], and the cache's keys and values [1, Hkv, C, hd], by ``run`` (``kernels``,
    launched so) or by the layer's eager regions."""
    import dataclasses

    from specmemo_core.runtime.model import (EAGER_REGIONS, DecoderLayer, ModelSpec, attention_bias,
                                             rope_inverse_frequencies, rope_tables)
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
    layer.regions = dataclasses.replace(EAGER_REGIONS, chunked_attention=False, kernels=None)
    cache = StaticKVCache(1, 1, 32, 128, dtype, device)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.commit_prefix(40)  # 40 slots of history
    outs = []
    for tokens in (1, 3):
        positions, mask = cache.prepare(torch.arange(tokens, device=device), None, 128)
        cos, sin = rope_tables(*rope_inverse_frequencies(SimpleNamespace(head_dim=32)), positions, dtype)
        bias = attention_bias(mask, spec, dtype)
        x = torch.randn(tokens, 96, generator=g).to(device, dtype)
        with torch.no_grad():
            outs.append(run(layer, x, cos, sin, bias, cache, finish=layer.regions.finish, launch=launch) if kernels
                        else layer(x, cos, sin, bias, cache))
        cache.commit_prefix(1)  # the one token kept: the three attend over it
    return (*outs, cache.k, cache.v)
