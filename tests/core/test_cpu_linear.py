"""Linear layers packed for oneDNN: same numbers as nn.Linear, same tokens in the decoder."""

import pytest
import torch
from torch import nn

from specmemo_core.runtime.cpu_linear import PackedLinear, pack_linears, packing_available
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.heads import random_heads
from specmemo_core.planning.memory import ModelShape, weight_bytes
from specmemo_core.runtime.quantize import held_bytes as measured_bytes
from specmemo_core.runtime.tree import load_tree
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(lin)
    for shape in ((rows, 96), (2, rows, 96), (96,)):
        x = torch.randn(shape)
        with torch.inference_mode():
            assert torch.allclose(packed(x), lin(x), atol=1e-5), shape


def test_pack_linears_replaces_fp32_cpu_linears_only():
    model = tiny_model(seed=1, vocab_size=64)
    bf16 = nn.Linear(8, 8).to(torch.bfloat16)
    model.add_module("extra", bf16)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == n_linear - 1  # all but the bf16 one
    assert model.extra is bf16 and not any(type(m) is nn.Linear and m is not bf16 for m in model.modules())
    assert pack_linears(model) == 0  # idempotent


@pytest.mark.parametrize("tree_name", [None, "calibrated-like", "1-10-16-17"])
def test_packed_model_decodes_exactly_as_unpacked(tree_name):
    """Greedy tokens, plain and speculative, are those of the unpacked model."""
    torch.set_num_threads(1)
    prompt = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    ref_model = tiny_model(seed=7)
    ref = [t for s in Decoder(ref_model, ref_model.new_cache(400)).generate(prompt, GenerationConfig(max_new_tokens=60))
           for t in s.token_ids]
    model = tiny_model(seed=7)
    tree = load_tree("1-3-2" if tree_name == "calibrated-like" else tree_name) if tree_name else None
    heads = random_heads(4, 64, 300, seed=5, scale=0.5, kind="hydra", context=(64, 4, 2, 16)) if tree else None
    assert pack_linears(model) > 0
    if heads is not None:
        assert pack_linears(heads) > 0
    out = [t for s in Decoder(model, model.new_cache(400), heads, tree).generate(prompt, GenerationConfig(max_new_tokens=60))
           for t in s.token_ids]
    assert out == ref


def test_memory_model_counts_the_packed_copy_of_a_tied_lm_head():
    model = tiny_model(seed=1, vocab_size=300, tie_word_embeddings=True)
    shape = ModelShape.from_spec(model.spec)
    before = measured_bytes(model)  # tied: counted once
    pack_linears(model)
    grown = measured_bytes(model) - before
    assert grown == weight_bytes(shape, "fp32", device_kind="cpu") - weight_bytes(shape, "fp32") == 300 * 64 * 4


def test_the_engine_packs_the_model_and_its_heads_on_cpu(tmp_path, monkeypatch):
    """On CPU every linear layer of the model and of the draft heads is packed (the
    heads draft every step: unpacked they cost ~1.5× more), and none is fused (fusing is
    the GPU's alternative)."""
    from specmemo_core.runtime.engine import Engine
    from tests.tiny import tiny_hf_model, tiny_tokenizer

    if not packing_available():
        pytest.skip("this torch build has no oneDNN packing")
    monkeypatch.setenv("SPECMEMO_DATA_DIR", str(tmp_path / "data"))
    folder = tmp_path / "tiny-llama"
    tiny_hf_model(seed=3).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    engine = Engine.load(str(folder), heads="random", tree="1-3-2")
    assert engine.heads is not None
    for root in (engine.model, engine.heads):
        assert [name for name, m in root.named_modules() if type(m) is nn.Linear] == []
        assert any(isinstance(m, PackedLinear) for m in root.modules())
    assert engine.model.model.layers[0].self_attn.qkv is None
