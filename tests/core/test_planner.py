"""Planner: fits what it promises, refuses what cannot fit, monotone in memory and turns."""

import json
from pathlib import Path

import pytest

from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.memory import HeadsShape, kv_bytes, known_shape
from specmemo_core.planning.planner import (
    LOOKUP_ALONE, LOOKUP_GAIN, Budget, PlanRequest, calibrated_options, linear_step_time, plan, specmemo_prior_options,
    tree_options,
)

GiB = 2**30
CALIBRATION = Path(__file__).resolve().parents[2] / "assets/heads/SmolLM2-135M-Instruct/calibration.json"
VICUNA = known_shape("vicuna-7b")
HYDRA = HeadsShape("hydra", 4, 1)


def _gpu(gb, free=0.95):
    return Budget("cuda", int(gb * GiB), int(gb * GiB * free))


@pytest.mark.parametrize("gb", [8, 12, 16, 24])
def test_plan_fits_the_budget(gb):
    p = plan(_gpu(gb), VICUNA, HYDRA, PlanRequest(turns=20), specmemo_prior_options())
    assert p.fits
    assert p.total_bytes <= p.budget_bytes <= 0.9 * gb * GiB
    assert p.kv_tokens <= VICUNA.max_context


def test_more_memory_never_gives_fewer_turns_or_a_smaller_tree():
    timing = linear_step_time(0.006, 0.008, 64, 0.0003)
    for trees, step in ((specmemo_prior_options(), None), (specmemo_prior_options(), timing)):
        last = None
        for gb in [x / 2 for x in range(10, 160)]:
            p = plan(_gpu(gb), VICUNA, HYDRA, PlanRequest(turns=20, prefer=0.5), trees, step)
            if not p.fits:
                assert last is None
                continue
            if last is not None:
                assert p.turns >= last.turns and p.tree_nodes >= last.tree_nodes, (gb, p, last)
            last = p
        assert last is not None and last.precision == "bf16"


def test_more_turns_never_give_a_bigger_tree():
    smol = known_shape("smollm2-135m")
    trees = calibrated_options(json.loads(CALIBRATION.read_text()))
    for budget in (Budget("cuda", 2 * GiB, int(1.2 * GiB)), _gpu(8)):
        last = None
        for turns in range(1, 60, 3):
            p = plan(budget, smol, HYDRA, PlanRequest(turns=turns, prefer=0.7), trees)
            if last is not None and p.fits:
                assert p.tree_nodes <= last.tree_nodes
            last = p


def test_prefer_speed_gives_a_bigger_tree_and_prefer_turns_more_tokens():
    smol = known_shape("smollm2-135m")
    trees = calibrated_options(json.loads(CALIBRATION.read_text()))
    tight = Budget("cuda", 2 * GiB, int(0.95 * GiB))
    fast = plan(tight, smol, HYDRA, PlanRequest(turns=2, prefer=1.0), trees)
    long = plan(tight, smol, HYDRA, PlanRequest(turns=2, prefer=0.0), trees)
    assert fast.tree_nodes >= long.tree_nodes and long.kv_tokens >= fast.kv_tokens


def test_a_request_that_cannot_fit_is_refused_with_what_would():
    p = plan(_gpu(4), VICUNA, HYDRA, PlanRequest(turns=20, precision="bf16"), specmemo_prior_options())
    assert not p.fits
    assert any("precision" in s for s in p.suggestions)
    p = plan(Budget("cuda", 2 * GiB, 2 * GiB), VICUNA, HYDRA, PlanRequest(turns=20), specmemo_prior_options())
    assert not p.fits and any("smaller model" in s for s in p.suggestions)


