"""Batched decoding (runtime/batch.py): every sequence of a batch decodes exactly as it
would alone, whoever joins, leaves or shares the forward with it."""

import pytest
import torch

from specmemo_core.errors import BatchError, BatchFullError, PromptTooLongError
from specmemo_core.runtime.batch import BatchDecoder
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.heads import random_heads
from specmemo_core.runtime.tree import load_tree
from tests.tiny import tiny_model

VOCAB = 16  # a small vocabulary makes drafts often right: accepted paths are committed, not only roots
LENGTHS = (5, 12, 20, 9, 30)  # prompt lengths: every row sits at its own length
BUDGETS = (24, 10, 18, 24, 6)  # new tokens: sequences leave at different steps
ARRIVALS = (0, 0, 1, 3, 4)  # the step before which each sequence may join
REMOVED, REMOVED_AFTER = 2, 3  # sequence 2 is removed after 3 of its steps
CAPACITY = 128


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model(seed=11, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def alone(model, prompts):
    """Each prompt decoded by itself with the single-sequence Decoder, plain greedy."""
    out = []
    for prompt, budget in zip(prompts, BUDGETS):
        decoder = Decoder(model, model.new_cache(CAPACITY))
        out.append([t for s in decoder.generate(prompt, GenerationConfig(max_new_tokens=budget)) for t in s.token_ids])
    assert len({tuple(r[:6]) for r in out}) == len(out)  # distinct replies: rows mixed up would show
    return out


def _drive(dec, prompts, configs=None):
    """Sequences join when they have arrived and a slot is free; sequence REMOVED leaves
    after REMOVED_AFTER steps. Returns {id: tokens} and the largest step emitted by one sequence."""
    configs = configs or [GenerationConfig()] * len(prompts)
    waiting, outs, steps_of, step, most = list(range(len(prompts))), {}, {}, 0, 0
    while waiting or dec.active:
        while waiting and dec.free_slots and ARRIVALS[waiting[0]] <= step:
            i = waiting.pop(0)
            dec.add(i, prompts[i], max_new_tokens=BUDGETS[i], config=configs[i])
            outs[i], steps_of[i] = [], 0
        for i, tokens in dec.step().items():
            outs[i] += tokens
            steps_of[i] += 1
            most = max(most, len(tokens) - (steps_of[i] == 1))  # the first step also brings the prefill's token
            if i == REMOVED and steps_of[i] == REMOVED_AFTER and i in dec.active:
                dec.remove(i)
        step += 1
    return outs, most


# a grown tree: each sequence grows its own tree every step (per-row layouts)
TREES = [(None, None), ("1-10-16-17", "medusa"), ("lookup-8", None), ("1-3-2+lookup-4", "hydra"),
         ("dynamic-8+lookup-3", "hydra")]


@pytest.mark.parametrize("tree_name, kind", TREES)
@pytest.mark.parametrize("slots", [1, 2, 5])
def test_each_sequence_of_a_batch_decodes_as_it_would_alone(model, prompts, alone, tree_name, kind, slots):
    tree = load_tree(tree_name) if tree_name else None
    heads = random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind=kind) if kind else None
    dec = BatchDecoder(model, slots=slots, capacity=CAPACITY, heads=heads, tree=tree)
    k = dec.cache.k.data_ptr()
    outs, most = _drive(dec, prompts)
    for i, reference in enumerate(alone):
        if i == REMOVED:
            assert outs[i] == reference[:len(outs[i])] and len(outs[i]) < len(reference)
        else:
            assert outs[i] == reference, f"sequence {i}"
    assert dec.cache.k.data_ptr() == k and not dec.active and dec.free_slots == slots  # allocated once, all freed
    if tree is not None:
        assert most > 1  # drafts were accepted
    else:
        assert most == 1


@pytest.mark.parametrize("context_next", [False, True])
def test_heads_with_a_context_layer_batch_too(model, prompts, alone, context_next):
    heads = random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind="hydra", context=(64, 4, 2, 16),
                         context_next=context_next)
    dec = BatchDecoder(model, slots=3, capacity=CAPACITY, heads=heads, tree=load_tree("1-10-16-17"))
    outs, most = _drive(dec, prompts)
    assert all(outs[i] == alone[i] for i in range(len(prompts)) if i != REMOVED) and most > 1


