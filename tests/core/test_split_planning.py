"""Layer split as a plan choice (planning/split.py): accelerate's device map over the memory
tree divides the layers by each card's memory, more memory never gives a card fewer layers,
and a model the cards do not hold is refused saying what would fit."""

from dataclasses import replace

import pytest
import torch

from specmemo_core.planning.memory import known_shape
from specmemo_core.planning.planner import Budget, PlanRequest, memory_terms
from specmemo_core.planning.split import Card, SplitDoesNotFitError, plan_over_devices, split_layers

GIB = 2**30
VICUNA = known_shape("vicuna-13b")  # 40 layers, ~26 GB in bf16: no 16 GB card holds it
REQUEST = PlanRequest(turns=4, precision="bf16")


def _card(index: int, free_gib: float, total_gib: float = 80) -> Card:
    return Card(f"cuda:{index}", Budget("cuda", int(total_gib * GIB), int(free_gib * GIB), f"GPU {index}"))


def _terms(kv_tokens: int = 2048) -> dict[str, int]:
    return memory_terms(VICUNA, None, precision="bf16", kind="cuda", kv_tokens=kv_tokens)


def test_two_small_cards_divide_the_layers_in_order():
    shares = split_layers(VICUNA, "bf16", [_card(0, 16), _card(1, 16)], _terms(), safety_margin=0.1)
    assert [s.device for s in shares] == ["cuda:0", "cuda:1"]
    assert sum(s.layers for s in shares) == VICUNA.num_layers and all(s.layers > 0 for s in shares)
    assert shares[0].first_layer == 0 and shares[1].first_layer == shares[0].layers
    assert all(s.predicted_bytes <= s.usable_bytes for s in shares)
    # the last card holds the LM head and the draft heads beside its layers: fewer layers fit it per byte
    assert shares[1].predicted_bytes > 0


@pytest.mark.parametrize("which", [0, 1])
def test_more_memory_on_a_card_never_gives_it_fewer_layers(which):
    """Cards fill in order: the first takes what its memory holds, the last the rest."""
    layers = []
    for gib in (15, 16, 18, 20, 24, 30):
        free = [18.0, 18.0]
        free[which] = gib
        shares = split_layers(VICUNA, "bf16", [_card(0, free[0]), _card(1, free[1])], _terms(), safety_margin=0.1)
        layers.append({s.device: s.layers for s in shares}.get(f"cuda:{which}", 0))
    assert layers == sorted(layers)
    if which == 0:
        assert layers[0] < layers[-1] == 40  # at 30 GiB the first card holds every layer (the head goes on)


@pytest.mark.parametrize("which", [0, 1])
def test_the_planned_split_is_monotone_in_each_cards_memory(which):
    """Through the plan (more memory: a larger KV cache, so larger layers), still never fewer layers."""
    layers = []
    for gb in (16, 17, 20, 24):
        free = [16.0, 16.0]
        free[which] = gb
        found = plan_over_devices([_card(0, free[0]), _card(1, free[1])], VICUNA, None, REQUEST)
        assert found.fits and len(found.split) == 2
        layers.append(found.split[which].layers)
    assert layers == sorted(layers)


def test_cards_that_hold_no_split_are_refused_with_what_would_fit():
    with pytest.raises(SplitDoesNotFitError, match=r"they hold \d+ of its 40 decoder layers") as refused:
        split_layers(VICUNA, "bf16", [_card(0, 8), _card(1, 8)], _terms(), safety_margin=0.1)
    assert 0 < refused.value.placed < 40 and refused.value.shortfall > 0
    assert "lower precision" in str(refused.value) and "add a card" in str(refused.value)


def test_vicuna_13b_capped_at_16gib_per_card_is_split_over_both():
    found = plan_over_devices([_card(0, 16, 16), _card(1, 16, 16)], VICUNA, None, replace(REQUEST, turns=20))
    assert found.fits and found.precision == "bf16" and found.kv_tokens == VICUNA.max_context
    assert [s.device for s in found.split] == ["cuda:0", "cuda:1"]
    assert sum(s.layers for s in found.split) == 40
    assert all(s.predicted_bytes <= s.usable_bytes for s in found.split)
    assert any("split over 2 devices" in n for n in found.notes)