def test_timing_decides_where_a_tree_stops_paying():
    smol = known_shape("smollm2-135m")
    trees = calibrated_options(json.loads(CALIBRATION.read_text()))
    budget = Budget("cpu", 24 * GiB, 20 * GiB)
    # GPU-like: a 64-node step costs 1.3x a plain one -> a big tree
    gpu_like = plan(budget, smol, HYDRA, PlanRequest(), trees, linear_step_time(0.002, 0.0026, 64, 0.0001))
    assert gpu_like.tree_nodes >= 32
    # a slow CPU where drafting a level costs as much as a plain step: a d-level tree costs
    # more than d + 1 plain steps and emits at most d + 1 tokens, so no tree pays: plain
    cpu = plan(budget, smol, HYDRA, PlanRequest(), trees, linear_step_time(0.045, 0.146, 64, 0.045))
    assert cpu.tree is None and cpu.tree_nodes == 1
    # in between, the tree shrinks as its cost grows: the plan picks, by hand, the tree with
    # the most expected tokens per second under this step time (memory is ample here)
    mid_time = linear_step_time(0.035, 0.060, 64, 0.002)
    mid = plan(budget, smol, HYDRA, PlanRequest(), trees, mid_time)
    by_hand = max(trees, key=lambda t: t.expected_accepted / mid_time(t.nodes, t.depth))
    assert by_hand.expected_accepted / mid_time(by_hand.nodes, by_hand.depth) > 1 / mid_time(1, 0)
    assert mid.tree == by_hand.name and mid.tree_nodes == by_hand.nodes
    assert mid.predicted_tokens_per_s == pytest.approx(by_hand.expected_accepted / mid_time(by_hand.nodes,
                                                                                          by_hand.depth), rel=1e-3)
    # and as a node gets dearer the chosen tree shrinks, never grows: from the biggest
    # candidate through mid sizes down to plain decoding
    costs = (0.001, 0.01, 0.025, 0.05, 0.1, 0.3, 1.0)
    sizes = [plan(budget, smol, HYDRA, PlanRequest(), trees, linear_step_time(0.035, 0.035 + c, 64, 0.002)).tree_nodes
             for c in costs]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == max(t.nodes for t in trees) and sizes[-1] == 1 and len(set(sizes)) >= 4


@pytest.mark.parametrize("bad", [dict(turns=-1), dict(turns=0), dict(prefer=1.5), dict(prefer=float("nan")),
                                 dict(reply_tokens=0), dict(safety_margin=0.95)])
def test_nonsense_requests_are_refused(bad):
    with pytest.raises(SpecMemoError):
        PlanRequest(**bad)


def test_nonsense_budgets_are_refused():
    with pytest.raises(SpecMemoError):
        Budget("cuda", GiB, 2 * GiB)


def _cli(*args):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "specmemo_core.cli", "plan", *args], capture_output=True, text=True,
                          timeout=300)


def test_plan_command_for_a_known_shape():
    ok = _cli("--model", "shape:vicuna-7b", "--vram", "8GiB", "--turns", "20", "--json")
    assert ok.returncode == 0, ok.stderr
    result = json.loads(ok.stdout)
    assert result["fits"] and result["precision"] in ("int8", "int4")
    assert sum(result["predicted_bytes"].values()) <= result["budget_bytes"]
    refused = _cli("--model", "shape:vicuna-7b", "--vram", "3GB", "--ram", "0")  # no RAM to stream layers into
    assert refused.returncode == 3 and "does not fit" in refused.stdout and "smaller model" in refused.stdout
    streamed = _cli("--model", "shape:vicuna-7b", "--vram", "3GB", "--ram", "64", "--json")
    assert streamed.returncode == 0 and json.loads(streamed.stdout)["streamed_layers"] > 0
    bad = _cli("--vram", "banana")
    assert bad.returncode == 2 and "could not read size 'banana'" in bad.stderr


def test_a_lookup_chain_is_taken_where_nodes_are_cheap_and_not_where_they_cost():
    """Every candidate also comes with a lookup chain, charged by the step time like any
    node: a GPU-like device (nodes nearly free) takes one, a device where each node costs
    a quarter of a plain step does not."""
    smol = known_shape("smollm2-135m")
    record = json.loads(CALIBRATION.read_text())
    trees = tree_options(record)
    base = {t.name: t for t in calibrated_options(record)}
    for n in LOOKUP_GAIN:
        chained = next(t for t in trees if t.name == f"calibrated-16+lookup-{n}")
        assert (chained.nodes, chained.depth) == (base["calibrated-16"].nodes + n, base["calibrated-16"].depth)
        # the shipped calibration walked each tree with its chain on its held-out replies
        assert chained.expected_accepted == record["tokens_per_step"][f"calibrated-16+lookup-{n}"]
        assert chained.expected_accepted > base["calibrated-16"].expected_accepted
    budget = Budget("cpu", 24 * GiB, 20 * GiB)
    gpu_like = plan(budget, smol, HYDRA, PlanRequest(), trees, linear_step_time(0.002, 0.0026, 64, 0.0001))
    assert "+lookup-" in gpu_like.tree and gpu_like.tree_nodes <= 64
    steep = plan(budget, smol, HYDRA, PlanRequest(), trees, linear_step_time(0.035, 0.035 * 17, 64, 0.002))
    assert steep.tree is None or "+lookup-" not in steep.tree


