"""Memory arithmetic against hand-computed values and against real tensors."""

import pytest
import torch

from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.heads import random_heads
from specmemo_core.planning.memory import (
    HeadsShape, ModelShape, TreeShape, heads_bytes, known_shape, kv_bytes, tree_buffer_bytes, weight_bytes,
)
from specmemo_core.runtime.model import ModelSpec
from tests.tiny import tiny_config, tiny_model


def test_smollm2_by_hand():
    s = known_shape("smollm2-135m")
    per_layer = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576  # q,o + k,v + gate,up,down
    assert per_layer == 3_538_944
    assert s.params == 30 * per_layer + 61 * 576 + 49152 * 576 == 134_515_008
    assert weight_bytes(s, "fp32") == 538_060_032
    # on CPU the oneDNN-packed LM head is a copy of the tied embedding
    assert weight_bytes(s, "fp32", device_kind="cpu") == 538_060_032 + 49152 * 576 * 4
    assert weight_bytes(s, "bf16", device_kind="cpu") == weight_bytes(s, "bf16")  # fp32 only is packed
    # KV per token: 2 x 30 layers x 3 kv heads x 64 dims x 4 bytes (not without head_dim)
    assert kv_bytes(s, 1, "fp32") == 46_080
    assert kv_bytes(s, 4096, "bf16") == 4096 * 23_040