def test_a_chat_one_card_holds_is_not_split_and_goes_to_the_freest_card():
    found = plan_over_devices([_card(0, 80), _card(1, 80)], VICUNA, None, REQUEST)
    assert found.fits and [(s.device, s.layers) for s in found.split] == [("cuda:0", 40)]
    assert any("fits cuda:0 alone" in n for n in found.notes)
    assert found.split[0].predicted_bytes == found.total_bytes
    second = plan_over_devices([_card(0, 4), _card(1, 80)], VICUNA, None, REQUEST)
    assert [(s.device, s.layers) for s in second.split] == [("cuda:1", 40)]
    freer = plan_over_devices([_card(0, 60), _card(1, 70)], VICUNA, None, REQUEST)
    assert [s.device for s in freer.split] == ["cuda:1"]


def test_a_chat_no_split_holds_is_refused_with_the_splits_reason():
    found = plan_over_devices([_card(0, 6), _card(1, 6)], VICUNA, None, REQUEST)
    assert not found.fits and found.split == ()
    assert any("smaller model" in s for s in found.suggestions)


def test_one_card_or_a_cpu_plans_as_before():
    from specmemo_core.planning.planner import plan

    one = plan_over_devices([_card(0, 40)], VICUNA, None, REQUEST)
    assert one == plan(_card(0, 40).budget, VICUNA, None, REQUEST)
    cpu = Card("cpu", Budget("cpu", 64 * GIB, 64 * GIB))
    assert plan_over_devices([cpu, replace(cpu, device="cpu")], VICUNA, None, REQUEST).split == ()


def test_a_split_at_a_better_precision_wins_over_one_card_at_a_lower_one():
    """Two 16 GiB cards: vicuna-13b fits one card only as int4; split over both it runs in bf16."""
    cards = [_card(0, 16, 16), _card(1, 16, 16)]
    found = plan_over_devices(cards, VICUNA, None, PlanRequest(turns=4))
    assert found.fits and found.precision == "bf16" and len(found.split) == 2
    one_card = plan_over_devices(cards, VICUNA, None, PlanRequest(turns=4, precision="int4"))
    assert len(one_card.split) == 1 and one_card.precision == "int4"


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory):
    """A small random-weight model of 8 layers saved as a Hugging Face folder, as ``Engine.load`` reads one:
    its layers (2 MB each in bf16) outweigh a forward's activations, so a split can fit where one card does not."""
    from tests.tiny import tiny_hf_model, tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama-8")
    tiny_hf_model(seed=21, layers=8, hidden_size=256, intermediate_size=1024).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_load_planned_splits_what_no_card_holds_and_chats_as_one_device(tiny_model_folder, tmp_path):
    """The app's and chat's path with ``--devices``, played on the CPU: two made-up 'cuda'
    cards (running on the CPU) each too small for the model; the plan made before loading
    splits it over both, the engine loads split as planned, and replies as the unsplit one."""
    from specmemo_core.planning.device import DeviceInfo
    from specmemo_core.planning.entry import (PlanChoices, cards_for, inputs_before_load, load_planned, make_plan,
                                              split_of, split_of_plan)
    from specmemo_core.runtime.decoding import GenerationConfig
    from specmemo_core.runtime.engine import Engine
    from specmemo_core.storage.sources import load_model

    fake = tuple(DeviceInfo("cuda", i, f"Fake GPU {i}", 2**40, 2**40, "", "cpu") for i in (0, 1))
    choices = PlanChoices(turns=2, reply_tokens=32, prompt_tokens=32, precision="bf16")  # else int8 fits one
    inputs = inputs_before_load(load_model(tiny_model_folder), "random", fake[0], link=None, cards=cards_for(fake))

    def at(cap: int):
        cards = tuple(replace(c, budget=Budget("cuda", cap, cap)) for c in inputs.cards)
        return make_plan(replace(inputs, budget=cards[0].budget, cards=cards), choices)

    lo, hi = 2**20, 2**31  # bisect (to 4 KiB) for the smallest card on which the chat fits at all
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if at(mid).fits else (mid, hi)
    assert at(hi).fits and len(at(hi).split) == 2  # no card holds it alone: split over both
    planned = load_planned(tiny_model_folder, heads="random", choices=choices, data_folder=tmp_path,
                           devices=tuple(replace(d, total_bytes=hi, free_bytes=hi) for d in fake),
                           wait_for_timing=False)
    assert split_of(planned.engine) == split_of_plan(planned.plan) and len(split_of(planned.engine)) == 2
    tree = planned.tree
    whole = Engine.load(str(tiny_model_folder), heads="random", tree=tree, dtype=torch.bfloat16, precision="bf16")
    config = GenerationConfig(max_new_tokens=16)
    replies = [''.join(p.text for p in session.send("Hello, how are you?", config))
               for session in (planned.new_session(capacity=256), whole.new_session(capacity=256))]
    assert replies[0] == replies[1] and replies[0]


