"""Layer split (runtime/split.py, runtime/split_cache.py): a model whose decoder layers run in
segments on several devices decodes token for token as the unsplit one. On a CPU-only
machine the segments are two (or three) CPU placements through the same code path; the
CUDA cases run where one or two GPUs are."""

import pytest
import torch

from specmemo_core.errors import SplitError
from specmemo_core.runtime.batch import BatchDecoder
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.heads import random_heads
from specmemo_core.runtime.split import LayerSplit, split_model
from specmemo_core.runtime.split_cache import SplitCache
from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache
from specmemo_core.runtime.tree import load_tree
from tests.tiny import tiny_model

LAYERS, VOCAB = 5, 16  # a small vocabulary makes drafts often right: accepted paths are committed
PROMPT = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3)).tolist()
SPLITS = [("cpu", "cpu"), ("cpu", "cpu", "cpu")]
TREES = [(None, None), ("1-10-16-17", "medusa"), ("medusa-64", "hydra"), ("1-10-16-17+lookup-8", "hydra")]


def _model(devices=None, layers=None, device="cpu", **kw):
    model = tiny_model(seed=11, vocab_size=VOCAB, layers=LAYERS, device=device, **kw)
    if devices is not None:
        split = LayerSplit.of(devices, layers) if layers else LayerSplit.even(devices, LAYERS)
        split_model(model, split)
    return model


def _tokens(decoder, n=60):
    steps = list(decoder.generate(PROMPT, GenerationConfig(max_new_tokens=n)))
    return [t for s in steps for t in s.token_ids], max(s.accepted for s in steps)


def _heads(kind, device="cpu"):
    return random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind=kind).to(device) if kind else None


@pytest.fixture(scope="module")
def plain():
    torch.set_num_threads(1)
    model = _model()
    return _tokens(Decoder(model, model.new_cache(300)))[0]


@pytest.mark.parametrize("devices", SPLITS)
@pytest.mark.parametrize("tree_name, kind", TREES)
def test_split_greedy_equals_unsplit_greedy(plain, devices, tree_name, kind):
    model = _model(devices)
    cache = model.new_cache(300)
    assert isinstance(cache, SplitCache) and [p.k.shape[0] for p in cache.parts] == list(model.placement.split.layers)
    tree = load_tree(tree_name) if tree_name else None
    out, most = _tokens(Decoder(model, cache, _heads(kind), tree))
    assert out == plain
    if tree is not None:
        assert most > 1  # accepted drafts were committed in every segment's cache, not only roots


@pytest.mark.parametrize("layers", [(1, 4), (4, 1), (0, 5), (5, 0)])
def test_uneven_segments_and_a_tied_lm_head(layers):
    """Either segment of one layer or of none (a card with only the embedding, or only the LM
    head); a tied LM head (the default model's) keeps reading the embedding."""
    torch.set_num_threads(1)
    whole = _model(tie_word_embeddings=True)
    reference = _tokens(Decoder(whole, whole.new_cache(300)))[0]
    model = _model(("cpu", "cpu"), layers, tie_word_embeddings=True)
    assert _tokens(Decoder(model, model.new_cache(300), _heads("hydra"), load_tree("1-10-16-17")))[0] == reference


def test_static_step_units_over_a_split_model(plain):
    """The static decoder's step units (CUDA graphs on a GPU, eager here) over segment caches."""
    model = _model(("cpu", "cpu"))
    static = StaticDecoder(model, new_static_cache(model, 300), _heads("hydra"), load_tree("1-10-16-17"),
                           graphs=True)
    assert isinstance(static.cache, SplitCache)
    assert _tokens(static)[0] == plain


def test_each_sequence_of_a_batch_over_a_split_model_decodes_as_unsplit():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 12, 20)]
    whole = _model()
    alone = [[t for s in Decoder(whole, whole.new_cache(128)).generate(p, GenerationConfig(max_new_tokens=16))
              for t in s.token_ids] for p in prompts]
    model = _model(("cpu", "cpu"))
    for (tree_name, kind), staged in [((None, None), False), (("1-10-16-17+lookup-8", "hydra"), False),
                                      (("1-10-16-17+lookup-8", "hydra"), True)]:
        dec = BatchDecoder(model, slots=4, capacity=128, heads=_heads(kind),
                           tree=load_tree(tree_name) if tree_name else None, staged_prefill=staged)
        assert (dec._staged is not None) == staged  # segments on one device: the staging row copies into each
        assert isinstance(dec.cache, SplitCache)
        for i, p in enumerate(prompts):
            dec.add(i, p, max_new_tokens=16)
        outs = {i: [] for i in range(len(prompts))}
        while dec.active:
            for i, tokens in dec.step().items():
                outs[i] += tokens
        assert [outs[i] for i in range(len(prompts))] == alone


