"""``specmemo bench``'s own code on tiny random models: statistics, identical counts, the
JSON report. No timing is asserted."""

import json
from dataclasses import replace

import pytest
import torch

from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.timing import StepTiming
from specmemo_core.tools.bench import (
    Method, Pass, Spread, build_methods, format_table, identical_count, report, run_bench,
)
from specmemo_core.cli import build_parser, main
from specmemo_core.storage.datasets import first_queries
from specmemo_core.runtime.engine import Engine
from specmemo_core.runtime.heads import random_heads
from specmemo_core.storage.sources import ModelIdentity
from tests.tiny import tiny_hf_model, tiny_model, tiny_tokenizer

CONVERSATIONS = [["Hello, how are you today?", "Tell me about the quick brown fox."],
                 ["Speculative decoding drafts tokens."]]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pass(seconds: float, replies=((1, 2, 3), (4, 5)), steps=2, step_tokens=3, peak=None) -> Pass:
    replies = [list(r) for r in replies]
    return Pass(replies, sum(map(len, replies)), seconds, steps, step_tokens, (0.1, 0.3), peak)


def test_spread_median_min_max_of_fixed_numbers():
    assert Spread.of([3.0, 1.0, 2.0, 10.0]) == Spread(2.5, 1.0, 10.0)
    assert Spread.of([5.0, 4.0, 6.0]).as_dict() == {"median": 5.0, "min": 4.0, "max": 6.0}
    assert Spread.of([7.0]) == Spread(7.0, 7.0, 7.0)


def test_first_queries_counts_turns_and_keeps_conversations_whole():
    convs = [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]]
    assert first_queries(convs, 4) == [["a1", "a2"], ["b1", "b2"]]
    assert first_queries(convs, 3) == [["a1", "a2"], ["b1"]]
    assert first_queries(convs, 99) == convs


def test_identical_count_compares_whole_replies_token_for_token():
    base = [[1, 2, 3], [4, 5], [6]]
    assert identical_count([[1, 2, 3], [4, 5], [6]], base) == 3
    assert identical_count([[1, 2, 3], [4, 5, 9], []], base) == 1
    with pytest.raises(Exception):
        identical_count([[1]], base)


def test_report_summarises_passes_into_one_object_keyed_by_method():
    methods = [Method("hf", lambda: None), Method("vanilla", lambda: None, tree_buffer_bytes=10, predicted_bytes=99),
               Method("medusa-64", lambda: None, "medusa-64", 64, 1000, 5000)]
    passes = {
        "hf": [_pass(2.0), _pass(1.0), _pass(5.0)],  # 5 tokens: 2.5, 5, 1 tokens/s
        "vanilla": [replace(_pass(1.0, steps=3, step_tokens=3), decode_seconds=0.6)] * 3,
        "medusa-64": [_pass(0.5, replies=((1, 2, 3), (4, 6)), peak=7), _pass(0.25, replies=((1, 2, 3), (4, 6)), peak=8)],
    }
    out = json.loads(json.dumps(report(methods, passes)))
    assert list(out) == ["hf", "vanilla", "medusa-64"]
    hf, van, med = out["hf"], out["vanilla"], out["medusa-64"]
    assert hf["tokens_per_s"] == {"median": 2.5, "min": 1.0, "max": 5.0}
    assert hf["tokens_per_s_passes"] == [2.5, 5.0, 1.0]
    assert med["tokens_per_s"] == {"median": 15.0, "min": 10.0, "max": 20.0}
    assert med["vs_hf"] == 6.0 and med["vs_vanilla"] == 3.0 and van["vs_vanilla"] == 1.0
    assert hf["mean_accepted"] == 1.5 and van["mean_accepted"] == 1.0
    assert hf["tokens_per_step"] == 1.5  # no verifications counted apart: what the replies got
    cut = replace(_pass(1.0, steps=4, step_tokens=10), accepted_tokens=16)  # a last step's run past the end
    cut_out = report([Method("m", lambda: None, "lookup-8", 9)], {"m": [cut]})["m"]
    assert (cut_out["tokens_per_step"], cut_out["mean_accepted"]) == (2.5, 4.0)
    assert hf["time_to_first_token_s"] == pytest.approx(0.2)
    assert (hf["identical_to_vanilla"], van["identical_to_vanilla"], med["identical_to_vanilla"]) == (2, 2, 1)
    assert med["replies"] == 2 and med["new_tokens"] == 5
    assert (med["tree"], med["tree_nodes"], med["tree_buffer_bytes"]) == ("medusa-64", 64, 1000)
    assert med["peak_bytes"] == 8 and med["peak_source"].startswith("measured")  # CUDA passes carry their peak
    assert van["peak_bytes"] == 99 and van["peak_source"].startswith("predicted")  # CPU: the memory model
    assert hf["peak_bytes"] is None and hf["tree_buffer_bytes"] is None
    assert van["step_ms"] == pytest.approx(200.0) and van["steps_share"] == pytest.approx(0.6)  # 0.6 s over 3 steps
    assert hf["step_ms"] is None and hf["steps_share"] is None  # not measured apart
    expected = {"tree", "tree_nodes", "tokens_per_s", "tokens_per_s_passes", "tokens_per_step", "mean_accepted",
                "step_ms", "steps_share",
                "time_to_first_token_s", "new_tokens", "replies", "identical_to_vanilla", "tree_buffer_bytes",
                "tree_buffer_source", "peak_bytes", "peak_source", "note", "vs_hf", "vs_vanilla",
                "identical_baseline"}
    assert all(set(entry) == expected for entry in out.values())
    assert out["medusa-64"]["identical_baseline"] == "vanilla"
    assert "medusa-64" in format_table(out)


