"""What a 7B-shaped GPU step's parts cost when they run alone, each as one CUDA graph over
every layer (distinct weights and caches per layer, so nothing stays in L2): the weight
matmuls (cuBLAS, and inductor's autotuned kernels with ``--autotune``), and attention over the
cache by each kernel the step could use, for a plain step (1 query) and a tree (``--tree``
nodes, ancestor mask). The difference between their sum and a whole step
(``time_graph_steps.py``) is the rest: norms, rotary, the cache write, launch gaps.

    python scripts/time_step_parts.py [--shape vicuna-7b] [--context 1000] [--span 1024]
        [--tree 64] [--parts matmul,attention] [--autotune] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from statistics import median
from typing import Callable

import torch
import torch.nn.functional as F

from specmemo_core.planning.memory import known_shape
from specmemo_core.runtime.model import attention_bias
from specmemo_core.runtime.static_decoding import StaticKVCache
from specmemo_core.runtime.step import capture_graph


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """Milliseconds per replay of a captured graph, timed by CUDA events (after one replay)."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def graph_ms(run: Callable[[], None], replays: int = 20) -> float:
    """Milliseconds per replay of ``run`` captured as one CUDA graph (after warm-up)."""
    return replay_ms(capture_graph(run, warmup=2)[0], replays)


def layer_matmuls(shape) -> list[tuple[int, int]]:
    """A decoder layer's four weights [N, K] once fused: q/k/v, o_proj, gate/up, down_proj."""
    d, i, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    return [((shape.num_heads + 2 * shape.num_kv_heads) * hd, d), (d, shape.num_heads * hd), (2 * i, d), (d, i)]


def matmul_parts(shape, tokens: int, autotune: bool) -> dict[str, Callable[[], None]]:
    d = shape.hidden_size
    dims = layer_matmuls(shape)
    weights = [[torch.randn(o, k, device="cuda", dtype=torch.bfloat16) * 0.02 for o, k in dims]
               for _ in range(shape.num_layers)]
    head = torch.randn(shape.vocab_size, d, device="cuda", dtype=torch.bfloat16) * 0.02
    xs = {k: torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) for k in {k for _, k in dims}}
    out = {}

    def chain(linear):
        def run():
            for layer in weights:
                for w in layer:
                    linear(xs[w.shape[1]], w)
            linear(xs[d], head)
        return run

    out["cublas"] = chain(F.linear)
    if autotune:
        out["autotuned"] = chain(torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False))
    return out


def tree_ancestors(n: int) -> torch.Tensor:
    """A fixed random tree of n nodes (node 0 the root): [n, n] bool, j an ancestor of i or i."""
    g = torch.Generator().manual_seed(0)
    parent = [0] + [int(torch.randint(0, max(1, i), (1,), generator=g)) for i in range(1, n)]
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parent[i]]
    return anc


