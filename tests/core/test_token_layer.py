"""A decoding step's layer as fused kernels (``runtime/token_layer.py``) against the layer's own
regions: the kernels on the GPU where there is one, else in Triton's interpreter on the CPU
(a process of their own, as ``test_chunked_attention.py`` explains)."""

import dataclasses

import pytest
import torch

from specmemo_core.runtime import kernel_probe, token_layer
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.heads import random_heads
from specmemo_core.runtime.model import EAGER_REGIONS, attention_bias
from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache
from specmemo_core.runtime.tree import load_tree
from tests.tiny import tiny_model
from tests.triton_kernels import DEVICE, assert_probe_falls_back, elsewhere, kernels, run_in_interpreter

pytest.importorskip("triton", reason="Triton is not installed (a CPU-only torch): the GPU kernels cannot be run")


@elsewhere
def test_in_tritons_interpreter():
    run_in_interpreter(__file__, passed=19)


@elsewhere
def test_where_the_kernels_cannot_run_the_probe_says_why_and_the_regions_stay(caplog):
    assert_probe_falls_back(token_layer._probe, caplog, says=("decoding-step layer kernels unavailable", "regions"))


@kernels
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else []))
def test_the_probe_passes_where_the_kernels_run(dtype):
    assert token_layer._probe(torch.device(DEVICE), dtype) is True


@kernels
@pytest.mark.parametrize("tiles,prenorm,large,qkv_n", [(False, False, False, 0), (True, False, False, 0),
                                                       (True, True, False, 0), (True, True, True, 0),
                                                       (True, True, True, 8)])
def test_a_layer_with_biases_and_grouped_heads_steps_as_its_regions(tiles, prenorm, large, qkv_n):
    """Outputs of a one-token step and a three-token step after it (cuBLAS and ``rotate_rows``,
    or the tile kernels, the norm inside them or before them, a large layer's wider tiles: more
    pairs a program than a head has; its q/k/v tiles narrower), and both caches (the new slots
    written, every other slot untouched) as the eager regions and SDPA give them, fp32: q/k/v
    biases, o and MLP biases, 3 heads over 1."""
    launch = token_layer.Launch(row_tiles=tiles, tile_prenorm=prenorm, tile_layer_bytes=0 if large else 64 << 20,
                                large_qkv_n=qkv_n)
    got = token_layer.probe_step(torch.device(DEVICE), torch.float32, kernels=True, launch=launch)
    want = token_layer.probe_step(torch.device(DEVICE), torch.float32, kernels=False)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert ((a - b).abs().max() / b.abs().max()).item() < 4e-6  # fp32 sums in other orders
    again = token_layer.probe_step(torch.device(DEVICE), torch.float32, kernels=True, launch=launch)
    assert all(torch.equal(a, b) for a, b in zip(got, again))  # deterministic: no atomics, one order


@kernels
@pytest.mark.parametrize("prenorm", [False, True])
def test_the_tiles_endings_read_before_their_loops_keep_the_step(prenorm):
    """``Launch.tile_early_ending`` moves the tile kernels' loads of their endings' inputs (residual,
    biases, 1/rms, rotary tables, slots) before their loops: the probe's steps and caches come out
    as with them after (fp32, q/k/v and MLP biases, rotary, 3 heads over 1), bit for bit in the
    interpreter; on an H100 (session 35) the compiled kernels differ in their last bits (ptxas
    schedules the two orders' arithmetic apart), within fp32 rounding of torch's forward either way."""
    base = token_layer.Launch(row_tiles=True, tile_prenorm=prenorm, tile_early_ending=False)
    late = token_layer.probe_step(torch.device(DEVICE), torch.float32, kernels=True, launch=base)
    early = token_layer.probe_step(torch.device(DEVICE), torch.float32, kernels=True,
                                   launch=dataclasses.replace(base, tile_early_ending=True))
    want = token_layer.probe_step(torch.device(DEVICE), torch.float32, kernels=False)
    if DEVICE == "cpu":  # the interpreter runs the same arithmetic in either order
        assert all(torch.equal(a, b) for a, b in zip(early, late))
    for got in (early, late):
        assert all(((a - b).abs().max() / b.abs().max()).item() < 4e-6 for a, b in zip(got, want))