def test_without_vanilla_there_is_no_identical_count():
    out = report([Method("hf", lambda: None)], {"hf": [_pass(1.0)]})
    assert out["hf"]["identical_to_vanilla"] is None and "vs_vanilla" not in out["hf"]
    assert out["hf"]["identical_baseline"] is None


def test_a_gpu_run_without_eager_vanilla_compares_with_the_graph_captured_one():
    methods = [Method("vanilla+graphs", lambda: None), Method("medusa-64+graphs", lambda: None, "medusa-64", 64)]
    passes = {"vanilla+graphs": [_pass(1.0)] * 3,
              "medusa-64+graphs": [_pass(0.5, replies=((1, 2, 3), (4, 6)))] * 3}
    out = report(methods, passes)
    med = out["medusa-64+graphs"]
    assert med["identical_baseline"] == "vanilla+graphs" and med["identical_to_vanilla"] == 1
    assert med["vs_vanilla+graphs"] == 2.0 and "vs_vanilla" not in med


def test_run_bench_interleaves_methods_after_an_untimed_warm_up():
    calls = []

    def method(name):
        def run():
            calls.append(name)
            return _pass(float(len(calls)))
        return Method(name, run)

    rounds = []
    passes = run_bench([method("a"), method("b")], repeats=2, warmup=1,
                       on_round=lambda so_far: rounds.append({k: [p.seconds for p in v] for k, v in so_far.items()}))
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert [p.seconds for p in passes["a"]] == [3.0, 5.0]  # the warm-up pass (1.0) is dropped
    assert [p.seconds for p in passes["b"]] == [4.0, 6.0]
    # after each timed round (not the warm-up) the caller sees every finished pass
    assert rounds == [{"a": [3.0], "b": [4.0]}, {"a": [3.0, 5.0], "b": [4.0, 6.0]}]


def _engine(vocab=300):
    model = tiny_model(seed=3, vocab_size=vocab)
    heads = random_heads(5, 64, vocab, seed=4, scale=0.5)
    return Engine(model, tiny_tokenizer(vocab), tiny_hf_model(seed=3, vocab_size=vocab).config,
                  ModelIdentity("tiny", "0"), heads, None)