def attention_parts(shape, tokens: int, context: int, span: int, with_flex: bool = True,
                    variants: tuple[str, ...] = ()) -> dict[str, Callable[[], None]]:
    """Attention of ``tokens`` new rows (written at slots context..context+T) over ``span`` slots."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    h, hkv, hd, layers = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.num_layers
    g = h // hkv
    keys = [torch.randn(hkv, 4096, hd, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    values = [torch.randn(hkv, 4096, hd, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    q = torch.randn(hkv, g * tokens, hd, device="cuda", dtype=torch.bfloat16)  # our layout: groups stacked
    anc = tree_ancestors(tokens).cuda()
    cache = StaticKVCache(1, hkv, hd, 4096, torch.bfloat16, "cuda")  # its mask, as a step's: context, then the tree
    cache.length_t.fill_(context)
    length = cache.length_t
    mask = cache.prepare(torch.zeros(tokens, dtype=torch.long, device="cuda"), anc, span)[1]  # [T, S]
    bias = attention_bias(mask, shape, torch.bfloat16)  # [g·T, S], as Attention takes it
    out = {}

    def sdpa(backend):
        def run():
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                for k, v in zip(keys, values):
                    F.scaled_dot_product_attention(q[None], k[None, :, :span], v[None, :, :span], attn_mask=bias)
        return run

    from specmemo_core.runtime import chunked_attention

    def chunked(split, warps, stages, bias_reads="tail", merge_rows=None, **more):  # ours
        def run():  # (``runtime/chunked_attention.py``)
            for k, v in zip(keys, values):
                chunked_attention.attend(q, k, v, bias, length, new_tokens=tokens, groups=g, split=split,
                                         warps=warps, stages=stages, tail_bias=bias_reads == "tail",
                                         merge_rows=merge_rows, **more)
        return run
    out["chunked"] = chunked(chunked_attention.SPLIT, chunked_attention.WARPS, None)
    ref = F.scaled_dot_product_attention(q[None], keys[0][None, :, :span], values[0][None, :, :span], attn_mask=bias)[0]
    ref_rows = ref.unflatten(-2, (g, tokens)).movedim(-2, -4).reshape(tokens, h * hd)  # [T, H·hd]
    got = chunked_attention.attend(q, keys[0], values[0], bias, length, new_tokens=tokens, groups=g)
    print(json.dumps({"chunked_vs_sdpa_max_abs": float((got.float() - ref_rows.float()).abs().max())}), flush=True)
    for variant in variants:  # SPLIT:WARPS:STAGES[:all][:MERGE_ROWS][:p16][:mBLOCK_M], to choose the defaults by
        split, warps, stages, *rest = variant.split(":")
        bias_reads = "all" if "all" in rest else "tail"
        merge_rows = next((int(v) for v in rest if v.isdigit()), None)
        more = {"partials": q.dtype} if "p16" in rest else {}  # the partial outputs in q's 16 bits
        more |= {"block_m": int(v[1:]) for v in rest if v[:1] == "m" and v[1:].isdigit()}
        out[f"chunked-{variant}"] = chunked(int(split), int(warps), None if stages == "auto" else int(stages),
                                            bias_reads, merge_rows, **more)
        got = chunked_attention.attend(q, keys[0], values[0], bias, length, new_tokens=tokens, groups=g,
                                       split=int(split), tail_bias=bias_reads == "tail", merge_rows=merge_rows, **more)
        print(json.dumps({"tokens": tokens, f"chunked-{variant}_vs_sdpa_max_abs":
                          float((got.float() - ref_rows.float()).abs().max())}), flush=True)
    out["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    if not with_flex:  # the others, as measured before the chunked kernel
        return out
    for name, backend in (("sdpa-default", None), ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("sdpa-math", SDPBackend.MATH)):
        out[name] = sdpa(backend)

    # flex attention: standard layout [1, H, T, hd] over [1, Hkv, S, hd], the mask from tensors
    qf = torch.randn(1, h, tokens, hd, device="cuda", dtype=torch.bfloat16)
    anc_pad = torch.zeros(tokens, span, dtype=torch.bool, device="cuda")
    anc_pad[:, :tokens] = anc

    def mask_mod(b, hh, qi, kv):
        r = kv - length
        return (r < 0) | ((r >= 0) & (r < tokens) & anc_pad[qi, r.clamp(0, span - 1)])

    block = 128
    q_blocks = (tokens + block - 1) // block
    kv_blocks = span // block
    num = torch.full((1, 1, q_blocks), kv_blocks, dtype=torch.int32, device="cuda")
    idx = torch.arange(kv_blocks, dtype=torch.int32, device="cuda").expand(1, 1, q_blocks, kv_blocks).contiguous()
    block_mask = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(tokens, span))
    flex = torch.compile(flex_attention, dynamic=False)

    def run_flex():
        for k, v in zip(keys, values):
            flex(qf, k[None, :, :span], v[None, :, :span], block_mask=block_mask, enable_gqa=g > 1)
    out["flex"] = run_flex

    # correctness of flex against sdpa on layer 0 (max abs difference)
    ref = F.scaled_dot_product_attention(q[None], keys[0][None, :, :span], values[0][None, :, :span], attn_mask=bias)[0]
    ref = ref.unflatten(-2, (g, tokens)).reshape(h, tokens, hd)  # heads kv·g + j
    got = flex(q.unflatten(-2, (g, tokens)).reshape(1, h, tokens, hd), keys[0][None, :, :span],
               values[0][None, :, :span], block_mask=block_mask, enable_gqa=g > 1)[0]
    print(json.dumps({"flex_vs_sdpa_max_abs": float((got.float() - ref.float()).abs().max())}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="vicuna-7b")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--span", type=int, default=1024)
    ap.add_argument("--tree", type=int, default=64)
    ap.add_argument("--parts", default="matmul,attention")
    ap.add_argument("--autotune", action="store_true")
    ap.add_argument("--no-others", action="store_true", help="attention: ours and cuDNN's only (no flex, math, ...)")
    ap.add_argument("--variants", default="", help="attention: ours at these chunk sizes and launches too, "
                    "SPLIT:WARPS:STAGES[:BIAS] (STAGES auto: by the rows; BIAS all: the bias read at every "
                    "slot, tail: at the step's own only, the default), e.g. 256:4:3,128:4:auto:all")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    shape = known_shape(args.shape)
    results: dict[str, dict] = {}
    for tokens in (1, args.tree):
        parts = {}
        if "matmul" in args.parts:
            parts.update({f"matmul {k}": f for k, f in matmul_parts(shape, tokens, args.autotune).items()})
        if "attention" in args.parts:
            parts.update({f"attention {k}": f for k, f in attention_parts(
                shape, tokens, args.context, args.span, not args.no_others,
                tuple(v for v in args.variants.split(",") if v)).items()})
        for name, run in parts.items():
            try:
                ms = [graph_ms(run) for _ in range(args.repeats)]
            except Exception as e:  # a kernel that cannot run this shape: say which, go on
                print(json.dumps({"tokens": tokens, "part": name, "error": str(e)[:200]}), flush=True)
                continue
            key = f"T={tokens} {name}"
            results[key] = {"median": round(median(ms), 4), "min": round(min(ms), 4), "max": round(max(ms), 4)}
            print(json.dumps({"tokens": tokens, "part": name, **results[key]}), flush=True)
        torch.cuda.empty_cache()
    print(json.dumps({"shape": args.shape, "device": torch.cuda.get_device_name(), "context": args.context,
                      "span": args.span, "ms_per_step_part": results}))


if __name__ == "__main__":
    main()
