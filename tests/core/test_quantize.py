"""Weight-only int8/int4 quantization of our CausalLM (torchao) on tiny random models.

Error bounds, measured on these models (hidden 256, 2 layers, seed 1) and justified by
the step size: random weights are ~Gaussian, so a symmetric per-row int8 grid spans about
±4σ in 255 steps (rounding error ≈ 0.01σ per weight, ~1 % per layer) and we measured a
relative logit error of 0.014-0.016; asymmetric 4-bit groups of 128 span about ±2.7σ in
15 steps (≈ 0.1σ per weight, ~10 % per layer) and we measured 0.16-0.23. The bounds
below leave about 2x headroom over those measurements.
"""

import pytest
import torch

from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.model import causal_mask
from specmemo_core.runtime.quantize import QuantSpec, held_bytes, linear_weight_bytes, quantize_model
from tests.tiny import tiny_model

INT8_REL_ERR = 0.035
INT4_REL_ERR = 0.4
SHAPE = dict(hidden_size=256, intermediate_size=512)


def _model(**kw):
    return tiny_model(seed=1, **SHAPE, **kw)


def _logits(model, tokens):
    hidden = model(tokens, torch.arange(len(tokens)), causal_mask(0, len(tokens)), model.new_cache(64))
    return model.logits(hidden).float()


def _rel_err(a, b):
    return float((a - b).norm() / b.norm())


def _greedy(model, prompt, n=12):
    decoder = Decoder(model, model.new_cache(len(prompt) + n + 1))
    return [t for s in decoder.generate(prompt, GenerationConfig(max_new_tokens=n)) for t in s.token_ids]


TOKENS = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tie", [False, True])
def test_int8_shrinks_linears_and_stays_close(tie):
    ref = _model(tie_word_embeddings=tie)
    model = quantize_model(_model(tie_word_embeddings=tie), QuantSpec("int8"))
    assert linear_weight_bytes(ref) / linear_weight_bytes(model) >= 2.5
    assert held_bytes(model) < held_bytes(ref)
    assert _rel_err(_logits(model, TOKENS), _logits(ref, TOKENS)) < INT8_REL_ERR
    assert model.lm_head.weight.dtype == torch.float32  # kept in the activation dtype
    assert len(_greedy(model, TOKENS.tolist())) == 12


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_runs_on_cpu(group_size):
    ref = _model()
    model = quantize_model(_model(), QuantSpec("int4", group_size=group_size))
    assert linear_weight_bytes(ref) / linear_weight_bytes(model) >= 5.0
    assert _rel_err(_logits(model, TOKENS), _logits(ref, TOKENS)) < INT4_REL_ERR
    assert len(_greedy(model, TOKENS.tolist())) == 12


def test_weight_bytes_counts_scales_and_tied_weights_once():
    ref = _model(tie_word_embeddings=True)
    fp32 = sum(p.numel() * 4 for p in ref.parameters()) + ref.inv_freq.numel() * 4
    assert held_bytes(ref) == fp32
    model = quantize_model(_model(tie_word_embeddings=True), QuantSpec("int8"))
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    values = sum(m.in_features * m.out_features for m in linears)  # one int8 byte each
    scales = sum(m.out_features * (4 + 1) for m in linears)  # a float32 scale + an int8 zero point a row
    assert linear_weight_bytes(model) == values + scales


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_float_casts_keep_rope_in_float32(precision):
    model = quantize_model(_model(), QuantSpec(precision))
    assert model.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert model.inv_freq.dtype == torch.float32
    assert len(_greedy(model, TOKENS.tolist())) == 12


def test_lm_head_can_be_quantized_and_is_untied():
    model = quantize_model(_model(tie_word_embeddings=True, vocab_size=320), QuantSpec("int8", quantize_lm_head=True))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert len(_greedy(model, TOKENS.tolist())) == 12


@pytest.mark.parametrize("precision", ["int3", "FP32", "", "q4_0"])
def test_unknown_precision_is_refused(precision):
    with pytest.raises(SpecMemoError, match="choose one of"):
        QuantSpec(precision)


def test_bad_group_size_is_refused():
    with pytest.raises(SpecMemoError, match="group size"):
        QuantSpec("int4", group_size=100)
    with pytest.raises(SpecMemoError, match="use group size 32 or 64"):  # 64-wide layers: not in 128s
        quantize_model(tiny_model(seed=1), QuantSpec("int4", group_size=128))