def test_vicuna_7b_by_hand():
    s = known_shape("vicuna-7b")
    assert s.params == 6_738_415_616  # LLaMA-7B's published count
    assert weight_bytes(s, "bf16") == 2 * 6_738_415_616
    assert kv_bytes(s, 1, "bf16") == 2 * 32 * 32 * 128 * 2 == 524_288  # 0.5 MiB per token
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    scales_int8 = 32 * 5 * (4 * 4096 + 2 * 11008 + 4096)
    rest = (6_738_415_616 - linear) * 2
    assert weight_bytes(s, "int8") == linear + scales_int8 + rest
    groups = 32 * (4 * 4096 * 4096 // 128 + 2 * 11008 * 4096 // 128 + 4096 * 11008 // 128)
    assert weight_bytes(s, "int4", group_size=128, device_kind="rocm") == linear // 2 + groups * 4 + rest
    assert weight_bytes(s, "int4", device_kind="rocm") == linear // 2 + groups * 4 * 4 + rest  # group 32
    rest_fp32 = (6_738_415_616 - linear) * 4  # on CPU the model around int8/int4 layers is fp32
    head_fp32, head_int8 = 32000 * 4096 * 4, 32000 * (4096 + 2)  # CPU int4: the (untied) LM head as int8 rows
    assert (weight_bytes(s, "int4", group_size=128, device_kind="cpu")
            == linear // 2 + groups * 4 + rest_fp32 - head_fp32 + head_int8)  # int4 scales in bf16
    assert weight_bytes(s, "int8", device_kind="cpu") == linear + scales_int8 + rest_fp32
    # a hydra head is 2 D^2 + D parameters, not SpecMemo's 0.6 GB
    assert heads_bytes(HeadsShape("hydra", 4, 1), s, "bf16") == 4 * (2 * 4096 * 4096 + 4096) * 2


def test_int4_on_cuda_counts_tinygemm_padding():
    s = known_shape("smollm2-135m")  # D 576, I 1536: inputs pad to 1024 / 2048
    padded = [(576, 1024), (192, 1024), (192, 1024), (576, 1024), (1536, 1024), (1536, 1024), (576, 2048)]
    per_layer = sum(o * i // 2 + o * (i // 32) * 4 for o, i in padded)
    linear = sum(o * i for o, i in s.layer_linear_params()) * 30
    assert weight_bytes(s, "int4", device_kind="cuda") == 30 * per_layer + (s.params - linear) * 2
    assert weight_bytes(s, "int4", device_kind="rocm") < weight_bytes(s, "int4", device_kind="cuda")  # no padding


def test_model_shape_matches_real_parameters():
    cfg = tiny_config(vocab_size=300)
    model = tiny_model(vocab_size=300)
    shape = ModelShape.from_spec(ModelSpec.from_config(cfg))
    real = sum(p.numel() for p in model.parameters())
    assert shape.params == real
    assert weight_bytes(shape, "fp32") == sum(p.numel() * p.element_size() for p in model.parameters())


def test_kv_and_heads_match_real_allocations():
    model = tiny_model(vocab_size=300)
    shape = ModelShape.from_spec(model.spec)
    cache = model.new_cache(1000)
    assert cache.nbytes == kv_bytes(shape, 1000, "fp32")
    for kind, layers in (("medusa", 1), ("medusa", 2), ("hydra", 1), ("hydra", 3)):
        heads = random_heads(4, 64, 300, kind=kind, num_layers=layers)
        real = sum(p.numel() * p.element_size() for p in heads.parameters())
        assert heads_bytes(HeadsShape(kind, 4, layers), shape, "fp32") == real, (kind, layers)


def test_tree_buffers_grow_with_nodes():
    s = known_shape("smollm2-135m")
    small, big = tree_buffer_bytes(s, TreeShape(16, 4), 1000, "fp32"), tree_buffer_bytes(s, TreeShape(64, 4), 1000, "fp32")
    assert big > 3.5 * small
    assert tree_buffer_bytes(s, TreeShape(64, 4), 1000, "fp32", sampling=True) >= 64 * 49152 * (4 + 12)  # logits, fp32 probs


def test_greedy_steps_hold_one_block_of_scores_and_the_heads_draft_rows():
    """Greedy verification keeps PICK_ROWS of the LM head's scores per node (a packed CPU
    head all of them), typical acceptance every node's logits and three fp32 copies; the
    heads' draft logits are their rows × the drafting vocabulary."""
    from specmemo_core.planning.memory import PICK_ROWS

    s, n = known_shape("smollm2-135m"), 64
    greedy = tree_buffer_bytes(s, TreeShape(n, 4), 1000, "bf16")  # no heads: a lookup chain alone
    whole = tree_buffer_bytes(s, TreeShape(n, 4), 1000, "bf16", whole_head=True)
    sampled = tree_buffer_bytes(s, TreeShape(n, 4), 1000, "bf16", sampling=True)
    assert whole - greedy == n * (49152 - PICK_ROWS) * 2
    assert sampled - whole == n * 49152 * 12
    hydra = HeadsShape("hydra", 4, 1, draft_vocab=8192)
    assert tree_buffer_bytes(s, TreeShape(n, 4, 28), 1000, "bf16", heads=hydra) - greedy == 28 * 8192 * 2
    assert tree_buffer_bytes(s, TreeShape(n, 4), 1000, "bf16", heads=hydra) - greedy == n * 8192 * 2  # widest unknown: every node
    assert tree_buffer_bytes(s, TreeShape(n, 4, 28), 1000, "bf16", heads=HeadsShape("medusa", 4, 1)) - greedy == 4 * 49152 * 2
    assert tree_buffer_bytes(s, TreeShape(n, 0, 28), 1000, "bf16", heads=hydra) == tree_buffer_bytes(s, TreeShape(n, 0), 1000, "bf16")


def test_unknown_names_are_refused():
    with pytest.raises(SpecMemoError, match="unknown model shape"):
        known_shape("gpt-9")
    with pytest.raises(SpecMemoError, match="unknown precision"):
        weight_bytes(known_shape("vicuna-7b"), "int3")


@pytest.mark.parametrize("context_next", [False, True])
def test_heads_with_a_context_layer_match_real_parameters_and_cache(context_next):
    from specmemo_core.runtime.heads import random_heads
    from specmemo_core.planning.memory import HeadsShape

    cfg = tiny_config(vocab_size=300)
    shape = ModelShape.from_spec(ModelSpec.from_config(cfg))
    heads = random_heads(3, 64, 300, kind="hydra", context=(64, 4, 2, 16), context_next=context_next)
    params = sum(p.numel() * p.element_size() for p in heads.parameters())
    cache = heads.context.new_cache(100, torch.float32, "cpu")
    assert heads_bytes(HeadsShape.from_spec(heads.spec), shape, "fp32", tokens=100) == params + cache.nbytes


def test_a_drafting_vocabulary_costs_its_lm_head_rows():
    s = known_shape("smollm2-135m")
    plain = heads_bytes(HeadsShape("hydra", 4, 1), s, "fp32")
    cut = heads_bytes(HeadsShape("hydra", 4, 1, draft_vocab=8192), s, "fp32")
    assert cut - plain == 8192 * 576 * 4 + 8192 * 8


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_cpu_quantized_weights_are_what_the_quantized_model_holds(precision, tied):
    """On CPU the layers around the quantized ones stay fp32, the LM head packed for oneDNN
    (int8) or held as int8 rows (int4): the count is the bytes the engine's model holds once
    packed (``Engine.load``), its rotary buffer aside."""
    from specmemo_core.runtime.cpu_linear import pack_linears, packing_available
    from specmemo_core.runtime.quantize import QuantSpec, held_bytes, quantize_model

    if precision == "int8" and not packing_available():
        pytest.skip("this torch build has no oneDNN: the int8 model's LM head is not packed")
    model = quantize_model(tiny_model(vocab_size=320, tie_word_embeddings=tied), QuantSpec(precision))
    pack_linears(model, int8_head=precision == "int4")
    shape = ModelShape.from_spec(ModelSpec.from_config(tiny_config(vocab_size=320, tie_word_embeddings=tied)))
    assert held_bytes(model) - model.inv_freq.numel() * 4 == weight_bytes(shape, precision, device_kind="cpu")


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_cpu_quantized_kv_cache_is_counted_as_allocated(precision):
    """On CPU an int8/int4 model keeps its KV cache in fp32 (the dtype around its layers):
    the plan's KV term is the cache the model really allocates, not a 16-bit one."""
    from specmemo_core.planning.planner import memory_terms
    from specmemo_core.runtime.quantize import QuantSpec, quantize_model

    model = quantize_model(tiny_model(vocab_size=300), QuantSpec(precision))
    shape = ModelShape.from_spec(model.spec)
    terms = memory_terms(shape, None, precision=precision, kind="cpu", kv_tokens=999)
    assert terms["kv_cache"] == model.new_cache(1000).nbytes  # 999 tokens + the plain tree's one node
    gpu = memory_terms(shape, None, precision=precision, kind="cuda", kv_tokens=999)
    assert gpu["kv_cache"] * 2 == terms["kv_cache"]
