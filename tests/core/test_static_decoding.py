"""Static-shape decoding (the CUDA-graph groundwork) gives exactly the sliced decoder's tokens."""

import pytest
import torch

from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.heads import random_heads
from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache
from specmemo_core.runtime.step import StepUnit
from specmemo_core.runtime.tree import load_tree
from tests.tiny import tiny_model

# CPU always; CUDA where present, so that on a GPU the graph captures themselves are checked
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _tokens(decoder, prompt, n):
    return [t for s in decoder.generate(prompt, GenerationConfig(max_new_tokens=n)) for t in s.token_ids]


@pytest.mark.parametrize("tree_name", [None, "medusa-64", "1-10-16-17", "chain-3"])
def test_static_decoder_equals_the_sliced_plain_decoder(tree_name):
    torch.set_num_threads(1)
    model = tiny_model(seed=11, vocab_size=16)
    prompt = torch.randint(0, 16, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = _tokens(Decoder(model, model.new_cache(300)), prompt, 100)
    tree = load_tree(tree_name) if tree_name else None
    heads = random_heads(4, 64, 16, seed=5, scale=0.5, kind="hydra") if tree else None
    static = StaticDecoder(model, new_static_cache(model, 300), heads, tree)
    steps = list(static.generate(prompt, GenerationConfig(max_new_tokens=100)))
    assert [t for s in steps for t in s.token_ids] == plain
    if tree is not None:
        assert max(s.accepted for s in steps) > 1  # accepted paths were committed, not only roots
    # the committed cache equals what the sliced decoder builds for the same history
    ref = Decoder(model, model.new_cache(300))
    _tokens(ref, static.history + [0], 1)
    n = static.cache.length
    assert n == len(static.history) and int(static.cache.length_t) == n
    assert torch.allclose(static.cache.k[:, :, :n], ref.cache.k[:, :, :n], atol=1e-5)


def test_static_decoder_reuses_a_shared_prefix_on_the_next_turn():
    model = tiny_model(seed=2, vocab_size=300)
    heads = random_heads(4, 64, 300, seed=1, scale=0.5, kind="hydra")
    static = StaticDecoder(model, new_static_cache(model, 400), heads, load_tree("1-3-2"))
    plain = Decoder(model, model.new_cache(400))
    first = list(range(10, 40))
    a = _tokens(static, first, 20)
    assert a == _tokens(plain, first, 20)
    second = first + a + [5, 6, 7]
    assert _tokens(static, second, 20) == _tokens(plain, second, 20)
    assert int(static.cache.length_t) == static.cache.length


def test_static_decoder_needs_a_static_cache():
    model = tiny_model(seed=2, vocab_size=300)
    with pytest.raises(TypeError, match="StaticKVCache"):
        StaticDecoder(model, model.new_cache(100))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["hydra", "medusa"])