def test_quantizing_twice_is_refused():
    model = quantize_model(_model(), QuantSpec("int8"))
    with pytest.raises(SpecMemoError, match="already quantized"):
        quantize_model(model, QuantSpec("int4"))


def _on_q4_grid(model, group=32, seed=0):
    """Give every decoder matrix of ``model`` values on a 4-bit grid of ``group`` inputs,
    each group spanning its 16 levels (as a Q4_1 GGUF's blocks do), and return it."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.model.layers.modules():
        if isinstance(m, torch.nn.Linear):
            o, i = m.weight.shape
            q = torch.randint(0, 16, (o, i // group, group), generator=gen).float()
            q[..., 0], q[..., 1] = 0, 15  # both ends of the grid in every group
            step = torch.rand(o, i // group, 1, generator=gen) * 0.01 + 0.002
            low = (torch.rand(o, i // group, 1, generator=gen) - 0.5) * 0.05
            m.weight.data.copy_((low + q * step).reshape(o, i))
    return model


def test_cpu_int4_runs_bf16_inputs_through_atens_kernel_on_the_files_own_grid():
    """On a CPU each int4 layer becomes an Int4CpuLinear: the weights of a 4-bit grid come
    back as they were (only their scales rounded to bf16), the input is cast to bf16 and the
    output is the model's fp32, so the model's logits stay within bf16's error of fp32's."""
    from specmemo_core.runtime.quantize import Int4CpuLinear

    ref = _on_q4_grid(_model())
    model = quantize_model(_on_q4_grid(_model()), QuantSpec("int4"))
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is Int4CpuLinear and m.weight.dtype == torch.bfloat16 for m in linears)
    ref_linears = [m for m in ref.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    x = torch.randn(3, 256)
    for ours, theirs in zip(linears[:2], ref_linears[:2]):
        out = ours(x)
        assert out.dtype == torch.float32
        assert _rel_err(out, theirs(x)) < 0.01  # measured 0.005 (bf16 inputs, scales); groups of 64: 0.047
    assert _rel_err(_logits(model, TOKENS), _logits(ref, TOKENS)) < 0.0025  # 0.0015; groups of 64: 0.0037
    assert model.model.norm.weight.dtype == torch.float32 and model.new_cache(4).k.dtype == torch.float32


@pytest.mark.parametrize("kind", ["int4", "int8-rows"])
def test_cpu_kernels_give_each_row_of_a_verify_what_one_row_gets(kind):
    """Tree verification runs several tokens through each matmul: each row must be what
    that token alone gets, bit for bit, or speculative replies drift from plain ones."""
    from specmemo_core.runtime.cpu_linear import Int8RowLinear

    torch.manual_seed(0)
    if kind == "int4":
        layer = quantize_model(_model(), QuantSpec("int4")).model.layers[0].mlp.up_proj
    else:
        layer = Int8RowLinear(torch.nn.Linear(256, 320, bias=True))
    x = torch.randn(17, 256)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(17)])
        for rows in (2, 5, 8, 17):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("bias", [False, True])
def test_int8_rows_stay_close_to_the_float_layer(bias):
    from specmemo_core.runtime.cpu_linear import Int8RowLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 320, bias=bias)
    head = Int8RowLinear(lin)
    x = torch.randn(2, 5, 256)
    with torch.inference_mode():
        out = head(x)
    assert out.shape == (2, 5, 320) and out.dtype == torch.float32
    assert _rel_err(out, lin(x).detach()) < INT8_REL_ERR
    assert head.rows.dtype == torch.int8 and head.rows.shape == (320, 256)


def test_cpu_int4_speculative_replies_are_plain_int4_replies_on_a_tiny_model():
    """The tree's verify forward through int4 layers and an int8 LM head picks what plain
    int4 decoding picks on this model (fp32 around the matmuls); on the default model
    near-ties can fall otherwise between shapes, as in bf16 (README)."""
    from specmemo_core.runtime.cpu_linear import pack_linears
    from specmemo_core.runtime.heads import random_heads
    from specmemo_core.runtime.tree import load_tree

    model = quantize_model(_model(), QuantSpec("int4"))
    pack_linears(model, int8_head=True)
    prompt = TOKENS.tolist()
    plain = _greedy(model, prompt, n=40)
    heads = random_heads(3, 256, 300, seed=5, scale=0.5, kind="hydra")
    decoder = Decoder(model, model.new_cache(len(prompt) + 60), heads, load_tree("1-3-2"))
    spec = [t for s in decoder.generate(prompt, GenerationConfig(max_new_tokens=40)) for t in s.token_ids]
    assert spec == plain