@elsewhere
@pytest.mark.parametrize("early", [False, True])
def test_the_tile_kernels_build_for_hopper(early):
    """The tile kernels as a 7B layer's tree step launches them (bf16, 64 tokens, 32 pairs or rows,
    PDL, L2 asks), their endings' inputs read after their loops or before, built for sm_90 by
    Triton's compiler and ptxas on this CPU: the interpreter runs Python, not what the GPU builds."""
    from specmemo_core.runtime import token_layer_kernels as tlk
    from tests.triton_kernels import compile_for_hopper

    tile = dict(BLOCK_M=64, BLOCK_K=128, HAS_BIAS=True, IEEE=False, PDL=1, PREFETCH=512, LINE=64, EARLY=early)
    for rope in (True, False):
        built = compile_for_hopper(tlk.norm_pair_rows, types={"g_ptr": "*fp32", "slot_ptr": "*i64", "eps": "fp32"},
                                   constexprs=dict(tile, PAIRS=32, ROPE=rope, PRENORMED=True))
        assert "wgmma" in built.asm["ptx"] and "griddepcontrol.wait" in built.asm["ptx"]
    built = compile_for_hopper(tlk.matmul_add_rows, constexprs=dict(tile, BLOCK_N=32))
    assert "prefetch.global.L2" in built.asm["ptx"]


def test_several_16_bit_tokens_run_as_tiles_and_a_large_layer_takes_wider_ones():
    """By default (``row_tiles=None``) a step of several tokens takes the tile kernels in bf16
    or fp16, not in fp32 (the tensor cores' IEEE products are slow); True or False say either. A
    layer past ``tile_layer_bytes`` of weights takes the large tiles (``tile_shape``), and only for
    steps of at most one tile of tokens (a longer prompt chunk would read its weights again)."""
    model = _model(seed=4)
    layer = model.model.layers[0]
    x = torch.zeros(3, model.spec.hidden_size, device=DEVICE)
    auto, on, off = (token_layer.Launch(row_tiles=v) for v in (None, True, False))
    assert token_layer.row_tiles(layer, x.bfloat16(), auto) and token_layer.row_tiles(layer, x.half(), auto)
    assert not token_layer.row_tiles(layer, x, auto)
    assert token_layer.row_tiles(layer, x, on) and not token_layer.row_tiles(layer, x.bfloat16(), off)
    assert token_layer.LAUNCH.row_tiles is None
    size = sum(p.numel() * 4 for name, p in layer.named_parameters() if "layernorm" not in name)
    small, large = token_layer.TileShape(16, 5), token_layer.TileShape(32, 6)
    assert token_layer.tile_shape(layer, token_layer.Launch(tile_layer_bytes=size)) == small
    assert token_layer.tile_shape(layer, token_layer.Launch(tile_layer_bytes=size - 1)) == large
    assert token_layer.tile_shape(layer, token_layer.LAUNCH) == small  # a tiny layer
    large_layer = token_layer.Launch(tile_layer_bytes=size - 1)
    tile, longer = (torch.zeros(n, model.spec.hidden_size, device=DEVICE, dtype=torch.bfloat16) for n in (64, 65))
    assert token_layer.row_tiles(layer, tile, large_layer) and not token_layer.row_tiles(layer, longer, large_layer)
    assert token_layer.row_tiles(layer, longer, auto)  # a small layer's prompt chunks: tiles at any length


def test_tile_stages_shrink_to_what_a_blocks_shared_memory_holds():
    """A 7B layer's gate/up tiles (64 tokens and 64 weight rows, 128 columns of bf16: 32 KB a stage)
    take their 6 stages on an H100 (227 KB a block) and 3 on a laptop GPU (99 KB); never none."""
    stage = (64 + 64) * 128 * 2
    assert kernel_probe.fitting_stages(6, stage_bytes=stage, shared_bytes=227 << 10) == 6
    assert kernel_probe.fitting_stages(6, stage_bytes=stage, shared_bytes=99 << 10) == 3
    assert kernel_probe.fitting_stages(5, stage_bytes=stage, shared_bytes=16 << 10) == 1
    down = (64 + 16) * 128 * 2  # the default model's down_proj tiles (K = 1,536): 100 KB in 5 stages
    assert kernel_probe.fitting_stages(5, stage_bytes=down, shared_bytes=99 << 10) == 4
    assert kernel_probe.fitting_stages(5, stage_bytes=down, shared_bytes=227 << 10) == 5
    assert kernel_probe.shared_bytes(torch.device("cpu")) >= 1 << 30  # Triton's interpreter: no bound


def _model(seed: int, **kw):
    model = tiny_model(seed=seed, device=DEVICE, **kw)
    assert model.fuse_projections()
    return model


def _tokens(decoder, prompt, n):
    return [t for s in decoder.generate(prompt, GenerationConfig(max_new_tokens=n)) for t in s.token_ids]


