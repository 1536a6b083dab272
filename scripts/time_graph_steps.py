"""Milliseconds per greedy step of the static decoder, eager and as CUDA graphs, on a
random-weight model of a known shape (no weights to carry to a GPU machine); with
``--kernels``, how many GPU kernels one step launches and where their time goes.

Random heads accept ~nothing, so this times the step itself: what a tree of N nodes
costs against a plain step. Speed = accepted tokens per step / step time; with the
accepted lengths of real heads (``specmemo eval-acceptance``) it predicts tokens/s.

    python scripts/time_graph_steps.py [--shape smollm2-135m] [--dtype bf16] [--steps 200]
        [--modes eager,graphs] [--heads DIR] [--no-fuse] [--compile] [--regions eager,compiled --repeats 3] [--topk-chunks 0,512 --repeats 3] [--kernels] [--draft-vocab N] [--context N] [--capacity N]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from pathlib import Path

import torch

from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.runtime.heads import load_heads, random_heads
from specmemo_core.planning.memory import known_shape
from specmemo_core.planning.plan_check import random_model
from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache
from specmemo_core.runtime.step import STEP_PHASES as PHASES
from specmemo_core.runtime.step import GreedyAcceptance, StepUnit
from specmemo_core.runtime.engine import resolve_tree


def _busiest(events, count: int = 15) -> list:
    """Kernels by name (a step's, or a phase's): (name, launches, GPU µs), the busiest ``count``."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name[:60], []).append(e.device_time_total)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:count]
    return [(name, len(us), round(sum(us), 1)) for name, us in top]


