"""Our forward against transformers' own, and tree attention against sequential runs."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specmemo_core.runtime.model import CausalLM, ModelSpec, causal_mask, tree_mask
from tests.tiny import tiny_config, tiny_hf_model, tiny_model

SHAPES = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _hf_models():
    torch.manual_seed(1)
    yield "llama", tiny_hf_model(seed=1)
    yield "llama-tied", tiny_hf_model(seed=2, tie_word_embeddings=True)
    yield "llama3-rope", tiny_hf_model(seed=3, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    torch.manual_seed(4)
    yield "qwen2", Qwen2ForCausalLM(Qwen2Config(**SHAPES)).eval()
    torch.manual_seed(5)
    yield "mistral", MistralForCausalLM(MistralConfig(**SHAPES, sliding_window=None)).eval()


@pytest.mark.parametrize("name,hf", list(_hf_models()), ids=lambda x: x if isinstance(x, str) else "")
def test_logits_match_transformers(name, hf):
    ours = CausalLM.from_state_dict(hf.config, hf.state_dict())
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [T, V]
    cache = ours.new_cache(64)
    hidden = ours(ids[0], torch.arange(40), causal_mask(0, 40), cache)
    assert (ours.logits(hidden) - ref).abs().max().item() <= 1e-4


def test_qwen2_has_qkv_bias_and_no_o_bias():
    spec = ModelSpec.from_config(Qwen2Config(**SHAPES))
    assert spec.qkv_bias and not spec.o_bias


def test_unsupported_model_type_is_refused():
    cfg = tiny_config()
    cfg.model_type = "gpt2"
    with pytest.raises(ValueError, match="not supported"):
        ModelSpec.from_config(cfg)


def test_incremental_decoding_matches_one_shot():
    hf = tiny_hf_model(seed=7)
    ours = CausalLM.from_state_dict(hf.config, hf.state_dict())
    ids = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(1))
    full = ours.logits(ours(ids, torch.arange(30), causal_mask(0, 30), ours.new_cache(32)))
    cache = ours.new_cache(32)
    rows = []
    for start, end in [(0, 17), (17, 18), (18, 25), (25, 30)]:
        h = ours(ids[start:end], torch.arange(start, end), causal_mask(start, end - start), cache)
        cache.commit_prefix(end - start)
        rows.append(ours.logits(h))
    assert torch.allclose(torch.cat(rows), full, atol=1e-5)


def test_tree_forward_scores_each_node_as_its_own_chain():
    """Node i at position prefix+depth, seeing prefix and ancestors only, gives the same
    logits as running its root-to-node chain sequentially."""
    hf = tiny_hf_model(seed=8)
    ours = CausalLM.from_state_dict(hf.config, hf.state_dict())
    prefix = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(2))
    # root, children a,b; a's child c; b's child d; c's child e
    parents = [-1, 0, 0, 1, 2, 3]
    tokens = torch.tensor([5, 17, 23, 42, 99, 7])
    depth = torch.tensor([0, 1, 1, 2, 2, 3])
    anc = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j != -1:
            anc[i, j] = True
            j = parents[j]
    cache = ours.new_cache(32)
    ours(prefix, torch.arange(12), causal_mask(0, 12), cache)
    cache.commit_prefix(12)
    tree_logits = ours.logits(ours(tokens, 12 + depth, tree_mask(12, anc), cache))
    for i in range(6):
        chain, j = [], i
        while j != -1:
            chain.insert(0, j)
            j = parents[j]
        seq = torch.cat([prefix, tokens[chain]])
        ref = ours.logits(ours(seq, torch.arange(len(seq)), causal_mask(0, len(seq)), ours.new_cache(32)))
        assert torch.allclose(tree_logits[i], ref[-1], atol=1e-5), i


@pytest.mark.parametrize("name,hf", list(_hf_models())[::3], ids=lambda x: x if isinstance(x, str) else "")
def test_fused_projections_compute_the_same_and_keep_the_parameters(name, hf):
    """q/k/v and gate/up fused into one matmul each: same logits, no copy of the weights
    (the per-projection parameters are views of the fused ones), same state dict."""
    ours = CausalLM.from_state_dict(hf.config, hf.state_dict())
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(3))
    before = ours.logits(ours(ids, torch.arange(20), causal_mask(0, 20), ours.new_cache(32)))
    keys = list(ours.state_dict())
    assert ours.fuse_projections()
    after = ours.logits(ours(ids, torch.arange(20), causal_mask(0, 20), ours.new_cache(32)))
    attn, mlp = ours.model.layers[0].self_attn, ours.model.layers[0].mlp
    assert attn.qkv is not None and mlp.gate_up is not None
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.qkv[0].untyped_storage().data_ptr()
    assert torch.equal(attn.qkv[0][attn.q_proj.out_features:][: attn.k_proj.out_features], attn.k_proj.weight)
    assert list(ours.state_dict()) == keys
    assert (after - before).abs().max().item() <= 1e-5


def test_a_layer_finish_adds_its_mlp_into_its_own_sum_and_leaves_its_inputs():
    """``finish_layer`` (o_proj + residual, norm, MLP + residual) over fused weights writes the
    MLP's sum over the attention's sum it made (no copy of it), giving what the out-of-place
    sums give, and leaves the layer's input and the attention's output as they were."""
    from specmemo_core.runtime.model import finish_layer

    model = tiny_model(seed=3)
    assert model.fuse_projections()
    layer = model.model.layers[0]
    g = torch.Generator().manual_seed(0)
    x, attended = (torch.randn(5, model.spec.hidden_size, generator=g) for _ in range(2))
    inputs = (x.clone(), attended.clone())
    with torch.inference_mode():
        got = finish_layer(layer, attended, x)
        mid = x + attended @ layer.self_attn.o_proj.weight.t()
        want = mid + layer.mlp.down_proj(torch.nn.functional.silu(layer.mlp.gate_proj(
            layer.post_attention_layernorm(mid))) * layer.mlp.up_proj(layer.post_attention_layernorm(mid)))
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(x, inputs[0]) and torch.equal(attended, inputs[1])
    residual = mid.clone()
    with torch.inference_mode():
        out = layer.mlp(layer.post_attention_layernorm(residual), residual, into_residual=True)
    assert out.data_ptr() == residual.data_ptr() and torch.allclose(out, want, atol=1e-5)


def test_packed_linears_are_not_fused():
    from specmemo_core.runtime.cpu_linear import pack_linears, packing_available

    if not packing_available():
        pytest.skip("this torch build has no oneDNN packing")
    ours = CausalLM.from_state_dict(tiny_hf_model(seed=1).config, tiny_hf_model(seed=1).state_dict())
    pack_linears(ours)
    assert not ours.fuse_projections()
    assert ours.model.layers[0].self_attn.qkv is None


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("rows", [7, 64, 299, 300])
def test_greedy_picks_are_the_logits_argmax_in_blocks(rows, device):
    """Scoring the LM head ``rows`` at a time (the last block partial) picks what the
    full logits' argmax picks. Integer weights and states make every score exact, and
    each weight row appears about ten times, so every best score is an exact tie, and the lowest id must win them."""
    hf = tiny_hf_model(seed=1)
    ours = CausalLM.from_state_dict(hf.config, hf.state_dict(), device=device)
    g = torch.Generator().manual_seed(5)
    distinct = torch.randint(-2, 3, (30, 64), generator=g).float()
    weight = distinct[torch.randint(0, 30, (300,), generator=g)]  # each row ~10 times, spread over blocks
    ours.lm_head.weight = torch.nn.Parameter(weight.to(device), requires_grad=False)
    hidden = torch.randint(-2, 3, (40, 64), generator=g).float().to(device)
    full = ours.logits(hidden)
    assert ((full == full.max(-1, keepdim=True).values).sum(-1) > 1).all()  # every row has ties
    assert torch.equal(ours.greedy_picks(hidden, rows=rows), full.argmax(-1))
    assert torch.equal(ours.greedy_picks(hidden[:1], rows=rows), full[:1].argmax(-1))  # one row: scored whole


def test_a_packed_head_is_scored_whole():
    from specmemo_core.runtime.cpu_linear import pack_linears, packing_available

    if not packing_available():
        pytest.skip("this torch build has no oneDNN packing")
    ours = CausalLM.from_state_dict(tiny_hf_model(seed=1).config, tiny_hf_model(seed=1).state_dict())
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(6))
    hidden = ours(ids, torch.arange(12), causal_mask(0, 12), ours.new_cache(16))
    expected = ours.logits(hidden).argmax(-1)
    pack_linears(ours)
    assert type(ours.lm_head).__name__ == "PackedLinear"
    assert torch.equal(ours.greedy_picks(hidden, rows=7), expected)


def test_compiled_layers_decode_as_eager_ones_plainly_and_on_a_tree():
    """``compile_layers`` runs every layer's two regions through ``torch.compile`` (one
    compiled graph shared by the layers): in fp32 the greedy tokens are the eager ones, for
    plain steps and for a 64-node tree's, whose regions see 64 tokens at once."""
    from specmemo_core.runtime.decoding import Decoder, GenerationConfig
    from specmemo_core.runtime.heads import random_heads
    from specmemo_core.runtime.model import EAGER_REGIONS
    from specmemo_core.runtime.tree import load_tree
    from tests.tiny import tiny_model

    model = tiny_model(layers=3)
    heads = random_heads(4, model.spec.hidden_size, model.spec.vocab_size)
    prompt = list(range(5, 40))

    def reply(tree: str | None) -> list[int]:
        decoder = Decoder(model, model.new_cache(256), heads if tree else None, load_tree(tree) if tree else None)
        return [t for step in decoder.generate(prompt, GenerationConfig(max_new_tokens=30)) for t in step.token_ids]

    eager = reply(None), reply("medusa-64")
    model.compile_layers()
    layers = list(model.model.layers)
    assert layers[0].regions is not EAGER_REGIONS and all(layer.regions is layers[0].regions for layer in layers)
    assert (reply(None), reply("medusa-64")) == eager
    assert eager[0] == eager[1]  # the tree's greedy reply is the plain one