def test_every_method_on_a_tiny_model_and_random_heads_replies_like_vanilla():
    """fp32 greedy: trees with random heads (and the planner's tree) give vanilla's replies
    exactly; transformers' generate over the same weights is counted too."""
    engine = _engine()
    hf = tiny_hf_model(seed=3, vocab_size=300)
    names = ["hf", "hf-pld", "vanilla", "medusa-64", "1-10-16-17", "plan", "vanilla+graphs", "1-10-16-17+graphs",
             "1-10-16-17+lookup-8", "lookup-4+graphs"]
    methods = build_methods(names, engine, hf, CONVERSATIONS, max_new_tokens=24, precision="fp32",
                            plan_timing=StepTiming(1.0, 1.0, 64, 0.0))  # trees cost nothing extra: plan picks one
    out = report(methods, run_bench(methods, repeats=1, warmup=1))
    assert list(out) == names
    for name in names:
        assert out[name]["replies"] == 3
        assert out[name]["tokens_per_s"]["min"] > 0
        if not name.startswith("hf"):  # ours time their steps apart from the rest of a pass
            assert out[name]["step_ms"] > 0 and 0 < out[name]["steps_share"] < 1, name
    for name in ("vanilla", "medusa-64", "1-10-16-17", "plan", "vanilla+graphs", "1-10-16-17+graphs",
                 "1-10-16-17+lookup-8", "lookup-4+graphs"):
        assert out[name]["identical_to_vanilla"] == 3, name
    assert out["1-10-16-17+lookup-8"]["tree_nodes"] == 52 and out["lookup-4+graphs"]["tree_nodes"] == 5
    assert "static shapes" in out["1-10-16-17+graphs"]["note"]
    assert out["vanilla"]["mean_accepted"] == 1.0 and out["hf"]["mean_accepted"] == 1.0
    assert out["plan"]["tree"] is not None and "planner chose" in out["plan"]["note"]
    assert out["medusa-64"]["tree_nodes"] == 64
    assert out["1-10-16-17"]["tree_buffer_bytes"] < out["medusa-64"]["tree_buffer_bytes"]
    assert out["vanilla"]["tree_buffer_bytes"] < out["1-10-16-17"]["tree_buffer_bytes"]
    assert out["hf"]["identical_to_vanilla"] >= 2  # NOTE: another attention kernel; ties may differ
    assert out["hf-pld"]["identical_to_vanilla"] == out["hf"]["identical_to_vanilla"]


def test_compiled_methods_reply_like_vanilla_and_others_run_eagerly_beside_them():
    """``+compiled``: the method with its decoder layers' regions compiled (one compiled
    graph for every such method), eager methods taking turns with them stay eager; fp32
    greedy replies are vanilla's, as are those of ``+serial`` (steps that do not overlap).
    Refused for transformers' methods."""
    from specmemo_core.runtime.model import EAGER_REGIONS

    engine = _engine()
    names = ["vanilla", "1-10-16-17+graphs+serial", "vanilla+compiled", "1-10-16-17+graphs+compiled"]
    methods = build_methods(names, engine, None, CONVERSATIONS, max_new_tokens=16, precision="fp32")
    out = report(methods, run_bench(methods, repeats=1, warmup=0))
    assert all(out[n]["identical_to_vanilla"] == 3 for n in names)
    assert "compiled layer regions" in out["vanilla+compiled"]["note"]
    assert "serial steps" in out["1-10-16-17+graphs+serial"]["note"]
    assert "static shapes" in out["1-10-16-17+graphs+compiled"]["note"]
    assert out["1-10-16-17+graphs+compiled"]["tree"] == "1-10-16-17"
    layer = engine.model.model.layers[0]
    assert layer.regions is not EAGER_REGIONS  # the last pass was a compiled one
    methods[0].run()
    assert layer.regions is EAGER_REGIONS
    for name in ("hf+compiled", "hf+serial"):
        with pytest.raises(SpecMemoError, match="not to transformers"):
            build_methods([name], engine, None, CONVERSATIONS, max_new_tokens=4, precision="fp32")


def test_plan_may_choose_plain_decoding_and_says_so():
    engine = _engine()
    slow_trees = StepTiming(t1=2.0, t_big=65.0, big=64, draft_level=0.0)  # every node costs a whole forward
    (method,) = build_methods(["plan"], engine, None, CONVERSATIONS, max_new_tokens=8, precision="fp32",
                              plan_timing=slow_trees)
    assert method.tree is None and method.tree_nodes == 1 and "plain decoding" in method.note


def test_cli_parses_bench_and_refuses_repeated_methods_before_loading(capsys):
    args = build_parser().parse_args(["bench", "--queries", "4", "--methods", "hf,vanilla", "--json",
                                      "--device", "cpu", "--dtype", "bf16"])
    assert (args.queries, args.methods, args.json, args.dtype) == (4, "hf,vanilla", True, "bf16")
    from specmemo_core.cli import bench as bench_command

    assert args.run is bench_command.run
    assert main(["bench", "--methods", "vanilla,vanilla"]) == 2
    assert "distinct" in capsys.readouterr().err