@pytest.mark.parametrize("tree_name", ["1-3-2+lookup-4", "dynamic-8"])
def test_greedy_and_sampled_sequences_share_a_batch(model, prompts, alone, tree_name):
    """Sampled rows accept by their own rule and generator: greedy rows are unchanged, and
    a sampled row's tokens are reproducible from its seed."""
    tree, heads = load_tree(tree_name), random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind="hydra")
    sampled = GenerationConfig(temperature=0.8, seed=7)
    configs = [GenerationConfig(), sampled, GenerationConfig(), sampled, GenerationConfig()]
    runs = [_drive(BatchDecoder(model, slots=5, capacity=CAPACITY, heads=heads, tree=tree), prompts, configs)[0]
            for _ in range(2)]
    assert runs[0] == runs[1]
    for i in (0, 4):
        assert runs[0][i] == alone[i]
    assert runs[0][3] != alone[3][:len(runs[0][3])] and len(runs[0][3]) == BUDGETS[3]


def test_a_stop_token_ends_one_sequence_and_frees_its_slot(model, prompts, alone):
    stop = alone[0][7]
    cut = alone[0][:alone[0].index(stop)]
    dec = BatchDecoder(model, slots=2, capacity=CAPACITY, heads=random_heads(4, 64, VOCAB, seed=5, scale=0.5),
                       tree=load_tree("1-10-16-17"))
    dec.add("a", prompts[0], max_new_tokens=24, config=GenerationConfig(stop_token_ids=frozenset({stop})))
    dec.add("b", prompts[3], max_new_tokens=24)
    out = {"a": [], "b": []}
    while "a" not in dec.finished:
        for i, tokens in dec.step().items():
            out[i] += tokens
    assert out["a"] == cut and dec.finish_reasons["a"] == "stop" and dec.active == ["b"] and dec.free_slots == 1
    dec.add("c", prompts[1], max_new_tokens=10)  # the freed slot takes a new sequence at once
    while dec.active:
        for i, tokens in dec.step().items():
            out.setdefault(i, []).extend(tokens)
    assert out["b"] == alone[3] and out["c"] == alone[1] and dec.finish_reasons == {"b": "length"} | (
        {"c": "length"} if "c" in dec.finish_reasons else {})


def test_a_sequence_whose_slot_fills_ends_with_reason_length(model, prompts):
    dec = BatchDecoder(model, slots=2, capacity=40, tree=None)
    dec.add(0, prompts[4], max_new_tokens=100)  # 30 prompt tokens: room for 10 more, and the last token
    out = []
    while dec.active:
        out += dec.step()[0]
    reference = Decoder(model, model.new_cache(CAPACITY)).generate(prompts[4], GenerationConfig(max_new_tokens=11))
    assert dec.finish_reasons == {0: "length"} and out == [t for s in reference for t in s.token_ids]


def test_batch_errors_say_what_to_do(model, prompts):
    dec = BatchDecoder(model, slots=1, capacity=32)
    with pytest.raises(PromptTooLongError, match="larger capacity per slot"):
        dec.add("long", list(range(32)), max_new_tokens=4)
    with pytest.raises(BatchError, match="empty prompt"):
        dec.add("empty", [], max_new_tokens=4)
    dec.add("a", prompts[0], max_new_tokens=4)
    with pytest.raises(BatchError, match="already decoding"):
        dec.add("a", prompts[0], max_new_tokens=4)
    with pytest.raises(BatchFullError, match="wait for a sequence to finish"):
        dec.add("b", prompts[1], max_new_tokens=4)
    assert dec.remove("a") and dec.free_slots == 1
    assert not dec.remove("a") and not dec.remove("never added")
    with pytest.raises(BatchError, match="capacity per slot"):
        BatchDecoder(model, slots=2, capacity=44, heads=random_heads(4, 64, VOCAB), tree=load_tree("1-10-16-17"))