def test_placement_puts_each_part_on_its_device():
    """Placed over cpu and meta (meta allocates nothing): the embedding on the first device,
    each segment's layers and KV cache on theirs, norm, LM head (a copy, when tied) and the
    rope frequencies of the step on the last; the model's device is the last."""
    model = _model(("cpu", "meta"), (2, 3), tie_word_embeddings=True)
    on = {name: p.device.type for name, p in model.named_parameters()}
    assert on["model.embed_tokens.weight"] == "cpu"
    assert {on[n] for n in on if n.startswith(("model.layers.0.", "model.layers.1."))} == {"cpu"}
    assert {on[n] for n in on if n.startswith(("model.layers.2.", "model.layers.3.", "model.layers.4."))} == {"meta"}
    assert on["model.norm.weight"] == on["lm_head.weight"] == "meta"
    assert model.device.type == "meta" and model.inv_freq.device.type == "meta"
    assert [f.device.type for f in model.placement.inv_freqs] == ["cpu", "meta"]
    cache = model.new_cache(64)
    assert [(p.k.device.type, p.k.shape[0]) for p in cache.parts] == [("cpu", 2), ("meta", 3)]
    assert cache.ids.device.type == "meta" and not model.capturable
    assert _model(("cpu", "cpu")).capturable  # two segments on one device: one graph holds them


def test_a_split_that_does_not_match_the_model_is_refused_with_what_to_do():
    with pytest.raises(SplitError, match="summing to it"):
        split_model(_model(), LayerSplit.of(["cpu", "cpu"], [2, 2]))
    with pytest.raises(SplitError, match="cannot be negative"):
        LayerSplit.of(["cpu", "cpu"], [6, -1])
    with pytest.raises(SplitError, match="at most 5 devices"):
        LayerSplit.even(["cpu"] * 6, 5)
    with pytest.raises(SplitError, match="already split"):
        split_model(_model(("cpu", "cpu")), LayerSplit.of(["cpu"], [5]))
    assert LayerSplit.even(["cpu"] * 3, 5).layers == (2, 2, 1)


CUDA_SPLITS = [
    pytest.param(("cuda:0", "cuda:0"), marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
    pytest.param(("cuda:0", "cuda:1"), marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                reason="needs two CUDA GPUs")),
]


@pytest.mark.parametrize("devices", CUDA_SPLITS)
def test_split_over_gpus_greedy_equals_one_gpu(devices):
    whole = _model(device="cuda:0")
    reference = _tokens(Decoder(whole, whole.new_cache(300)))[0]
    model = _model(devices)
    tree = load_tree("1-10-16-17+lookup-8")
    assert _tokens(Decoder(model, model.new_cache(300), _heads("hydra", model.device), tree))[0] == reference


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory):
    from tests.tiny import save_tiny_model_folder

    return save_tiny_model_folder(tmp_path_factory.mktemp("tiny-llama-5"), layers=LAYERS)


@pytest.mark.parametrize("precision", [None, "int8"])
def test_an_engine_loaded_split_chats_as_the_one_loaded_whole(tiny_model_folder, precision):
    """The app's path, Engine.load → new_session → send, over two turns; int8 layers are
    quantized where they run, after the split."""
    from specmemo_core.runtime.engine import Engine

    replies = []
    for split in (None, LayerSplit.of(["cpu", "cpu"], [3, 2])):
        engine = Engine.load(str(tiny_model_folder), heads="random", tree="1-10-16-17+lookup-8",
                             precision=precision, split=split)
        assert (engine.model.placement is not None) == (split is not None)
        session = engine.new_session(capacity=300)
        replies.append(["".join(p.text for p in session.send(turn, GenerationConfig(max_new_tokens=30)))
                        for turn in ("Hello, how are you?", "Tell me about the quick brown fox.")])
    assert replies[0] == replies[1] and all(replies[0])
    with pytest.raises(SplitError, match="cannot also stream"):
        Engine.load(str(tiny_model_folder), heads="none", resident_layers=2, split=LayerSplit.even(["cpu"] * 2, 5))
