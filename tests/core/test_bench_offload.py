"""specmemo bench's offload methods (tools/bench_offload.py): the plumbing on a tiny model on
CPU (accelerate's device_map on the CPU, our streamed layers), the cap from the planner,
and the refusals that come before anything loads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specmemo_core.cli.main import main
from specmemo_core.errors import OffloadError
from specmemo_core.planning.entry import PlanInputs, make_plan
from specmemo_core.planning.memory import HeadsShape, known_shape
from specmemo_core.planning.offload import HostLink
from specmemo_core.planning.planner import Budget, specmemo_prior_options
from specmemo_core.tools.bench_offload import (CAP_STEP, GENERATE_HEADROOM, OFFLOAD_METHODS, OffloadSetup, bench_choices,
                                               forced_setup, half_layers_cap, offload_summary, plan_setup)
from tests.tiny import tiny_hf_model, tiny_tokenizer

GIB = 2**30
LAYERS = 5


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-bench")
    tiny_hf_model(seed=21, layers=LAYERS).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    prompts = folder / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hello, how are you today?", "The quick brown fox"]}) + "\n"
                       + json.dumps({"turns": ["Memory budgets: weights and heads."]}) + "\n", encoding="utf-8")
    return folder


def _bench(folder, *extra):
    return ["bench", "--model", str(folder), "--heads", "random", "--prompts", str(folder / "prompts.jsonl"),
            "--queries", "3", "--max-new-tokens", "12", "--repeats", "1", "--device", "cpu", "--json", *extra]


def test_every_offload_method_runs_on_cpu_with_a_forced_layout_and_replies_like_stream_plain(tiny_folder, capsys):
    """The smoke test: accelerate dispatches to the CPU, our model streams 3 of 5 layers;
    greedy replies are the same for every method (random heads change only the speed)."""
    code = main(_bench(tiny_folder, "--methods", ",".join(OFFLOAD_METHODS), "--resident-layers", "2",
                       "--offload-tree", "1-10-16-17+lookup-3", "--threads", "1"))
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [k for k in out if not k.startswith("_")] == list(OFFLOAD_METHODS)
    for name in OFFLOAD_METHODS:
        assert out[name]["replies"] == 3 and out[name]["tokens_per_s"]["median"] > 0
        assert out[name]["identical_to_stream_plain"] >= (2 if name == "accelerate-offload" else 3), name
    assert out["stream-tree"]["tree"] == "1-10-16-17+lookup-3"
    assert out["stream-random-heads"]["tree"] == "1-10-16-17"  # the control drafts with its heads alone
    assert out["stream-plain"]["tree"] is None and "2 layers resident, 3 streamed" in out["stream-plain"]["note"]
    assert "all on the CPU" in out["accelerate-offload"]["note"]
    summary = out["_offload"]
    assert summary["resident_layers"] == 2 and summary["streamed_layers"] == 3 and summary["cap_bytes"] is None
    assert "smoke test" in summary["note"]
    assert set(summary["tokens_per_s"]) == set(OFFLOAD_METHODS)
    assert summary["tree_vs_stream_plain"] == pytest.approx(
        out["stream-tree"]["tokens_per_s"]["median"] / out["stream-plain"]["tokens_per_s"]["median"], abs=1e-3)
    assert summary["tokens_per_step"]["stream-plain"] == 1.0


def test_the_cap_needs_a_cuda_gpu_and_the_methods_need_a_layout(tiny_folder, capsys):
    assert main(_bench(tiny_folder, "--methods", "stream-plain", "--cap-gib", "half")) == 2
    err = capsys.readouterr().err
    assert "CUDA" in err and "--resident-layers" in err and "loading weights" not in err  # refused before loading
    with pytest.raises(OffloadError, match="--cap-gib GIB"):
        from specmemo_core.cli.bench import _offload_setup
        from specmemo_core.cli.main import build_parser
        from specmemo_core.storage.sources import load_model

        args = build_parser().parse_args(_bench(tiny_folder, "--methods", "stream-plain"))
        _offload_setup(args, load_model(tiny_folder))


def test_offload_methods_are_refused_before_loading_when_mixed_or_badly_capped(capsys):
    for extra in (["--methods", "vanilla,stream-plain"], ["--methods", "stream-plain", "--cap-gib", "lots"]):
        assert main(["bench", "--model", "/no/such/model", "--device", "cpu", *extra]) == 2
        err = capsys.readouterr().err
        assert "loading" not in err and ("apart" in err or "size in GiB" in err)


def _inputs(name="vicuna-7b"):
    return PlanInputs(Budget("cuda", 80 * GIB, 80 * GIB), known_shape(name), HeadsShape("hydra", 4, 1),
                      tuple(specmemo_prior_options()), link=HostLink(256 * GIB, 25e9))


def test_the_half_cap_keeps_at_most_half_the_layers_and_a_step_more_keeps_more():
    inputs, choices = _inputs("llama-3-8b"), bench_choices(max_new_tokens=128, precision="bf16")
    cap = half_layers_cap(inputs, choices)
    setup, plan = plan_setup(inputs, choices, "half")
    assert setup.cap_bytes == cap and plan.resident_layers <= 16 < plan.resident_layers + plan.streamed_layers
    more = make_plan(replace(inputs, budget=Budget("cuda", cap + CAP_STEP, cap + CAP_STEP)), choices)
    assert more.resident_layers is None or more.resident_layers > 16
    # accelerate gets the weight bytes our plan keeps on the GPU; the process cap holds both models
    assert setup.accelerate_gpu_bytes == plan.predicted_bytes["weights"] + plan.predicted_bytes["staging"]
    assert setup.process_cap_bytes == plan.total_bytes + setup.accelerate_gpu_bytes + GENERATE_HEADROOM
    assert plan.kv_tokens >= 4096 and setup.link_gb_s == 25.0


def test_a_cap_that_holds_the_whole_model_is_refused():
    with pytest.raises(OffloadError, match="nothing to stream"):
        plan_setup(_inputs(), bench_choices(max_new_tokens=128, precision="bf16"), "60")


def test_forced_layouts_are_checked():
    assert forced_setup(5, 2, None).tree == "chain-3"
    with pytest.raises(OffloadError, match="between 0 and 4"):
        forced_setup(5, 5, None)


def test_the_summary_gives_the_ratios_from_the_medians():
    setup = OffloadSetup(8, 24, "t", 4 * GIB, GIB, 5 * GIB, 9.0, 50.0)
    result = {name: {"tokens_per_s": {"median": speed}, "tokens_per_step": acc} for name, speed, acc in
              (("accelerate-offload", 2.0, 1.0), ("stream-plain", 5.0, 1.0), ("stream-tree", 10.0, 2.1),
               ("stream-random-heads", 4.8, 1.0))}
    s = offload_summary(result, setup)
    assert s["tree_vs_accelerate"] == 5.0 and s["tree_vs_stream_plain"] == 2.0
    assert s["random_heads_vs_stream_plain"] == 0.96 and s["stream_plain_vs_accelerate"] == 2.5
    assert s["cap_gib"] == 4.0 and s["tokens_per_step"]["stream-tree"] == 2.1


def test_the_half_cap_of_the_default_models_shape_streams_half_its_layers():
    """SmolLM2's layers are small (7 MB in bf16): the caps that stream at most half of them
    span ~100 MB, narrower than a doubling; the bisection still finds the top of that span."""
    inputs, choices = _inputs("smollm2-135m"), bench_choices(max_new_tokens=128, precision="bf16")
    setup, plan = plan_setup(inputs, choices, "half")
    assert setup.resident_layers == 15 and setup.streamed_layers == 15 and plan.kv_tokens >= 4096
    more = make_plan(replace(inputs, budget=Budget("cuda", setup.cap_bytes + CAP_STEP, setup.cap_bytes + CAP_STEP)),
                     choices)
    assert more.resident_layers is None or more.resident_layers > 15


def test_the_random_heads_control_leaves_the_lookup_chain_out():
    """A chain copies from the conversation whatever the heads: with it, random heads would
    still speed up, and the control would not show that the gain comes from the heads."""
    from specmemo_core.runtime.tree import load_tree
    from specmemo_core.tools.bench_offload import random_heads_tree

    assert random_heads_tree(load_tree("1-10-16-17+lookup-8")).name == "1-10-16-17"
    assert random_heads_tree(load_tree("1-10-16-17")).name == "1-10-16-17"
    assert random_heads_tree(load_tree("lookup-8")).name == "lookup-8"
