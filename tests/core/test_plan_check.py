"""Plan checks on CPU: random-weight models match the memory model's weight bytes, and a
verified chat runs every requested turn, sliding old turns out of a full context."""

import dataclasses

import pytest
import torch

from specmemo_core.runtime.heads import random_heads
from specmemo_core.planning.memory import ModelShape, weight_bytes
from specmemo_core.planning.plan_check import TimedStep, random_model, solve_step_time, verify
from specmemo_core.planning.planner import Budget, PlanRequest, plan
from specmemo_core.runtime.quantize import held_bytes as measured_weight_bytes
from specmemo_core.runtime.tree import load_tree

SHAPE = ModelShape(512, 256, 512, 2, 4, 2, 64, False, name="tiny", max_context=1024)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_random_model_weights_match_the_memory_model(precision):
    torch.set_num_threads(1)
    model = random_model(SHAPE, precision, "cpu")
    inv_freq = model.inv_freq.numel() * model.inv_freq.element_size()  # RoPE table, not a weight
    assert measured_weight_bytes(model) - inv_freq == weight_bytes(SHAPE, precision, device_kind="cpu")


def test_random_model_is_deterministic_and_finite():
    a, b = random_model(SHAPE, "fp32", "cpu", seed=3), random_model(SHAPE, "fp32", "cpu", seed=3)
    ids = torch.arange(8)
    from specmemo_core.runtime.model import causal_mask

    ha = a(ids, ids, causal_mask(0, 8), a.new_cache(8))
    hb = b(ids, ids, causal_mask(0, 8), b.new_cache(8))
    assert torch.equal(ha, hb) and torch.isfinite(ha).all()


def test_verify_runs_every_turn_and_slides_a_full_context():
    torch.set_num_threads(1)
    model = random_model(SHAPE, "fp32", "cpu")
    tree = load_tree("1-3-2")
    p = plan(Budget("cpu", 2**30, 2**30), SHAPE, None, PlanRequest(turns=6, prompt_tokens=50, reply_tokens=20))
    p = dataclasses.replace(p, kv_tokens=300, tree="1-3-2", tree_nodes=tree.num_nodes)
    heads = random_heads(4, SHAPE.hidden_size, SHAPE.vocab_size, kind="hydra")
    check = verify(p, model, heads, tree, prompt_tokens=50, reply_tokens=20, turns=10)
    assert check.turns_run == 10
    assert check.context_resets >= 5  # 300 tokens hold the document or ~3 turns of 70
    assert check.measured_terms["kv_cache"] == 2 * 2 * 2 * 64 * (300 + tree.num_nodes) * 4


def test_step_time_goes_through_the_timed_trees():
    """Step times made from a known per-node and per-level cost give those costs back."""
    plain, per_node, per_level = 0.010, 0.0002, 0.003

    def timed(nodes, depth):
        return TimedStep(nodes, depth, plain + per_node * (nodes - 1) + per_level * depth)

    step = solve_step_time(plain, timed(4, 3), timed(40, 4), big=32)
    for nodes, depth in [(1, 0), (4, 3), (40, 4), (16, 2), (64, 1)]:
        assert step(nodes, depth) == pytest.approx(plain + per_node * (nodes - 1) + per_level * depth)


def test_a_wide_tree_timed_faster_than_the_chain_implies_costs_nothing_per_node():
    """Noise: 40 nodes timed at less extra time than a 4-node chain. Every exact fit needs a
    negative cost, so the closest fit with none is taken: here one cost per drafting step,
    the mean of the two extra times (a per-level cost alone fits them worse)."""
    plain = 0.010
    chain, wide = TimedStep(4, 3, plain + 0.009), TimedStep(40, 4, plain + 0.004)
    step = solve_step_time(plain, chain, wide, big=32)
    assert step(64, 0) == pytest.approx(plain)  # unclamped, the slope would make this < plain
    assert step(1, 2) == pytest.approx(plain + 0.0065) == step(40, 4)


def test_three_timed_trees_give_the_cost_every_drafting_step_pays_once():
    """A fixed cost per drafting step (context layer, acceptance) besides the per-node and
    per-level ones: from chains of 1 and 3 levels and a wide tree all three come back, and
    a plain step and a lookup chain alone (no drafted level) do not pay it."""
    plain, per_node, per_level, once = 0.010, 0.0001, 0.0005, 0.003

    def timed(nodes, depth):
        return TimedStep(nodes, depth, plain + once + per_node * (nodes - 1) + per_level * depth)

    step = solve_step_time(plain, timed(2, 1), timed(4, 3), timed(32, 4), big=32)
    for nodes, depth in [(2, 1), (12, 2), (56, 4)]:
        assert step(nodes, depth) == pytest.approx(plain + once + per_node * (nodes - 1) + per_level * depth)
    assert step(1, 0) == pytest.approx(plain)
    assert step(9, 0) == pytest.approx(plain + 8 * per_node)  # lookup-8 alone
    two_unknowns = solve_step_time(plain, timed(4, 3), timed(32, 4), big=32)  # the fit before this term
    assert two_unknowns(12, 2) < step(12, 2)  # it charged the fixed cost per level: a shallow tree looked cheap