def test_a_model_without_heads_can_still_speculate_with_a_lookup_chain():
    """No heads: only chains alone (no head levels) are candidates; taken where nodes are
    nearly free (never a heads' tree), left where they cost more than they bring."""
    smol = known_shape("smollm2-135m")
    budget = Budget("cpu", 24 * GiB, 20 * GiB)
    trees = tree_options(None)
    cheap = plan(budget, smol, None, PlanRequest(), trees, linear_step_time(0.002, 0.0026, 64, 0.0001))
    assert cheap.tree in {f"lookup-{n}" for n in LOOKUP_ALONE} and cheap.heads_used == 0
    # each node half a plain step: a 4-node chain costs 2.5 steps for ~1.5 tokens
    steep = plan(budget, smol, None, PlanRequest(), trees, linear_step_time(0.035, 0.035 * 32.5, 64, 0.002))
    assert steep.tree is None


def test_sampling_plans_room_for_every_nodes_distribution():
    """At temperature > 0 typical acceptance keeps each node's fp32 distribution: the same
    tree then needs more buffer memory, and the same budget holds fewer KV tokens."""
    smol = known_shape("smollm2-135m")
    trees = [t for t in calibrated_options(json.loads(CALIBRATION.read_text())) if t.name == "calibrated-64"]
    budget = Budget("cuda", 2 * GiB, int(0.95 * GiB))
    greedy = plan(budget, smol, HYDRA, PlanRequest(turns=2, prefer=1.0), trees)
    sampled = plan(budget, smol, HYDRA, PlanRequest(turns=2, prefer=1.0, sampling=True), trees)
    assert greedy.tree == sampled.tree == "calibrated-64"
    extra = sampled.predicted_bytes["tree_buffers"] - greedy.predicted_bytes["tree_buffers"]
    assert extra >= 64 * smol.vocab_size * 12
    assert sampled.kv_tokens < greedy.kv_tokens
    assert sampled.total_bytes <= sampled.budget_bytes