@pytest.mark.parametrize("tree_name", [None, "medusa-64", "1-10-16-17", "1-10-16-17+lookup-8"])
def test_greedy_step_units_give_the_same_tokens(tree_name, kind, device):
    """The graph path (whole greedy steps as units: captured CUDA graphs on a GPU, run
    eagerly on CPU) decodes exactly as plain greedy, and the caches' device lengths
    stay equal to their host mirrors."""
    torch.set_num_threads(1)
    model = tiny_model(seed=11, vocab_size=16, device=device)
    prompt = torch.randint(0, 16, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = _tokens(Decoder(model, model.new_cache(300)), prompt, 100)
    tree = load_tree(tree_name) if tree_name else None
    heads = random_heads(4, 64, 16, seed=5, scale=0.5, kind=kind).to(device) if tree else None
    static = StaticDecoder(model, new_static_cache(model, 300), heads, tree, graphs=True)
    steps = list(static.generate(prompt, GenerationConfig(max_new_tokens=100)))
    assert [t for s in steps for t in s.token_ids] == plain
    assert static.units  # the step units were used
    assert all((s.graph is not None) == (device == "cuda") for s in static.units.values())
    if tree is not None:
        assert any(n == tree.num_nodes for n, _ in static.units)  # the tree's own unit, not only plain steps
        assert max(s.accepted for s in steps) > 1
    assert int(static.cache.length_t) == static.cache.length == len(static.history)
    # a second turn on the same decoder (units and graphs made once) still decodes exactly
    second = static.history + [3, 4, 5]
    assert _tokens(static, second, 40) == _tokens(Decoder(model, model.new_cache(300)), second, 40)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graphs,context_next", [(False, False), (True, False), (True, True)])
def test_heads_with_a_context_layer_draft_alike_in_both_decoders(graphs, device, context_next):
    """With a context layer the static decoder keeps the layer's cache in step and drafts
    exactly what the sliced decoder drafts: same tokens and same accepted count per step."""
    torch.set_num_threads(1)
    model = tiny_model(seed=11, vocab_size=16, device=device)
    heads = random_heads(4, 64, 16, seed=5, scale=0.5, kind="hydra", context=(64, 4, 2, 16),
                         context_next=context_next).to(device)
    tree = load_tree("1-10-16-17")
    prompt = torch.randint(0, 16, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    sliced = Decoder(model, model.new_cache(300), heads, tree)
    static = StaticDecoder(model, new_static_cache(model, 300), heads, tree, graphs=graphs)
    a = [(s.token_ids, s.accepted) for s in sliced.generate(prompt, GenerationConfig(max_new_tokens=80))]
    b = [(s.token_ids, s.accepted) for s in static.generate(prompt, GenerationConfig(max_new_tokens=80))]
    assert a == b and max(n for _, n in b) > 1
    assert int(static.context_cache.length_t) == static.context_cache.length == static.cache.length


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tree_name", [None, "1-10-16-17+lookup-8"])
def test_units_made_before_the_first_turn_decode_alike(tree_name, device):
    """``capture`` makes the step unit on the empty cache (as the bench does before its
    clock starts, with its prompt chunks' graphs); the conversation then decodes exactly as
    plain greedy, with the cache and its device length untouched by the capture's trial runs."""
    torch.set_num_threads(1)
    model = tiny_model(seed=11, vocab_size=16, device=device)
    prompt = torch.randint(0, 16, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = _tokens(Decoder(model, model.new_cache(300)), prompt, 60)
    tree = load_tree(tree_name) if tree_name else None
    heads = random_heads(4, 64, 16, seed=5, scale=0.5, kind="hydra").to(device) if tree else None
    static = StaticDecoder(model, new_static_cache(model, 300), heads, tree, graphs=True)
    static.capture(prefill=True)
    n = tree.num_nodes if tree else 1
    assert list(static.units) == [(n, span) for span in static.cache.spans()] == [(n, 256), (n, 300)]
    assert int(static.cache.length_t) == static.cache.length == 0
    # on a GPU every padded prompt chunk's graph too: buckets 16…256 over both spans
    prefill_graphs = dict(static._prefill_graphs)
    assert len(prefill_graphs) == (10 if device == "cuda" else 0)
    assert _tokens(static, prompt, 60) == plain
    assert len(static.units) == 2  # the captured units were the ones used
    assert static._prefill_graphs == prefill_graphs  # and the captured prompt chunks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tree_name", [None, "1-10-16-17+lookup-8"])
def test_steps_attend_over_growing_spans_and_decode_alike(tree_name, device):
    """A conversation that grows past 256 and 512 slots moves to units attending over
    larger spans (256, 512, then the whole cache) and still decodes exactly as plain
    greedy; here over a model with fused projections and heads with a context layer, each
    step started before the last is read."""
    torch.set_num_threads(1)
    model = tiny_model(seed=11, vocab_size=16, device=device)
    prompt = torch.randint(0, 16, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = _tokens(Decoder(model, model.new_cache(700)), prompt, 400)
    tree = load_tree("1-10-16-17").with_lookup(8) if tree_name else None
    heads = random_heads(4, 64, 16, seed=5, scale=0.5, kind="hydra", context=(64, 4, 2, 16)).to(device) if tree else None
    assert model.fuse_projections()
    # each step started before the last is read (as on a GPU by default): units for the next
    # span are made (captured, on a GPU) only between steps
    static = StaticDecoder(model, new_static_cache(model, 700), heads, tree, graphs=True, overlap=True)
    assert static.cache.spans() == [256, 512, 700]
    steps = list(static.generate(prompt, GenerationConfig(max_new_tokens=400)))
    assert [t for s in steps for t in s.token_ids] == plain
    assert sorted({span for _, span in static.units}) == [256, 512, 700]
    assert all((s.graph is not None) == (device == "cuda") for s in static.units.values())
    assert int(static.cache.length_t) == static.cache.length == len(static.history)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads_kind", [None, "hydra", "context", "context-next"])
def test_bucketed_prefill_decodes_as_the_eager_prefill(heads_kind, device):
    """Prompt chunks padded to bucket lengths (replayed as CUDA graphs on a GPU, run eagerly
    here) leave the caches, the draft state and every step's drafts as the eager prefill
    does: over a first turn, a next turn that reuses the cached prefix, a prompt of two
    chunks, and one whose padding would pass the cache's end (prefilled eagerly)."""
    torch.set_num_threads(1)
    model = tiny_model(seed=11, vocab_size=16, device=device)
    context = (64, 4, 2, 16) if heads_kind in ("context", "context-next") else None
    heads = (random_heads(4, 64, 16, seed=5, scale=0.5, kind="hydra", context=context,
                          context_next=heads_kind == "context-next").to(device) if heads_kind else None)
    tree = load_tree("1-10-16-17+lookup-8") if heads_kind else None
    for capacity, prompt_len, turns in ((1300, 20, 2), (1300, 600, 1), (400, 300, 1)):
        runs = []
        for bucketed in (True, False):
            static = StaticDecoder(model, new_static_cache(model, capacity), heads, tree, graphs=True,
                                   bucketed_prefill=bucketed)
            prompt = torch.randint(0, 16, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
            steps = []
            for _ in range(turns):
                steps += [(s.token_ids, s.accepted) for s in static.generate(prompt, GenerationConfig(max_new_tokens=40))]
                prompt = static.history + [3, 4, 5]
            n = static.cache.length
            assert int(static.cache.length_t) == n == len(static.history)
            if static.context_cache is not None:
                assert int(static.context_cache.length_t) == static.context_cache.length == n
            runs.append((steps, static.cache.k[:, :, :n].clone(), static.parts.state.clone(),
                         static._prefill_graphs))
        (steps_b, k_b, state_b, graphs_b), (steps_e, k_e, state_e, _) = runs
        assert steps_b == steps_e
        assert torch.allclose(k_b, k_e, atol=1e-4, rtol=1e-4) and torch.allclose(state_b, state_e, atol=1e-4, rtol=1e-4)
        assert bool(graphs_b) == (device == "cuda" and prompt_len + 512 <= capacity)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads_kind,tree_name", [(None, None), ("hydra", "medusa-64"),
                                                   ("context-next", "1-10-16-17+lookup-8")])
def test_steps_started_before_the_last_is_read_decode_alike(heads_kind, tree_name, device, monkeypatch):
    """``overlap``: each step starts before the host reads the one before (on a GPU the graph
    runs while the host streams the last step; here the same code runs eagerly). Turns that
    end by their token budget, by a stop token and by the consumer closing the stream each
    leave one started step to undo: the next turn still decodes exactly as plain greedy,
    with every cache's device length back at its host length, and a stream closed early
    leaves the conversation as far as it was read."""
    torch.set_num_threads(1)
    launches = []
    real_launch = StepUnit.launch
    monkeypatch.setattr(StepUnit, "launch", lambda unit, **kw: launches.append(kw["ahead"]) or real_launch(unit, **kw))
    model = tiny_model(seed=11, vocab_size=300, device=device)
    tree = load_tree(tree_name) if tree_name else None
    heads = (random_heads(4, 64, 300, seed=5, scale=0.5, kind="hydra", context=(64, 4, 2, 16) if "context" in heads_kind
                          else None, context_next=heads_kind == "context-next").to(device) if heads_kind else None)
    static = StaticDecoder(model, new_static_cache(model, 400), heads, tree, graphs=True, overlap=True)
    plain = Decoder(model, model.new_cache(400))
    prompt = list(range(10, 40))
    want = _tokens(plain, prompt, 60)
    for config in (GenerationConfig(max_new_tokens=30), "stop", None):
        launches.clear()
        if config == "stop":  # a token the reply reaches after its first steps
            stop = next(t for i, t in enumerate(want) if i >= 8 and t not in want[:i])
            config = GenerationConfig(max_new_tokens=60, stop_token_ids={stop})
        if config is None:  # the consumer stops reading after three steps
            stream = static.generate(prompt, GenerationConfig(max_new_tokens=60))
            got = [t for _, s in zip(range(4), stream) for t in s.token_ids]
            stream.close()
            assert got == want[:len(got)] and len(static.history) == len(prompt) + len(got) - 1
        else:
            steps = list(static.generate(prompt, config))
            got = [t for s in steps for t in s.token_ids]
            reference = want[:30] if config.stop_token_ids == frozenset() else want[:want.index(stop)]
            assert got == reference
        assert launches.count(0) == 1 and len(launches) >= 3 and all(a > 0 for a in launches[1:])
        for cache in (static.cache, static.context_cache):
            if cache is not None:
                assert int(cache.length_t) == cache.length == len(static.history)
        prompt = static.history + [3, 4, 5]
        want = _tokens(plain, prompt, 60)
    assert _tokens(static, prompt, 60) == want


def test_steps_run_ahead_only_where_the_cache_has_room():
    """Near the cache's end a step is started only once the last is read (its worst-case room
    must hold both), and the conversation fills the cache exactly as the plain decoder's does."""
    from specmemo_core.errors import ContextFullError

    torch.set_num_threads(1)
    model = tiny_model(seed=11, vocab_size=16)
    heads = random_heads(4, 64, 16, seed=5, scale=0.5, kind="hydra")
    prompt = torch.randint(0, 16, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = []
    for decoder in (Decoder(model, model.new_cache(60)),
                    StaticDecoder(model, new_static_cache(model, 60), heads, load_tree("1-10-16-17"), graphs=True,
                                  overlap=True)):
        got = []
        with pytest.raises(ContextFullError):
            for step in decoder.generate(prompt, GenerationConfig(max_new_tokens=100)):
                got += step.token_ids
        runs.append(got)
        if isinstance(decoder, StaticDecoder):
            assert int(decoder.cache.length_t) == decoder.cache.length
    assert runs[0] == runs[1] and len(runs[0]) > 30


def test_a_reply_stream_dropped_unfinished_leaves_the_next_turn_exact():
    """A reply's stream left unfinished (not closed: an app that drops it) still holds a
    step started ahead: the next turn undoes it before it prefills, and when the old stream
    is closed at last (garbage collection, later) it undoes nothing of the new turn's."""
    torch.set_num_threads(1)
    model = tiny_model(seed=11, vocab_size=300)
    heads = random_heads(4, 64, 300, seed=5, scale=0.5, kind="hydra")
    static = StaticDecoder(model, new_static_cache(model, 400), heads, load_tree("1-10-16-17+lookup-8"),
                           graphs=True, overlap=True)
    plain = Decoder(model, model.new_cache(400))
    prompt = list(range(10, 40))
    dropped = static.generate(prompt, GenerationConfig(max_new_tokens=60))
    got = [t for _, s in zip(range(3), dropped) for t in s.token_ids]
    assert got == _tokens(plain, prompt, 60)[:len(got)] and static._ahead is not None
    second = static.history + [3, 4, 5]
    steps = static.generate(second, GenerationConfig(max_new_tokens=40))
    first_two = [next(steps), next(steps)]  # the new turn has a step in flight of its own now
    dropped.close()  # the old stream's cleanup runs late
    rest = [t for s in first_two for t in s.token_ids] + [t for s in steps for t in s.token_ids]
    assert rest == _tokens(plain, second, 40)
    assert int(static.cache.length_t) == static.cache.length == len(static.history)


def test_a_step_names_its_phases_to_the_profiler():
    """``run_step``'s phases are profiler ranges, in order, each around the operators it runs
    (``scripts/time_graph_steps.py --kernels`` sums a GPU step's kernels by them)."""
    from specmemo_core.runtime.step import STEP_PHASES, GreedyAcceptance

    model = tiny_model(seed=2, vocab_size=300)
    heads = random_heads(4, 64, 300, seed=1, scale=0.5, kind="hydra")
    static = StaticDecoder(model, new_static_cache(model, 400), heads, load_tree("1-3-2"))
    next(static.generate(list(range(10, 40)), GenerationConfig(max_new_tokens=2)))
    step = StepUnit(static.parts, static._buffers, GreedyAcceptance(), span=static.cache.span_for(6))
    with torch.profiler.profile() as prof:
        step()
    ranges = [e for e in prof.events() if e.name in STEP_PHASES]
    assert [e.name for e in ranges] == list(STEP_PHASES)
    assert all(a.time_range.end <= b.time_range.start for a, b in zip(ranges, ranges[1:]))
    for e in ranges:
        inside = [c for c in prof.events() if c.name.startswith("aten::")
                  and e.time_range.start <= c.time_range.start < e.time_range.end]
        assert inside, f"no operator ran inside {e.name}"