def test_a_timed_lookup_chain_gives_the_cost_every_step_past_one_token_pays_once():
    """On a GPU a plain step runs fused one-token kernels (``runtime/token_layer.py``) and a
    tree's step cannot: its second token costs far more than the next ones. Timed as
    ``time_forward`` times (a lookup chain that drafts nothing, chains of 1 and 3 levels, a
    wide tree), all four costs come back; a plain step pays none of them. The H200's numbers
    for the default model in bf16 (plain 0.6 ms, a tree step from 1.2 ms)."""
    plain, per_node, per_level, once, multi = 0.0006, 0.000004, 0.00005, 0.0001, 0.0006

    def timed(nodes, depth):
        return TimedStep(nodes, depth, plain + multi * (nodes > 1) + once * (depth > 0) + per_node * (nodes - 1)
                         + per_level * depth)

    step = solve_step_time(plain, timed(9, 0), timed(2, 1), timed(4, 3), timed(32, 4), big=32)
    for nodes, depth in [(1, 0), (2, 0), (9, 0), (2, 1), (24, 3), (64, 4)]:
        assert step(nodes, depth) == pytest.approx(timed(nodes, depth).seconds)
    without = solve_step_time(plain, timed(2, 1), timed(4, 3), timed(32, 4), big=32)  # no lookup chain timed
    assert without(9, 0) < plain + multi  # a lookup chain looked (nearly) as cheap as a plain step
    # no heads: lookup-1 and lookup-8 give the per-node cost and the once-per-step one
    alone = solve_step_time(plain, timed(2, 0), timed(9, 0), big=32)
    assert alone(4, 0) == pytest.approx(timed(4, 0).seconds) and alone(1, 0) == pytest.approx(plain)


def test_a_timed_grown_tree_gives_the_cost_a_grown_step_pays_once_and_the_planner_charges_it():
    """A grown tree (``runtime/growth.py``) picks its nodes from the heads' scores every step,
    a pass a fixed tree does not run. The H200's figures for the default model in bf16
    (``docs/results/tree_rows_h200/step_model.jsonl``): fixed trees as the model said, a grown one
    ~0.3 ms over. Timed as ``time_forward`` times them, the grown step's cost comes back, a
    fixed tree pays none of it, and the planner takes a fixed tree over a grown one that
    would accept as much, and plain decoding over a grown tree that only looked faster."""
    from specmemo_core.planning.planner import TreeOption, _choose_tree

    plain, per_node, per_level, once, multi, grow = 0.00066, 0.000004, 0.00005, 0.0001, 0.0008, 0.0003

    def timed(nodes, depth, grown=False):
        return TimedStep(nodes, depth, plain + multi * (nodes > 1) + once * (depth > 0) + per_node * (nodes - 1)
                         + per_level * depth + grow * grown, grown)

    step = solve_step_time(plain, timed(9, 0), timed(2, 1), timed(4, 3), timed(32, 4), timed(16, 4, True), big=32)
    for nodes, depth, grown in [(1, 0, False), (9, 0, False), (24, 4, False), (24, 4, True), (40, 4, True)]:
        assert step(nodes, depth, grown) == pytest.approx(timed(nodes, depth, grown).seconds)
    assert step(24, 4) == pytest.approx(step(24, 4, True) - grow)
    fixed, grown_tree = TreeOption("calibrated-24", 24, 4, 3.3), TreeOption("dynamic-24", 24, 4, 3.3, grown=True)
    assert _choose_tree([grown_tree, fixed], lambda t: True, step) == fixed
    # 3.3 tokens a step: over plain decoding at 1/0.66 ms only while the grown step's cost is not charged
    blind = solve_step_time(plain, timed(9, 0), timed(2, 1), timed(4, 3), timed(32, 4), big=32)
    assert _choose_tree([grown_tree], lambda t: True, blind) == grown_tree
    assert _choose_tree([TreeOption("dynamic-24", 24, 4, 2.7, grown=True)], lambda t: True, step) is None


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_graph_step_timing_runs_and_reports_every_timed_step(device):
    """The static decoder's whole steps (graph replays on CUDA) are timed: the progress
    counts every timed step of the plain step, the lookup chain, the two chains, the wide tree and the grown
    tree up to 1.0, and a tiny model's plain step costs well under a second (capture is not timed)."""
    from specmemo_core.planning.plan_check import TIMING_STAGE, TimingHooks, time_forward
    from tests.tiny import tiny_model

    torch.set_num_threads(1)
    model = tiny_model(seed=1, vocab_size=64, device=device)
    heads = random_heads(4, 64, 64, seed=2, scale=0.5, kind="hydra").to(device)
    reports = []
    step = time_forward(model, heads, big=16, context=64, repeats=2,
                            hooks=TimingHooks(progress=lambda stage, f: reports.append((stage, f))))
    steps = 2 * 2 + 2  # per tree: 2 × repeats + 2
    assert [f for _, f in reports] == [n / (6 * steps) for n in range(1, 6 * steps + 1)]
    assert {stage for stage, _ in reports} == {TIMING_STAGE}
    assert 0 < step(1, 0) < 1.0