def test_more_conversations_never_pick_a_larger_tree_and_scale_the_kv_cache():
    """A batch of B conversations: each keeps the KV cache one would (the KV bytes scale
    with B) and the tree shrinks as B grows (a step of B × N tokens stops being launch-bound)."""
    smol = known_shape("smollm2-135m")
    trees = tree_options(json.loads(CALIBRATION.read_text()))
    timing = linear_step_time(0.004, 0.012, 256, 0.0003)  # launch-bound at a few tokens, then ~31 µs a token
    budget = _gpu(80)
    plans = [plan(budget, smol, HYDRA, PlanRequest(turns=4, batch=b), trees, timing) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert all(p.fits for p in plans)
    nodes = [p.tree_nodes for p in plans]
    assert nodes == sorted(nodes, reverse=True) and nodes[0] > nodes[-1], nodes
    assert plans[0].tree is not None and plans[-1].tree_nodes <= 4
    one = plans[0]
    for b, p in zip((1, 2, 4, 8, 16, 32, 64), plans):
        assert p.batch == b
        per_slot = p.kv_tokens + p.tree_nodes
        assert p.predicted_bytes["kv_cache"] == b * kv_bytes(smol, per_slot, p.precision)
    speeds = [p.predicted_tokens_per_s for p in plans]
    assert speeds == sorted(speeds) and speeds[-1] > 10 * one.predicted_tokens_per_s  # total tokens/s grows with B


def test_a_batch_that_does_not_fit_is_refused_with_fewer_conversations_suggested():
    p = plan(_gpu(16), VICUNA, HYDRA, PlanRequest(turns=20, batch=64), specmemo_prior_options())
    assert not p.fits and p.batch == 64 and any("fewer conversations at once" in s for s in p.suggestions)
    with pytest.raises(SpecMemoError, match="batch"):
        PlanRequest(batch=0)


def test_grown_trees_are_offered_at_their_walked_figure_to_one_conversation_and_to_a_batch():
    """A calibration that walked grown trees offers ``dynamic-N`` (with and without a chain)
    at exactly that figure; a record without them offers none; a batch gets them too
    (it grows one tree per sequence)."""
    smol = known_shape("smollm2-135m")
    record = json.loads(CALIBRATION.read_text())
    walked = {k: v for k, v in record["tokens_per_step"].items() if not k.startswith("dynamic-")}
    without = tree_options({**record, "tokens_per_step": walked})
    assert not any(t.grown or t.name.startswith("dynamic-") for t in without)
    # grown trees walked a good deal better than the fixed ones of their size: the planner takes them
    grown = {f"dynamic-{n}": walked[f"calibrated-{n}"] + 0.5 for n in (8, 16)}
    grown |= {f"dynamic-{n}+lookup-3": walked[f"calibrated-{n}+lookup-3"] + 0.5 for n in (8, 16)}
    trees = tree_options({**record, "tokens_per_step": walked | grown})
    by_name = {t.name: t for t in trees}
    assert by_name["dynamic-8"].grown and by_name["dynamic-8+lookup-3"].grown
    assert by_name["dynamic-8"].expected_accepted == grown["dynamic-8"]
    assert (by_name["dynamic-8"].nodes, by_name["dynamic-8"].depth, by_name["dynamic-8"].widest) == (8, 4, 4)
    assert "dynamic-16+lookup-8" not in by_name  # not walked: not offered
    timing = linear_step_time(0.004, 0.012, 256, 0.0003)
    one = plan(_gpu(80), smol, HYDRA, PlanRequest(turns=4), trees, timing)
    assert one.tree.startswith("dynamic-")
    for b in (2, 8):
        batch = plan(_gpu(80), smol, HYDRA, PlanRequest(turns=4, batch=b), trees, timing)
        assert batch.tree is not None and batch.tree.startswith("dynamic-")


def test_a_cpu_with_bf16_matrix_units_plans_bf16_where_another_cpu_plans_fp32():
    from specmemo_core.planning.planner import precisions_for

    smol = known_shape("smollm2-135m")
    plain_cpu, amx_cpu = Budget("cpu", 24 * GiB, 20 * GiB), Budget("cpu", 24 * GiB, 20 * GiB, bf16_matmul=True)
    assert plan(plain_cpu, smol, HYDRA, PlanRequest(), specmemo_prior_options()).precision == "fp32"
    assert plan(amx_cpu, smol, HYDRA, PlanRequest(), specmemo_prior_options()).precision == "bf16"
    assert precisions_for(amx_cpu)[:2] == ("bf16", "fp32") and precisions_for(plain_cpu)[0] == "fp32"
    assert "fp32" not in precisions_for(_gpu(8))
    # asked for, fp32 is still what it gets; a model too large for fp32 still gets bf16 on either
    assert plan(amx_cpu, smol, HYDRA, PlanRequest(precision="fp32"), specmemo_prior_options()).precision == "fp32"
    tight = Budget("cpu", 24 * GiB, 20 * GiB)
    assert plan(tight, VICUNA, HYDRA, PlanRequest(), specmemo_prior_options()).precision == "bf16"


def test_a_cpu_runs_a_file_of_4_bit_weights_as_int4():
    """A 4-bit GGUF (stored_bits 4) runs as int4 on any CPU, AMX or not; a float file as
    before; a GPU keeps bf16; asked for, fp32 is still what it gets; a shape the int4
    kernels cannot pack falls back to the usual order."""
    from dataclasses import replace

    from specmemo_core.planning.planner import int4_fits, precisions_for

    q4 = replace(known_shape("smollm2-135m"), stored_bits=4)
    plain_cpu, amx_cpu = Budget("cpu", 24 * GiB, 20 * GiB), Budget("cpu", 24 * GiB, 20 * GiB, bf16_matmul=True)
    for cpu in (plain_cpu, amx_cpu):
        assert plan(cpu, q4, HYDRA, PlanRequest(), specmemo_prior_options()).precision == "int4"
        assert plan(cpu, replace(q4, stored_bits=16), HYDRA, PlanRequest(), specmemo_prior_options()).precision != "int4"
    assert plan(_gpu(8), q4, HYDRA, PlanRequest(), specmemo_prior_options()).precision == "bf16"
    assert plan(plain_cpu, q4, HYDRA, PlanRequest(precision="fp32"), specmemo_prior_options()).precision == "fp32"
    odd = replace(q4, intermediate_size=1544)  # not a multiple of 16 rows
    assert not int4_fits(odd) and precisions_for(plain_cpu, odd)[0] == "fp32"
