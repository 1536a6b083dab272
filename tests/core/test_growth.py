"""Grown (dynamic) draft trees: the layout a step grows, and exactness of decoding on them."""

import pytest
import torch

from specmemo_core.errors import TreeError
from specmemo_core.runtime.batch import BatchDecoder
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.growth import Growth, grown_layout, pick_nodes
from specmemo_core.runtime.heads import random_heads
from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache
from specmemo_core.runtime.tree import Tree, load_tree, tree_name
from tests.tiny import tiny_model

CONTEXT = (64, 4, 2, 16)  # the tiny model's attention shape


def _tokens(decoder, prompt, n):
    return [t for s in decoder.generate(prompt, GenerationConfig(max_new_tokens=n)) for t in s.token_ids]


def test_dynamic_names_load_with_their_growth_and_sizes():
    tree = load_tree("dynamic-8+lookup-3")
    assert tree.num_nodes == 11 and tree.depth == 4 and tree.lookup == 3
    assert tree.growth == Growth(nodes=7, depth=4, beam=4, topk=4)
    assert tree_name(tree) == "dynamic-8+lookup-3" and tree.width == 5
    buf = tree.buffers
    assert buf.depths.shape == (11,) and buf.retrieve_indices.shape == (8, 5)  # 7 heads' rows + the chain's
    assert load_tree("dynamic-2").growth == Growth(nodes=1, depth=1, beam=2, topk=2)
    with pytest.raises(TreeError, match="at least 2 nodes"):
        load_tree("dynamic-1")


def test_picked_nodes_always_form_a_tree_even_when_a_child_is_certain():
    """Scores as the heads make them: a child's is its parent's plus a log-probability
    (0 where the head is certain) less the tie-break. The picked set keeps every picked
    node's ancestors, parents first."""
    # candidates: level 1 = 0, 1, 2; level 2 = children of 0 (3, 4) and of 1 (5, 6)
    scores = torch.tensor([-0.1, -0.5, -3.0, -0.1 - 1e-3, -2.0, -0.5 - 1e-3, -4.0])
    ancestors = torch.tensor([[0, -1], [1, -1], [2, -1], [0, 3], [0, 4], [1, 5], [1, 6]])
    picked, depth, anc = (t[0] for t in pick_nodes(scores[None], ancestors[None], 4))
    assert picked.tolist() == [0, 3, 1, 5]
    assert depth.tolist() == [1, 2, 1, 2]
    assert anc.tolist() == [[1, -1], [1, 2], [3, -1], [3, 4]]  # node positions: parents precede children
    tree = Tree(name="grown", paths=(), lookup=2, growth=Growth(nodes=4, depth=2, beam=2, topk=2))
    layout = grown_layout(tree.buffers, depth, anc)
    assert layout.depths.tolist() == [0, 1, 2, 1, 2, 1, 2]
    assert layout.parents.tolist()[:5] == [-1, 0, 1, 0, 3]
    assert layout.attn_mask.int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 1, 0],  # the lookup chain, as its static rows
        [1, 0, 0, 0, 0, 1, 1],
    ]
    assert layout.retrieve_indices.tolist() == [[0, 1, -1], [0, 1, 2], [0, 3, -1], [0, 3, 4], [0, 5, 6]]


@pytest.mark.parametrize("tree_name", ["dynamic-4", "dynamic-8", "dynamic-24+lookup-3", "dynamic-64"])
@pytest.mark.parametrize("vocab", [16, 300])
def test_greedy_on_a_grown_tree_equals_plain_greedy(tree_name, vocab):
    """Random hydra heads with a context layer: whatever tree they grow, the tokens are the
    plain greedy ones; with 16 tokens drafts are often right, so the accept path runs."""
    model = tiny_model(seed=11, vocab_size=vocab)
    tree = load_tree(tree_name)
    heads = random_heads(4, 64, vocab, seed=5, scale=0.5, kind="hydra", context=CONTEXT)
    prompt = torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = _tokens(Decoder(model, model.new_cache(300)), prompt, 100)
    dec = Decoder(model, model.new_cache(300 + tree.num_nodes), heads, tree)
    steps = list(dec.generate(prompt, GenerationConfig(max_new_tokens=100)))
    assert [t for s in steps for t in s.token_ids] == plain
    assert dec.context_cache.length == dec.cache.length
    if vocab == 16:
        assert max(s.accepted for s in steps if not s.prefill) > 1  # grown drafts were accepted, not only rejected


def test_the_static_decoder_grows_trees_alike():
    model = tiny_model(seed=13, vocab_size=16)
    heads = random_heads(4, 64, 16, seed=2, scale=0.5, kind="hydra", context=CONTEXT)
    tree = load_tree("dynamic-12+lookup-3")
    prompt = list(range(1, 15))
    plain = _tokens(Decoder(model, model.new_cache(300)), prompt, 80)
    static = StaticDecoder(model, new_static_cache(model, 300), heads, tree)
    assert _tokens(static, prompt, 80) == plain
    assert _tokens(static, prompt + plain + [2, 3], 20) == _tokens(Decoder(model, model.new_cache(300)),
                                                                prompt + plain + [2, 3], 20)


def test_a_grown_tree_is_refused_where_it_cannot_run():
    model = tiny_model(seed=13, vocab_size=16)
    with pytest.raises(TreeError, match="hydra"):
        Decoder(model, model.new_cache(100), random_heads(4, 64, 16, kind="medusa"), load_tree("dynamic-8"))
    with pytest.raises(TreeError, match="hydra"):  # a batch grows along the same heads' paths
        BatchDecoder(model, slots=2, capacity=100, heads=random_heads(4, 64, 16, kind="medusa"),
                     tree=load_tree("dynamic-8"))
    with pytest.raises(TreeError, match="4 draft heads"):
        Decoder(model, model.new_cache(100), random_heads(3, 64, 16, kind="hydra"), load_tree("dynamic-8"))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tree_name", ["dynamic-8", "dynamic-24+lookup-8", "dynamic-48+lookup-64"])
def test_grown_trees_in_step_units_and_cuda_graphs_equal_plain_greedy(tree_name, device):
    """The graph path: a grown tree's whole step (growing included) is one unit, captured as a
    CUDA graph on a GPU and replayed; every replay grows that step's own tree. Past the planner's
    64-node cap too (112 nodes)."""
    torch.set_num_threads(1)
    model = tiny_model(seed=11, vocab_size=16, device=device)
    prompt = torch.randint(0, 16, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = _tokens(Decoder(model, model.new_cache(300)), prompt, 100)
    tree = load_tree(tree_name)
    heads = random_heads(4, 64, 16, seed=5, scale=0.5, kind="hydra", context=CONTEXT).to(device)
    static = StaticDecoder(model, new_static_cache(model, 300), heads, tree, graphs=True)
    steps = list(static.generate(prompt, GenerationConfig(max_new_tokens=100)))
    assert [t for s in steps for t in s.token_ids] == plain
    assert any(n == tree.num_nodes for n, _ in static.units)
    assert all((s.graph is not None) == (device == "cuda") for s in static.units.values())
    assert max(s.accepted for s in steps) > 1
    second = static.history + [3, 4, 5]
    assert _tokens(static, second, 40) == _tokens(Decoder(model, model.new_cache(300)), second, 40)
