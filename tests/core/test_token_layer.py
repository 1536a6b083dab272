"""A plain step's layer as fused kernels (``runtime/token_layer.py``) against the layer's own
regions: the kernels on the GPU where there is one, else in Triton's interpreter on the CPU
(a process of their own, as ``test_chunked_attention.py`` explains)."""

import dataclasses
import pytest
import torch

from specmemo_core.runtime import token_layer
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.heads import random_heads
from specmemo_core.runtime.model import EAGER_REGIONS
from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache
from specmemo_core.runtime.tree import load_tree
from tests.tiny import tiny_model
from tests.triton_kernels import DEVICE, assert_probe_falls_back, elsewhere, kernels, run_in_interpreter

pytest.importorskip("triton", reason="Triton is not installed (a CPU-only torch): the GPU kernels cannot be run")


@elsewhere
def test_in_tritons_interpreter():
    run_in_interpreter(__file__, passed=7)


@elsewhere
def test_where_the_kernels_cannot_run_the_probe_says_why_and_the_regions_stay(caplog):
    assert_probe_falls_back(token_layer._probe, caplog, says=("one-token layer kernels unavailable", "regions"))


@kernels
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else []))
def test_the_probe_passes_where_the_kernels_run(dtype):
    assert token_layer._probe(torch.device(DEVICE), dtype) is True


@kernels
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_a_layer_with_biases_and_grouped_heads_steps_as_its_regions(tokens):
    """Output and both caches (the new slots written, every other slot untouched) as the
    eager regions and SDPA give them, fp32: q/k/v biases, o and MLP biases, 3 heads over 1;
    one token (the matrix-vector kernels), 3 and 17 (the tree's, 17 past one 16-row tile)."""
    got = token_layer.probe_step(torch.device(DEVICE), torch.float32, kernels=True, tokens=tokens)
    want = token_layer.probe_step(torch.device(DEVICE), torch.float32, kernels=False, tokens=tokens)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < 2e-5
    again = token_layer.probe_step(torch.device(DEVICE), torch.float32, kernels=True, tokens=tokens)
    assert all(torch.equal(a, b) for a, b in zip(got, again))  # deterministic: no atomics, one order


def _model(seed: int, **kw):
    model = tiny_model(seed=seed, device=DEVICE, **kw)
    assert model.fuse_projections()
    return model


def _tokens(decoder, prompt, n):
    return [t for s in decoder.generate(prompt, GenerationConfig(max_new_tokens=n)) for t in s.token_ids]


@kernels
def test_a_static_step_of_up_to_64_tokens_takes_the_kernels_and_others_do_not():
    model = _model(seed=4)
    layer = model.model.layers[0]
    cache = new_static_cache(model, 128)
    one, many, more = (torch.zeros(n, model.spec.hidden_size, device=DEVICE) for n in (1, 64, 65))
    cache.prepare(torch.arange(1, device=DEVICE), None, 128)
    assert token_layer.applies(layer, one, cache)
    assert not token_layer.applies(layer, one[None], cache)  # a batch
    assert not token_layer.applies(layer, one, model.new_cache(128))  # slots on the host
    cache.prepare(torch.arange(64, device=DEVICE), None, 128)
    assert token_layer.applies(layer, many, cache)  # a tree or a short prompt chunk
    cache.prepare(torch.arange(65, device=DEVICE), None, 128)
    assert not token_layer.applies(layer, more, cache)  # more rows than a tile: the regions
    unfused = tiny_model(seed=4, device=DEVICE)
    cache.prepare(torch.arange(1, device=DEVICE), None, 128)
    assert not token_layer.applies(unfused.model.layers[0], one, cache)


@kernels
def test_plain_and_speculative_static_decoding_match_the_sliced_decoder():
    """Greedy, fp32: the static decoder's prompt, plain steps and tree steps (all through the
    kernels: the matrix-vector ones for one token, the tile ones for several) give the sliced
    decoder's tokens (its cache written by the regions)."""
    model = _model(seed=11, vocab_size=16)
    prompt = torch.randint(0, 16, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = _tokens(Decoder(model, model.new_cache(64)), prompt, 24)
    assert _tokens(StaticDecoder(model, new_static_cache(model, 64)), prompt, 24) == plain
    heads = random_heads(4, 64, 16, seed=5, scale=0.5, kind="hydra").to(DEVICE)
    static = StaticDecoder(model, new_static_cache(model, 64), heads, load_tree("1-3-2"))
    assert _tokens(static, prompt, 24) == plain


@kernels
def test_a_layer_without_biases_at_the_first_slot_steps_as_its_regions():
    model = _model(seed=4)
    layer = model.model.layers[0]
    off = dataclasses.replace(EAGER_REGIONS, one_token_launch=None)
    cache = new_static_cache(model, 64)
    positions, mask = cache.prepare(torch.arange(1, device=DEVICE), None, 64)
    x = model.model.embed_tokens(torch.tensor([3], device=DEVICE))
    cos, sin = model.rope(positions)
    from specmemo_core.runtime.model import attention_bias

    bias = attention_bias(mask, model.spec, torch.float32)
    with torch.no_grad():
        fused = layer(x, cos, sin, bias, cache)
        layer.regions = off
        regions = layer(x, cos, sin, bias, cache)
    assert (fused - regions).abs().max().item() < 1e-5