def test_a_planned_engine_makes_a_batch_decoder_with_the_plans_slots_and_tree(model):
    from specmemo_core.planning.entry import PlanChoices, PlannedEngine
    from specmemo_core.planning.planner import Plan
    from specmemo_core.runtime.engine import Engine
    from specmemo_core.storage.sources import ModelIdentity
    from tests.tiny import tiny_config, tiny_tokenizer

    tree = load_tree("1-3-2+lookup-4")
    engine = Engine(model, tiny_tokenizer(), tiny_config(vocab_size=VOCAB), ModelIdentity("tiny", "0"),
                    random_heads(4, 64, VOCAB, seed=5, scale=0.5), tree)
    plan = Plan(True, "cpu", "fp32", 2, tree.name, tree.num_nodes, 300, 1, batch=3)
    dec = PlannedEngine(engine, None, None, plan, PlanChoices(batch=3)).new_batch_decoder()
    assert (dec.slots, dec.capacity, dec.tree, dec.speculative) == (3, 300 + tree.num_nodes, tree, True)
    plain = PlannedEngine(engine, None, None, plan, PlanChoices(batch=3, speculate=False)).new_batch_decoder()
    assert plain.tree is None and not plain.speculative


@pytest.mark.parametrize("tree_name, kind", [(None, None), ("1-3-2+lookup-4", "hydra"), ("1-3-2", "context")])
def test_staged_prefill_joins_sequences_exactly_as_the_eager_prefill(model, prompts, alone, tree_name, kind):
    """Prompts padded to a bucket in a staging row and copied into their batch row (what
    a GPU replays as graphs) decode as the sequences alone; the staging row is reused."""
    tree = load_tree(tree_name) if tree_name else None
    context = (64, 4, 2, 16) if kind == "context" else None
    heads = random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind="hydra", context=context) if kind else None
    runs = []
    for staged in (True, False):
        dec = BatchDecoder(model, slots=2, capacity=CAPACITY, heads=heads, tree=tree, staged_prefill=staged)
        assert (dec._staged is not None) == staged
        steps = []
        original = dec.step
        dec.step = lambda: steps.append(original()) or steps[-1]  # noqa: B023 (every step's emissions, in order)
        outs, _ = _drive(dec, prompts)
        runs.append(steps)
        for i, reference in enumerate(alone):
            if i != REMOVED:
                assert outs[i] == reference, f"sequence {i}"
    assert runs[0] == runs[1]  # the same drafts accepted step by step: the staged draft state is the eager one


def test_prefill_buckets_double_up_to_the_largest():
    from specmemo_core.runtime.staged_prefill import prefill_buckets

    assert prefill_buckets(128) == (16, 32, 64, 128)
    assert prefill_buckets(40) == (16, 32, 40)
    assert prefill_buckets(16) == (16,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_staged_prefill_replayed_as_graphs_matches_the_eager_prefill_on_a_gpu(prompts):
    """On CUDA the staging row's forwards are captured once per bucket and replayed."""
    model = tiny_model(seed=11, vocab_size=VOCAB).cuda()
    heads = random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind="hydra", context=(64, 4, 2, 16)).cuda()
    runs = []
    for staged in (True, False):
        dec = BatchDecoder(model, slots=2, capacity=CAPACITY, heads=heads, tree=load_tree("1-3-2+lookup-4"),
                           graphs=True, staged_prefill=staged)
        outs, _ = _drive(dec, prompts)
        runs.append(outs)
        if staged:
            assert dec._staged._captured  # replayed, not eager
    assert runs[0] == runs[1]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("tree_name,context_next", [("1-3-2+lookup-4", False), ("dynamic-8+lookup-3", False),
                                                    ("dynamic-8+lookup-3", True)])
def test_batched_steps_replayed_as_graphs_equal_batched_plain(prompts, tree_name, device, context_next):
    """Every (bucket, tree, span) step captured as a CUDA graph on a GPU (eager on the CPU),
    a grown tree's per-sequence growing included: each reply is the plain one on the same
    device."""
    model = tiny_model(seed=11, vocab_size=VOCAB).to(device)
    heads = random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind="hydra", context=(64, 4, 2, 16),
                         context_next=context_next).to(device)
    plain, _ = _drive(BatchDecoder(model, slots=3, capacity=CAPACITY, graphs=True), prompts)
    dec = BatchDecoder(model, slots=3, capacity=CAPACITY, heads=heads, tree=load_tree(tree_name), graphs=True)
    outs, most = _drive(dec, prompts)
    for i, reference in plain.items():  # the removed sequence left after its 3rd step: compare what both have
        n = min(len(outs[i]), len(reference)) if i == REMOVED else None
        assert outs[i][:n] == reference[:n], f"sequence {i}"
    assert most > 1
    assert all(unit.graph is not None for unit in dec._units.values()) == (device == "cuda")
