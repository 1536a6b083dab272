"""Offload as a plan choice (planning/offload.py and its use in planner.plan)."""

import pytest

from specmemo_core.errors import SpecMemoError

from specmemo_core.planning.memory import PLAIN, HeadsShape, known_shape
from specmemo_core.planning.offload import HostLink, KvRange, choose_offload, layer_bytes, resident_layers_that_fit
from specmemo_core.planning.planner import Budget, PlanRequest, TreeOption, linear_step_time, memory_terms, plan

GIB = 2**30
VICUNA_7B = known_shape("vicuna-7b")
# one vicuna-7b layer in bf16, worked out by hand: q, k, v, o are 4096 × 4096 (32 key/value
# heads of 128), gate and up 11008 × 4096, down 4096 × 11008, two norms of 4096
LAYER_7B_BF16 = (4 * 4096 * 4096 + 3 * 11008 * 4096 + 2 * 4096) * 2
TREES = [TreeOption(f"t{n}", n, min(n - 1, 4), accepted) for n, accepted in
         ((4, 1.6), (8, 1.9), (16, 2.1), (32, 2.25), (64, 2.35))]
HEADS = HeadsShape("medusa", 5, 1)
ROOMY_RAM = HostLink(free_ram_bytes=64 * GIB, bandwidth=25e9)
KV_1024 = KvRange(1024, 1024)


def _gpu(gib):
    return Budget("cuda", 141 * GIB, int(gib * GIB))


def test_layer_bytes_and_pinned_bytes_match_a_hand_count():
    assert layer_bytes(VICUNA_7B, "bf16") == LAYER_7B_BF16
    p = plan(_gpu(8), VICUNA_7B, None, PlanRequest(turns=4, precision="bf16"), TREES, link=ROOMY_RAM)
    assert p.fits and p.precision == "bf16" and p.resident_layers is not None
    assert 0 < p.resident_layers < 32 and p.resident_layers + p.streamed_layers == 32
    assert p.pinned_host_bytes == (32 - p.resident_layers) * LAYER_7B_BF16
    assert p.predicted_bytes["staging"] == 2 * LAYER_7B_BF16
    non_layer = 2 * 32000 * 4096 * 2 + 4096 * 2  # embeddings, LM head, final norm
    assert p.predicted_bytes["weights"] == non_layer + p.resident_layers * LAYER_7B_BF16
    assert p.total_bytes <= p.budget_bytes
    # one more resident layer would not fit
    assert p.total_bytes + LAYER_7B_BF16 > p.budget_bytes


def test_more_gpu_memory_never_gives_fewer_resident_layers():
    last = -1
    for quarter in range(8, 80):  # 2 … 20 GiB
        p = plan(_gpu(quarter / 4), VICUNA_7B, None, PlanRequest(turns=4, precision="bf16"), TREES, link=ROOMY_RAM)
        resident = 32 if p.fits and p.resident_layers is None else (p.resident_layers if p.fits else -1)
        assert resident >= last, f"{quarter / 4} GiB gave {resident} resident layers after {last}"
        last = resident
    assert last == 32  # the whole model fits at the top: no offload at all