def count_kernels(model, heads, tree, context: int = 1000, capacity: int = 4096) -> int:
    """GPU kernels launched by one greedy step unit, run uncaptured under the profiler
    (printing where their time goes; the step's one host read included)."""
    decoder = StaticDecoder(model, new_static_cache(model, capacity), heads, tree)
    prompt = torch.randint(0, model.spec.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    next(decoder.generate(prompt, GenerationConfig(max_new_tokens=2)))  # prefill
    buffers = decoder._buffers if tree is not None else decoder._single
    n = buffers.depths.shape[0]
    step = StepUnit(decoder.parts, buffers, GreedyAcceptance(), span=decoder.cache.span_for(n))  # eager
    for _ in range(3):  # warm up
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()  # its phases under profiler ranges (``step.STEP_PHASES``)
        torch.cuda.synchronize()
    # the operators that launch kernels, by calls and by GPU time: where a tree step's extra
    # kernels and microseconds come from
    ops = [(e.key, e.count, round(e.self_device_time_total, 1)) for e in prof.key_averages()
           if e.self_device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CPU]
    print(json.dumps({"ops_by_calls": sorted(ops, key=lambda o: -o[1])[:30],
                      "ops_by_us": sorted(ops, key=lambda o: -o[2])[:30]}), flush=True)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = {e.name: e.time_range for e in events if e.name in PHASES}  # each phase's span on the GPU
    kernels = [e for e in events if e.name not in PHASES]
    # kernels and their GPU µs, by the phase they started in
    inside = {name: [e for e in kernels if span.start <= e.time_range.start < span.end]
              for name, span in spans.items()}
    phases = {name: [len(es), round(sum(e.device_time_total for e in es), 1)] for name, es in inside.items()}
    print(json.dumps({"kernel_us_total": round(sum(e.device_time_total for e in kernels), 1),
                      "phases_us": phases,
                      "top": _busiest(kernels, 40),
                      "by_phase": {name: _busiest(es) for name, es in inside.items()}}), flush=True)
    return len(kernels)


def time_steps(model, heads, tree, graphs: bool, steps: int, *, context: int = 1000, capacity: int = 4096) -> float:
    decoder = StaticDecoder(model, new_static_cache(model, max(capacity, context + 2 * steps * 5 + 64)), heads, tree,
                            graphs=graphs)
    decoder.capture()  # every span's unit now: a step that reaches a longer span must not time its capture
    prompt = torch.randint(0, model.spec.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    config = GenerationConfig(max_new_tokens=steps)
    for _ in decoder.generate(prompt, GenerationConfig(max_new_tokens=20)):  # warm-up
        pass
    decoder.reset()
    stream = decoder.generate(prompt, config)
    next(stream)  # prefill
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t0, n = time.perf_counter(), 0
    for _ in stream:
        n += 1
    sync()
    return (time.perf_counter() - t0) / n * 1e3


H200_BYTES_PER_S = 4.8e12  # HBM3e, as NVIDIA rates it


def weight_read_floor_ms(shape, bytes_per_s: float = H200_BYTES_PER_S) -> float:
    """A bf16 step's floor: every decoder weight and the LM head read once (the embedding
    only gives one row), at the memory's rated speed."""
    d, i, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    layer = d * (shape.num_heads + 2 * shape.num_kv_heads) * hd + shape.num_heads * hd * d + 3 * d * i
    return (shape.num_layers * layer + shape.vocab_size * d) * 2 / bytes_per_s * 1e3


def named_tree(name: str, heads: str):
    """The tree ``--trees`` names (None for "single"); calibrated ones from ``--heads``' calibration."""
    return None if name == "single" else resolve_tree(name, Path(heads) if heads else None)


def step_heads(shape, model, device: str, path: str = "", draft_vocab: int = 0):
    """What a tree step drafts with: trained heads from ``path`` (of ``shape``'s sizes, with
    their drafting vocabulary), else random hydra heads with a context layer, drafting among
    ``draft_vocab`` tokens (0: the whole vocabulary)."""
    if path:
        heads = load_heads(path, shape.hidden_size, shape.vocab_size, dtype=model.dtype, device=device)
    else:
        heads = random_heads(4, shape.hidden_size, shape.vocab_size, kind="hydra", context=(
            shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim),
            draft_vocab=min(draft_vocab, shape.vocab_size)).to(device=device, dtype=model.dtype)
    heads.use_draft_vocab(model.lm_head.weight)
    if heads.context is not None and device != "cpu":
        heads.context.fuse()  # as the engine does on a GPU
    return heads


def region_kind(kinds: dict, kind: str):
    """The ``LayerRegions`` that ``--regions`` names ``kind`` (``kinds``: eager and compiled)."""
    from specmemo_core.runtime import token_layer
    from specmemo_core.runtime.model import compiled_regions

    if kind in kinds:
        return kinds[kind]
    if kind.endswith("+lt"):  # the same regions; alternate_regions picks cuBLASLt for them
        return region_kind(kinds, kind.removesuffix("+lt"))
    if kind.endswith("-noglue"):  # the same regions; alternate_regions turns the step's glue kernels off
        return region_kind(kinds, kind.removesuffix("-noglue"))
    if kind.endswith("-nopicks"):  # the same regions; alternate_regions turns the picks kernel off
        return region_kind(kinds, kind.removesuffix("-nopicks"))
    if kind.endswith("-nodraft"):  # the same regions; alternate_regions turns the drafting kernels off
        return region_kind(kinds, kind.removesuffix("-nodraft"))
    if kind.endswith("-notables"):  # the same regions; alternate_regions turns the tables kernel off
        return region_kind(kinds, kind.removesuffix("-notables"))
    if kind.endswith("-ctxregions"):  # the same regions; the heads' context layer runs its own (no token_layer)
        return region_kind(kinds, kind.removesuffix("-ctxregions"))
    if kind.endswith("-sdpa"):  # attention by SDPA instead of the chunked kernel (and no one-token kernels)
        return dataclasses.replace(kinds[kind.removesuffix("-sdpa")], chunked_attention=False)
    if kind.endswith("-prenorm"):  # the tiles' norm (x·g, 1/rms) by a kernel of its own first (the default)
        return dataclasses.replace(kinds[kind.removesuffix("-prenorm")], kernels=token_layer.Launch(tile_prenorm=True))
    if kind.endswith("-innernorm"):  # the tiles' norm inside each norm tile kernel's programs (before session 28)
        return dataclasses.replace(kinds[kind.removesuffix("-innernorm")],
                                   kernels=token_layer.Launch(tile_prenorm=False))
    if "-am" in kind:  # e.g. compiled-am16: the attention's first kernel at most 16 rows a program
        base, most = kind.split("-am")
        return dataclasses.replace(kinds[base], kernels=token_layer.Launch(attention_block_m=int(most)))
    if kind.endswith("}"):  # e.g. compiled{tile_prefetch=512;large_add_n=64}: token_layer.Launch's fields so
        base, fields = kind[:-1].split("{")
        return dataclasses.replace(kinds[base], kernels=launch_with(fields))
    if "-pf:" in kind:  # e.g. compiled-pf:512: the tiles' weight columns asked of L2 before each waits
        base, cols = kind.split("-pf:")  # for the kernel ahead (Launch.tile_prefetch)
        return dataclasses.replace(kinds[base], kernels=launch_with(f"tile_prefetch={cols}"))
    if "-pdl:" in kind:  # e.g. compiled-pdl:2:1:0: the attention's, its merge's and the tiles' dependent launch
        base, modes = kind.split("-pdl:")
        attend, merge, tiles = (int(v) for v in modes.split(":"))
        return dataclasses.replace(kinds[base], kernels=token_layer.Launch(  # every step's, one token or several
            pdl_attention=(attend, merge), busy_pdl=(attend, merge, tiles)))
    if kind.endswith("-notiles"):  # steps of several tokens through cuBLAS and the regions, never the tiles
        return dataclasses.replace(kinds[kind.removesuffix("-notiles")], kernels=token_layer.Launch(row_tiles=False))
    if "#" in kind:  # e.g. compiled#32:128:4:5[:16]: always the tile kernels, launched so (tile_n:tile_k:warps:stages[:tile_m])
        base, launch = kind.split("#")  # for every layer, small or large
        n, k, warps, stages, *m = (int(v) for v in launch.split(":"))
        return dataclasses.replace(kinds[base], kernels=token_layer.Launch(
            row_tiles=True, tile_n=n, tile_k=k, tile_warps=warps, tile_stages=stages, tile_m=m[0] if m else 0,
            large_tile_n=n, large_tile_stages=stages))
    if "%" in kind:  # e.g. compiled%64:6: a large layer's o_proj and down_proj tiles (rows:stages), the rest as is
        base, launch = kind.split("%")
        n, stages = (int(v) for v in launch.split(":"))
        return dataclasses.replace(kinds[base], kernels=token_layer.Launch(large_add_n=n, large_add_stages=stages))
    if kind.endswith("-regions"):  # plain steps through the regions, not token_layer's kernels
        return dataclasses.replace(kinds[kind.removesuffix("-regions")], kernels=None)
    if "@" in kind:  # e.g. compiled@4:4:512:4: token_layer's kernels launched so (pairs:rows:block_k:warps)
        base, launch = kind.split("@")
        pairs, rows, block_k, warps, *pdl = (int(v) for v in launch.split(":"))  # [:0] without PDL
        return dataclasses.replace(kinds[base], kernels=token_layer.Launch(
            pairs=pairs, rows=rows, block_k=block_k, warps=warps, pdl=bool(pdl[0]) if pdl else True))
    if kind == "static1":
        return compiled_regions(one_token=True)
    if kind == "autotune1":
        return compiled_regions(one_token=True, mode="max-autotune-no-cudagraphs")
    if kind == "autotune":  # every shape its own region, inductor timing its matmul tiles against cuBLAS's
        from specmemo_core.runtime.model import LayerRegions, finish_layer, project_layer

        autotuned = functools.partial(torch.compile, dynamic=False, mode="max-autotune-no-cudagraphs")
        return LayerRegions(autotuned(project_layer), autotuned(finish_layer))
    raise SystemExit(f"unknown --regions kind {kind!r}")


def launch_with(fields: str):
    """``token_layer.Launch`` with the fields ``name=value;…`` names (ints, bools as 0/1, tuples as a:b:c)."""
    from specmemo_core.runtime import token_layer

    values = {}
    for field in filter(None, fields.split(";")):
        name, value = field.split("=")
        default = getattr(token_layer.LAUNCH, name)  # its type gives the value's (None: a bool's field)
        if value == "None" or isinstance(default, tuple):
            values[name] = None if value == "None" else tuple(int(v) for v in value.split(":"))
        else:
            values[name] = bool(int(value)) if default is None else type(default)(int(value))
    return token_layer.Launch(**values)


def alternate_regions(model, shape, args) -> dict[str, dict[str, float]]:
    """Each tree's step, with eager and compiled layer regions in turn, ``args.repeats``
    rounds (a fresh decoder and capture each time): ms per step, median (min–max)."""
    from statistics import median

    from specmemo_core.runtime import token_layer
    from specmemo_core.runtime.model import EAGER_REGIONS, compiled_regions

    kinds = {"eager": EAGER_REGIONS, "compiled": compiled_regions()}
    for kind in args.regions.split(","):
        kinds[kind] = region_kind(kinds, kind)
    out: dict[str, dict[str, float]] = {}
    for name in args.trees.split(","):
        tree = named_tree(name, args.heads)
        heads = step_heads(shape, model, args.device, args.heads, args.draft_vocab) if tree else None
        times: dict[str, list[float]] = {k: [] for k in args.regions.split(",")}
        for _ in range(args.repeats):
            for kind in times:
                model.use_regions(kinds[kind])
                # "+lt": cuBLASLt's matmuls instead of cuBLAS's (the library the capture records)
                torch.backends.cuda.preferred_blas_library("cublaslt" if kind.endswith("+lt") else "cublas")
                # "-noglue": the step's drafting top-k, acceptance and commit as torch ops (step_kernels.py)
                os.environ["SPECMEMO_STEP_KERNELS"] = "0" if "-noglue" in kind else "1"
                # "-nopicks": the acceptance's argmax through the LM head's blocks of matmuls (model.greedy_picks)
                os.environ["SPECMEMO_PICK_KERNEL"] = "0" if "-nopicks" in kind else "1"
                # "-nodraft": a hydra tree level's drafting as torch ops (HydraHeads._draft_in_kernels)
                os.environ["SPECMEMO_DRAFT_KERNELS"] = "0" if "-nodraft" in kind else "1"
                # "-notables": a step's rotary tables and bias as torch ops (model.step_tables)
                os.environ["SPECMEMO_TABLES_KERNEL"] = "0" if "-notables" in kind else "1"
                if heads is not None and heads.context is not None:  # "-ctxregions": its layer without token_layer
                    heads.context.layer.regions = dataclasses.replace(
                        EAGER_REGIONS, kernels=None if "-ctxregions" in kind else token_layer.LAUNCH)
                times[kind].append(time_steps(model, heads, tree, True, args.steps, context=args.context,
                                              capacity=args.capacity))
            torch.backends.cuda.preferred_blas_library("cublas")
        for kind, ms in times.items():
            out[f"{name}+graphs {kind}"] = {"median": round(median(ms), 3), "min": round(min(ms), 3),
                                            "max": round(max(ms), 3), "runs": len(ms)}
            print(json.dumps({"tree": name, "regions": kind, **out[f"{name}+graphs {kind}"]}), flush=True)
    return out


def alternate_topk(model, args) -> dict[str, dict[str, float]]:
    """Each tree's step with the heads' drafting top-k chunked by each of ``args.topk_chunks``
    in turn (0: torch.topk alone), ``args.repeats`` rounds: ms per step, median (min–max)."""
    from statistics import median

    shape = model.spec
    out: dict[str, dict[str, float]] = {}
    for name in args.trees.split(","):
        tree = named_tree(name, args.heads)
        chunks = [int(c) for c in args.topk_chunks.split(",")] if tree else [0]
        heads = step_heads(shape, model, args.device, args.heads, args.draft_vocab) if tree else None
        times: dict[int, list[float]] = {c: [] for c in chunks}
        for _ in range(args.repeats):
            for chunk in chunks:
                if heads is not None:
                    heads.topk_chunk = chunk
                times[chunk].append(time_steps(model, heads, tree, True, args.steps, context=args.context,
                                               capacity=args.capacity))
        for chunk, ms in times.items():
            key = f"{name}+graphs topk-chunk {chunk}"
            out[key] = {"median": round(median(ms), 3), "min": round(min(ms), 3), "max": round(max(ms), 3),
                        "runs": len(ms)}
            print(json.dumps({"tree": name, "topk_chunk": chunk, **out[key]}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--trees", default="single,1-10-16-17,medusa-64")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default="eager,graphs")
    ap.add_argument("--no-fuse", action="store_true", help="keep q/k/v and gate/up as separate matmuls")
    ap.add_argument("--compile", action="store_true", help="compile the decoder layers' regions (CausalLM.compile_layers)")
    ap.add_argument("--regions", default="", help="eager,compiled[,static1,autotune1,eager-sdpa,compiled-sdpa,compiled-regions,compiled-notiles,compiled-pdl:A:M:T,compiled-pf:COLS (the tiles' L2 asks before PDL waits),compiled{FIELD=V;…} (token_layer.Launch's fields),compiled-amM (the attention's rows a program at most),compiled-prenorm,compiled-innernorm,compiled@P:R:K:W,compiled#N:K:W:S[:M],compiled%N:S (a large layer's o/down tiles),autotune; any +lt: cuBLASLt; any -noglue: the step's glue as torch ops; any -nopicks: the acceptance's argmax through blocks of matmuls; any -nodraft: hydra drafting as torch ops; any -notables: the rotary tables and bias as torch ops; any -ctxregions: the heads' context layer through its regions]: time each, alternating in this process "
                    "(--repeats rounds each; medians and spread)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--topk-chunks", default="", help="e.g. 0,512: time each tree's step with the heads' drafting "
                    "top-k chunked by each (0: torch.topk alone), alternating in this process (--repeats rounds)")
    ap.add_argument("--heads", default="", help="trained heads of the shape (a folder) instead of random ones, "
                    "e.g. assets/heads/SmolLM2-135M-Instruct on --shape smollm2-135m")
    ap.add_argument("--draft-vocab", type=int, default=0, help="random heads draft among this many tokens, as trained "
                    "ones do (train-heads --draft-vocab, default 8192); 0: the whole vocabulary")
    ap.add_argument("--kernels", action="store_true", help="also count the GPU kernels of one step")
    ap.add_argument("--context", type=int, default=1000, help="prompt tokens before the timed steps")
    ap.add_argument("--capacity", type=int, default=4096, help="KV cache slots (a step attends over the smallest span that holds the conversation)")
    args = ap.parse_args()
    shape = known_shape(args.shape)
    model = random_model(shape, args.dtype, args.device)
    fused = False if args.no_fuse else model.fuse_projections()
    if args.compile:
        model.compile_layers()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = {"shape": args.shape, "dtype": args.dtype, "device": name, "fused": fused, "compiled": args.compile,
           "bf16_weight_read_floor_ms": round(weight_read_floor_ms(shape), 3), "ms_per_step": {},
           "kernels_per_step": {}, "first_step_s": {}}
    if args.topk_chunks:
        out["alternating"] = alternate_topk(model, args)
        print(json.dumps(out))
        return
    if args.regions:
        out["alternating"] = alternate_regions(model, shape, args)
        print(json.dumps(out))
        return
    for name in args.trees.split(","):
        tree = named_tree(name, args.heads)
        heads = step_heads(shape, model, args.device, args.heads, args.draft_vocab) if tree else None
        for mode in args.modes.split(","):
            t0 = time.perf_counter()
            ms = time_steps(model, heads, tree, mode != "eager", args.steps, context=args.context, capacity=args.capacity)
            key = name + ("" if mode == "eager" else f"+{mode}")
            out["ms_per_step"][key] = round(ms, 3)
            out["first_step_s"][key] = round(time.perf_counter() - t0, 1)  # includes the captures
            print(json.dumps({"tree": name, "mode": mode, "ms_per_step": round(ms, 3),
                              "total_s": out["first_step_s"][key]}), flush=True)
        if args.kernels and args.device == "cuda":
            out["kernels_per_step"][name] = count_kernels(model, heads, tree, args.context, args.capacity)
            print(json.dumps({"tree": name, "kernels": out["kernels_per_step"][name]}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