@kernels
def test_an_unbatched_static_step_takes_the_kernels_and_others_do_not():
    model = _model(seed=4)
    layer = model.model.layers[0]
    cache = new_static_cache(model, 128)
    one, two = (torch.zeros(n, model.spec.hidden_size, device=DEVICE) for n in (1, 2))
    cache.prepare(torch.arange(1, device=DEVICE), None, 128)
    assert token_layer.applies(layer, one, cache)
    assert not token_layer.applies(layer, one[None], cache)  # a batch
    assert not token_layer.applies(layer, one, model.new_cache(128))  # slots on the host
    assert not token_layer.applies(layer, two, cache)  # not the tokens the cache was prepared for
    cache.prepare(torch.arange(2, device=DEVICE), None, 128)
    assert token_layer.applies(layer, two, cache)  # a tree or a prompt chunk
    rows = 256 // (model.spec.num_heads // model.spec.num_kv_heads) + 1  # past the chunked attention's rows
    cache.prepare(torch.arange(rows, device=DEVICE), None, 128)
    assert not token_layer.applies(layer, torch.zeros(rows, model.spec.hidden_size, device=DEVICE), cache)
    unfused = tiny_model(seed=4, device=DEVICE)
    cache.prepare(torch.arange(1, device=DEVICE), None, 128)
    assert not token_layer.applies(unfused.model.layers[0], one, cache)


@kernels
@pytest.mark.parametrize("tiles", [False, True])
def test_plain_and_speculative_static_decoding_match_the_sliced_decoder(tiles):
    """Greedy, fp32: the static decoder's plain steps (the one-token kernels), its prompt chunks
    and tree steps (``rotate_rows`` into the cache, or the tile kernels) give the sliced decoder's
    tokens (the regions)."""
    model = _model(seed=11, vocab_size=16)
    for layer in model.model.layers:
        layer.regions = dataclasses.replace(layer.regions, kernels=token_layer.Launch(row_tiles=tiles))
    prompt = torch.randint(0, 16, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = _tokens(Decoder(model, model.new_cache(64)), prompt, 24)
    assert _tokens(StaticDecoder(model, new_static_cache(model, 64)), prompt, 24) == plain
    heads = random_heads(4, 64, 16, seed=5, scale=0.5, kind="hydra").to(DEVICE)
    static = StaticDecoder(model, new_static_cache(model, 64), heads, load_tree("1-3-2"))
    assert _tokens(static, prompt, 24) == plain


@kernels
@pytest.mark.parametrize("tokens,tiles", [(1, False), (5, False), (70, False), (5, True), (70, True)])
def test_a_layer_without_biases_at_the_first_slot_steps_as_its_regions(tokens, tiles):
    """One token (the one-token kernels), a few and seventy (``rotate_rows`` after cuBLAS's q/k/v,
    or the tile kernels: their second row of programs part-full; the attention's row blocks past
    the first): output and cache as the regions'."""
    model = _model(seed=4)
    layer = model.model.layers[0]
    layer.regions = dataclasses.replace(layer.regions, kernels=token_layer.Launch(row_tiles=tiles))
    off = dataclasses.replace(EAGER_REGIONS, kernels=None)
    caches = [new_static_cache(model, 128) for _ in range(2)]
    outs = []
    for cache, regions in zip(caches, (layer.regions, off)):
        positions, mask = cache.prepare(torch.arange(tokens, device=DEVICE), None, 128)
        x = model.model.embed_tokens(torch.arange(3, 3 + tokens, device=DEVICE) % model.spec.vocab_size)
        cos, sin = model.rope(positions)
        bias = attention_bias(mask, model.spec, torch.float32)
        layer.regions = regions
        with torch.no_grad():
            outs.append(layer(x, cos, sin, bias, cache))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5
    assert (caches[0].k - caches[1].k).abs().max().item() < 1e-5
    assert (caches[0].v - caches[1].v).abs().max().item() < 1e-5


def test_dependent_launch_only_where_the_gpu_has_it():
    """Hopper on (the H200: 9.0) takes programmatic dependent launch; a laptop's Ada (8.9) or
    Ampere (8.6) card and AMD's GPUs (whatever capability ROCm reports) launch plainly, so their
    kernels still build and the probe keeps them on."""
    assert token_layer.supports_dependent_launch((9, 0), hip=False)
    assert token_layer.supports_dependent_launch((10, 0), hip=False)
    assert not token_layer.supports_dependent_launch((8, 9), hip=False)
    assert not token_layer.supports_dependent_launch((8, 6), hip=False)
    assert not token_layer.supports_dependent_launch((9, 4), hip=True)