def test_resident_layers_that_fit_is_monotone_and_none_when_nothing_fits():
    terms = memory_terms(VICUNA_7B, None, precision="bf16", kind="cuda", kv_tokens=2048)
    got = [resident_layers_that_fit(VICUNA_7B, "bf16", usable_bytes=g * GIB // 2, terms=terms) for g in range(1, 40)]
    assert got[0] is None  # 0.5 GiB holds not even the embeddings
    numbers = [n for n in got if n is not None]
    assert numbers == sorted(numbers) and numbers[-1] == 32


def test_without_a_precision_asked_for_offload_comes_after_every_resident_precision():
    thirteen = known_shape("vicuna-13b")
    assert plan(_gpu(12), thirteen, None, PlanRequest(turns=4), TREES, link=ROOMY_RAM).precision == "int4"  # resident
    p = plan(_gpu(5), thirteen, None, PlanRequest(turns=4), TREES, link=ROOMY_RAM)  # not even int4 fits
    assert p.fits and p.precision == "bf16" and p.streamed_layers > 0  # the best quality that streams
    int8 = plan(_gpu(5), thirteen, None, PlanRequest(turns=4, precision="int8"), TREES, link=ROOMY_RAM)
    assert int8.fits and int8.precision == "int8" and int8.resident_layers > p.resident_layers
    # at 4 GiB bf16's two staging layers no longer fit beside the KV cache; int8's do
    assert plan(_gpu(4), thirteen, None, PlanRequest(turns=4), TREES, link=ROOMY_RAM).precision == "int8"


def test_a_model_that_fits_neither_gpu_nor_gpu_and_ram_is_refused_with_what_would_fit():
    thirteen = known_shape("vicuna-13b")
    small_ram = HostLink(free_ram_bytes=8 * GIB, bandwidth=25e9, ram_margin=0.0)
    p = plan(_gpu(6), thirteen, None, PlanRequest(turns=4, precision="bf16"), TREES, link=small_ram)
    assert not p.fits
    text = " ".join(p.suggestions)
    per_layer = layer_bytes(thirteen, "bf16")
    in_ram = 8 * GIB // per_layer  # layers that 8 GiB of RAM holds
    assert "pinned RAM" in text and f"of its 40 layers at bf16" in text
    resident = int(text.split("with ")[1].split(" of")[0])
    assert f"what fits: {resident + in_ram} of its 40 layers" in text
    # a GPU too small for even the embeddings and the KV cache says so
    tiny_gpu = plan(_gpu(0.5), thirteen, None, PlanRequest(turns=4, precision="bf16"), TREES, link=ROOMY_RAM)
    assert not tiny_gpu.fits and "every decoder layer in host RAM" in tiny_gpu.suggestions[0]


def test_when_the_link_dominates_a_bigger_tree_is_chosen():
    compute = linear_step_time(0.004, 0.030, 64)  # resident: nodes cost (a busy GPU)
    resident_choice = plan(_gpu(40), VICUNA_7B, HEADS, PlanRequest(turns=4, precision="bf16"), TREES, compute)
    assert resident_choice.resident_layers is None and 1 < resident_choice.tree_nodes <= 16
    offloaded = plan(_gpu(8), VICUNA_7B, HEADS, PlanRequest(turns=4, precision="bf16"), TREES, compute, link=ROOMY_RAM)
    assert offloaded.fits and offloaded.streamed_layers > 0
    assert offloaded.tree_nodes == 64 > resident_choice.tree_nodes
    transfer = offloaded.pinned_host_bytes / ROOMY_RAM.bandwidth
    assert offloaded.predicted_tokens_per_s == pytest.approx(2.35 / max(transfer, compute(64, 4)))


def test_step_time_per_tree_is_the_larger_of_transfer_and_compute():
    compute = linear_step_time(0.004, 0.030, 64)
    terms_for = lambda tree, kv: memory_terms(VICUNA_7B, HEADS, precision="bf16", kind="cuda", kv_tokens=kv, tree=tree)
    fast_link = HostLink(free_ram_bytes=64 * GIB, bandwidth=1e15)  # transfer ≈ 0: the compute decides
    choice = choose_offload(VICUNA_7B, "bf16", usable_bytes=8 * GIB, link=fast_link, terms_for=terms_for,
                            compute=compute, trees=TREES, kv=KV_1024)
    assert choice.step_s["plain"] == pytest.approx(compute(1, 0), rel=1e-3)
    assert choice.step_s["t64"] == pytest.approx(compute(64, 4), rel=1e-3)
    assert choice.tree.nodes < 64
    slow = choose_offload(VICUNA_7B, "bf16", usable_bytes=8 * GIB, link=ROOMY_RAM, terms_for=terms_for,
                          compute=compute, trees=TREES, kv=KV_1024)
    transfer = slow.layout.pinned_bytes / ROOMY_RAM.bandwidth
    assert all(s == pytest.approx(transfer) for s in slow.step_s.values())  # the link bounds every tree
    assert slow.tree.nodes == 64
    assert choose_offload(VICUNA_7B, "bf16", usable_bytes=8 * GIB, link=HostLink(GIB, 25e9), terms_for=terms_for,
                          compute=compute, trees=TREES, kv=KV_1024) is None  # 1 GiB of RAM holds too few layers


def test_offload_is_never_planned_on_cpu_or_without_a_link():
    for budget in (Budget("cpu", 8 * GIB, 8 * GIB), Budget("mps", 8 * GIB, 8 * GIB)):
        p = plan(budget, VICUNA_7B, None, PlanRequest(turns=4, precision="bf16"), TREES, link=ROOMY_RAM)
        assert not p.fits and p.resident_layers is None and p.streamed_layers == 0
    p = plan(_gpu(8), VICUNA_7B, None, PlanRequest(turns=4, precision="bf16"), TREES)
    assert not p.fits and p.streamed_layers == 0
    assert memory_terms(VICUNA_7B, None, precision="bf16", kind="cuda", kv_tokens=8, tree=PLAIN)["weights"] > 8 * GIB


def test_specmemo_plan_streams_layers_into_the_ram_it_is_given(capsys):
    import json

    from specmemo_core.cli.main import main

    args = ["plan", "--model", "shape:vicuna-7b", "--vram", "8GB", "--precision", "bf16", "--turns", "4"]
    assert main(args + ["--ram", "0", "--json"]) == 3  # no RAM to stream into: refused
    assert main(args + ["--ram", "64GB", "--link-gbps", "25", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["fits"] and out["resident_layers"] + out["streamed_layers"] == 32
    assert out["pinned_host_bytes"] == out["streamed_layers"] * LAYER_7B_BF16
    assert main(args + ["--ram", "64GB"]) == 0
    text = capsys.readouterr().out
    assert f"{out['resident_layers']} on the device, {out['streamed_layers']} streamed from host RAM" in text


def test_the_turns_speed_trade_gives_kv_cache_for_resident_layers():
    """llama-3-8b (8192-token context) at bf16 on 8 GiB: more turns, or the slider toward
    turns, keep fewer layers on the GPU and a longer KV cache; speed keeps the most layers."""
    llama = known_shape("llama-3-8b")
    at = lambda **kw: plan(_gpu(8), llama, None, PlanRequest(precision="bf16", **kw), TREES, link=ROOMY_RAM)
    speed, balanced, turns = at(turns=4, prefer=1.0), at(turns=4, prefer=0.5), at(turns=4, prefer=0.0)
    assert speed.resident_layers > balanced.resident_layers > turns.resident_layers >= 0
    assert speed.kv_tokens < balanced.kv_tokens < turns.kv_tokens == llama.max_context
    assert speed.turns >= 4 and speed.kv_tokens >= 40 + 4 * 468
    fewer, more = at(turns=2, prefer=1.0), at(turns=12, prefer=1.0)
    assert fewer.resident_layers > more.resident_layers and fewer.kv_tokens < more.kv_tokens
    for p in (speed, balanced, turns, more):  # the KV cache takes what the layers leave
        assert p.total_bytes <= p.budget_bytes and p.total_bytes + LAYER_7B_BF16 // 2 > p.budget_bytes \
            or p.kv_tokens == llama.max_context


@pytest.mark.parametrize("prefer", [0.0, 0.5])
def test_more_gpu_memory_never_gives_fewer_resident_layers_at_any_preference(prefer):
    llama, last = known_shape("llama-3-8b"), -1
    for quarter in range(12, 72):  # 3 … 18 GiB
        p = plan(_gpu(quarter / 4), llama, HEADS, PlanRequest(turns=4, precision="bf16", prefer=prefer), TREES,
                 link=ROOMY_RAM)
        resident = 32 if p.fits and p.resident_layers is None else (p.resident_layers if p.fits else -1)
        assert resident >= last, f"{quarter / 4} GiB gave {resident} resident layers after {last}"
        last = resident


def test_streaming_never_pins_more_than_the_free_ram_whatever_the_preference():
    llama = known_shape("llama-3-8b")
    tight = HostLink(free_ram_bytes=12 * GIB, bandwidth=25e9, ram_margin=0.0)
    p = plan(_gpu(8), llama, None, PlanRequest(turns=4, precision="bf16", prefer=0.0), TREES, link=tight)
    assert p.fits and p.pinned_host_bytes <= 12 * GIB


def test_the_refusal_is_a_typed_error_that_names_what_would_fit():
    from specmemo_core.planning.entry import PlanDoesNotFitError

    thirteen = known_shape("vicuna-13b")
    small_ram = HostLink(free_ram_bytes=8 * GIB, bandwidth=25e9, ram_margin=0.0)
    for gpu, link in ((6, small_ram), (0.5, ROOMY_RAM)):  # RAM too small; GPU too small for even 0 layers
        refused = plan(_gpu(gpu), thirteen, None, PlanRequest(turns=4, precision="bf16"), TREES, link=link)
        error = PlanDoesNotFitError(refused)
        assert isinstance(error, SpecMemoError)
        text = str(error)
        assert "lower precision" in text and "fewer turns" in text and "smaller model" in text


def test_plan_for_a_model_larger_than_the_gpu_from_its_shape_alone(monkeypatch, capsys):
    """shape:NAME plans read no weights and place nothing: vicuna-13b int8 under 12 GB and
    llama-3-8b bf16 under 8 GB stream layers; --ram auto reads the free RAM now."""
    import json

    from specmemo_core.cli.main import main
    from specmemo_core.planning import host
    from specmemo_core.runtime import engine

    def no_loading(*args, **kwargs):
        raise AssertionError("a shape plan must not load weights")

    monkeypatch.setattr(engine.Engine, "load", no_loading)
    monkeypatch.setattr("specmemo_core.storage.sources.load_model", no_loading)
    monkeypatch.setattr(host, "free_host_ram", lambda: 64 * GIB)
    for model, dtype, vram, layers in (("vicuna-13b", "int8", "12", 40), ("llama-3-8b", "bf16", "8", 32)):
        args = ["plan", "--model", f"shape:{model}", "--dtype", dtype, "--vram", vram, "--device", "cuda",
                "--reply-tokens", "16", "--json"]
        assert main(args) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["fits"] and out["precision"] == dtype and 0 < out["resident_layers"] < layers
        assert out["resident_layers"] + out["streamed_layers"] == layers and out["pinned_host_bytes"] > 0
        assert any(f"taken as {host.ASSUMED_GB_S:g} GB/s" in n for n in out["notes"])
    monkeypatch.setattr(host, "free_host_ram", lambda: GIB)  # the RAM free now is too little
    assert main(["plan", "--model", "shape:llama-3-8b", "--dtype", "bf16", "--vram", "8", "--device", "cuda"]) == 3
    assert "pinned RAM" in capsys.readouterr().out