def test_plan_verify_builds_random_weights_on_each_card_and_runs_the_split_plan():
    """``plan --verify``'s random model for a split plan, played on the CPU: each part made
    where it runs, from the same random stream, so it decodes as the one made whole; the
    verification runs its turns over the segment caches."""
    from specmemo_core.planning.memory import ModelShape
    from specmemo_core.planning.plan_check import random_model, verify
    from specmemo_core.planning.planner import Plan
    from specmemo_core.planning.split import DeviceShare
    from specmemo_core.runtime.decoding import Decoder, GenerationConfig
    from specmemo_core.runtime.split import LayerSplit

    torch.set_num_threads(1)
    shape = ModelShape(64, 64, 128, 5, 4, 2, 16, False, name="tiny", max_context=512)
    whole = random_model(shape, "fp32", "cpu")
    split = random_model(shape, "fp32", "cpu", split=LayerSplit.of(["cpu", "cpu"], [2, 3]))
    assert split.placement is not None and split.placement.split.layers == (2, 3)
    prompt, config = list(range(20)), GenerationConfig(max_new_tokens=20)
    tokens = [[t for s in Decoder(m, m.new_cache(200)).generate(prompt, config) for t in s.token_ids]
              for m in (whole, split)]
    assert tokens[0] == tokens[1]
    shares = (DeviceShare("cpu", 0, 2, 2**20, 2**30), DeviceShare("cpu", 2, 3, 2**20, 2**30))
    plan = Plan(True, "cpu", "fp32", 0, None, 1, 200, 4, {"weights": 1, "overhead": 1}, 2**40, split=shares)
    check = verify(plan, split, None, None, prompt_tokens=10, reply_tokens=6, turns=3)
    assert check.turns_run == 3 and check.cards == ()  # cards are measured on CUDA only
    assert check.measured_terms["kv_cache"] == split.new_cache(plan.kv_tokens + plan.tree_nodes).nbytes


def test_cards_too_small_even_split_fall_back_to_streaming_from_the_first(tiny_model_folder):
    """Beside offload: when the cards do not hold the chat even split, the first card keeps
    what it can and streams the rest from RAM (as one GPU would), instead of a refusal."""
    from specmemo_core.planning.device import DeviceInfo
    from specmemo_core.planning.entry import PlanChoices, cards_for, inputs_before_load, make_plan
    from specmemo_core.planning.offload import HostLink
    from specmemo_core.storage.sources import load_model

    choices = PlanChoices(turns=2, reply_tokens=32, prompt_tokens=32, precision="bf16")
    loaded = load_model(tiny_model_folder)

    def at(cap: int, link):
        cards = tuple(DeviceInfo("cuda", i, f"Fake GPU {i}", cap, cap, "", "cpu") for i in (0, 1))
        return make_plan(inputs_before_load(loaded, "none", cards[0], link=link, cards=cards_for(cards)), choices)

    link = HostLink(64 * 2**30, 25e9)
    lo, hi = 2**20, 2**31  # the smallest cards (to 4 KiB) on which the chat fits at all, streaming allowed
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if at(mid, link).fits else (mid, hi)
    streamed = at(hi, link)
    assert streamed.fits and streamed.streamed_layers > 0 and streamed.split == ()
    assert not at(hi, None).fits  # without RAM to stream from, neither a card nor the split holds it
