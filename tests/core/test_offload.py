"""Layer streaming (runtime/offload.py, runtime/host_link.py): a model whose later layers
stream from host memory decodes exactly as the same model fully resident."""

from dataclasses import dataclass, field

import pytest
import torch

from specmemo_core.errors import OffloadError
from specmemo_core.runtime.cpu_linear import pack_linears
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.engine import Engine
from specmemo_core.runtime.heads import random_heads
from specmemo_core.runtime.host_link import SyncLink, host_buffer, host_to_device_bandwidth, link_for
from specmemo_core.runtime.offload import LayerLayout, LayerStreamer, offload_layers
from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache
from specmemo_core.runtime.tree import load_tree
from specmemo_core.planning.memory import ModelShape
from tests.tiny import tiny_model, tiny_tokenizer

LAYERS, VOCAB = 5, 16  # an odd count of streamed layers makes a slot serve two layers in a row
PROMPT = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3)).tolist()


def _model(resident=None, copy=None, vocab=VOCAB):
    model = tiny_model(seed=11, vocab_size=vocab, layers=LAYERS)
    if resident is not None:
        offload_layers(model, resident_layers=resident, device="cpu", copy=copy)
    return model


def _tokens(decoder, prompt=PROMPT, n=80):
    steps = list(decoder.generate(prompt, GenerationConfig(max_new_tokens=n)))
    return [t for s in steps for t in s.token_ids], max(s.accepted for s in steps)


TREES = [  # (tree, heads kind): plain, heads trees with random heads, a lookup chain alone and with heads
    (None, None), ("1-10-16-17", "medusa"), ("medusa-64", "hydra"), ("lookup-8", None),
    ("1-10-16-17+lookup-8", "hydra"),
]


@pytest.mark.parametrize("resident", [0, 2, LAYERS - 1])
@pytest.mark.parametrize("tree_name, kind", TREES)
def test_streamed_greedy_equals_plain_greedy(resident, tree_name, kind):
    torch.set_num_threads(1)
    plain, _ = _tokens(Decoder(_model(), _model().new_cache(300)))
    model = _model(resident)
    tree = load_tree(tree_name) if tree_name else None
    heads = random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind=kind) if kind else None
    out, most = _tokens(Decoder(model, model.new_cache(300), heads, tree))
    assert out == plain
    if tree is not None:
        assert most > 1  # accepted paths were committed through the streamed layers, not only roots


@pytest.mark.parametrize("tree_name, kind", [("chain-3", "medusa"), ("1-10-7-1", "hydra")])
def test_streamed_greedy_equals_plain_greedy_on_the_offload_plans_trees(tree_name, kind):
    """The trees offload plans pick from shapes alone (SpecMemo's prior, a chain)."""
    torch.set_num_threads(1)
    plain, _ = _tokens(Decoder(_model(), _model().new_cache(300)))
    model = _model(2)
    heads = random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind=kind)
    out, most = _tokens(Decoder(model, model.new_cache(300), heads, load_tree(tree_name)))
    assert out == plain and most > 1


CUDA = ["cuda"] if torch.cuda.is_available() else []


@pytest.mark.skipif(not CUDA, reason="needs a CUDA/ROCm GPU: the side-stream link")
@pytest.mark.parametrize("resident", [0, 3])
@pytest.mark.parametrize("tree_name, kind", [(None, None), ("1-10-16-17", "medusa"), ("1-10-16-17+lookup-8", "hydra")])
def test_streamed_greedy_on_the_gpu_equals_plain_greedy_there(resident, tree_name, kind):
    """The real link: copies on a side stream, ordered by events, from page-locked memory."""
    from specmemo_core.runtime.host_link import StreamLink

    plain_model = tiny_model(seed=11, vocab_size=VOCAB, layers=LAYERS, device="cuda")
    plain, _ = _tokens(Decoder(plain_model, plain_model.new_cache(300)))
    model = _model()
    offload_layers(model, resident_layers=resident, device="cuda")
    assert isinstance(model.streamed.link, StreamLink) and model.device.type == "cuda"
    tree = load_tree(tree_name) if tree_name else None
    heads = random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind=kind).to("cuda") if kind else None
    assert _tokens(Decoder(model, model.new_cache(300), heads, tree))[0] == plain


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_layers_stream_in_their_stored_form(precision):
    """int8/int4 (torchao) layers stream as their inner tensors and decode exactly as the
    same quantized model fully resident; their blocks are smaller than fp32 ones."""
    from specmemo_core.runtime.quantize import QuantSpec, quantize_model

    torch.set_num_threads(1)
    resident_model = quantize_model(_model(), QuantSpec(precision))
    plain, _ = _tokens(Decoder(resident_model, resident_model.new_cache(300)), n=40)
    model = _model()
    quantize_model(model, QuantSpec(precision))
    fp32_block = LayerLayout.of(_model().model.layers[0]).nbytes
    streamer = offload_layers(model, resident_layers=2, device="cpu")
    assert streamer.pinned_bytes < (LAYERS - 2) * fp32_block / 2
    heads = random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind="medusa")
    out, most = _tokens(Decoder(model, model.new_cache(300), heads, load_tree("1-10-16-17")), n=40)
    assert out == plain and most > 1


@pytest.mark.parametrize("resident", [0, 3])
def test_streamed_step_units_equal_plain_greedy(resident):
    """The static decoder's step units (CUDA graphs on a GPU, eager here) over streamed layers."""
    torch.set_num_threads(1)
    plain, _ = _tokens(Decoder(_model(), _model().new_cache(300)))
    model = _model(resident)
    heads = random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind="hydra")
    static = StaticDecoder(model, new_static_cache(model, 300), heads, load_tree("1-10-16-17"), graphs=True)
    assert _tokens(static)[0] == plain


@dataclass
class DeferredLink:
    """A link whose copies happen only when the compute waits for them, as on a GPU where
    the copy stream runs behind: a layer yielded before its wait computes on stale bytes."""

    queue: list = field(default_factory=list)  # (slot, dst, src) sent, not yet copied

    def send(self, slot, dst, src):
        self.queue.append((slot, dst, src))

    def wait_arrival(self, slot):
        last = max(i for i, (s, _, _) in enumerate(self.queue) if s == slot)
        for _, dst, src in self.queue[:last + 1]:
            dst.copy_(src)
        del self.queue[:last + 1]

    def release(self, slot):
        pass

    def drain(self):
        self.wait_arrival(self.queue[-1][0]) if self.queue else None


@pytest.mark.parametrize("resident", [0, 2])
def test_copies_that_arrive_late_still_give_plain_greedy(resident):
    torch.set_num_threads(1)
    plain, _ = _tokens(Decoder(_model(), _model().new_cache(300)))
    model = _model(resident)
    model.streamed.link = DeferredLink()
    heads = random_heads(4, 64, VOCAB, seed=5, scale=0.5, kind="medusa")
    assert _tokens(Decoder(model, model.new_cache(300), heads, load_tree("1-10-16-17")))[0] == plain


def test_layer_j_plus_1_is_in_flight_while_layer_j_runs_and_no_slot_is_overwritten_early():
    """The schedule, recorded: every copy is sent before the layer ahead of it runs, and
    never into a slot whose layer has not run yet; the next forward's first copies are
    sent before it starts."""
    events = []
    model = _model(1, copy=lambda dst, src: (events.append(("copy", dst.data_ptr())), dst.copy_(src)))
    streamer = model.streamed
    for shell in streamer.shells:
        shell.register_forward_pre_hook(
            lambda m, args: events.append(("run", m.self_attn.layer, m.input_layernorm.weight.data_ptr())))
    _tokens(Decoder(model, model.new_cache(100)), n=3)
    slot_ptr = [streamer.staging[s].data_ptr() for s in range(2)]
    runs = [i for i, e in enumerate(events) if e[0] == "run"]
    copies = [i for i, e in enumerate(events) if e[0] == "copy"]
    assert len(runs) == 3 * (LAYERS - 1) and len(copies) >= len(runs)  # 3 forwards: prefill + 2 steps
    holding = {}  # slot pointer -> layers copied into it and not yet run
    for e in events:
        if e[0] == "copy":
            assert not holding.get(e[1]), "a copy overwrote a slot whose layer had not run"
            holding[e[1]] = True
        else:
            assert e[2] in slot_ptr and holding.pop(e[2], False), "a layer ran without its copy"
    for k, at in enumerate(runs[:-1]):  # the next layer's copy was sent before this layer ran
        assert sum(1 for c in copies if c < at) >= k + 2


def test_memory_terms_of_the_streamer():
    model = _model(2)
    s = model.streamed
    layer = tiny_model(seed=11, vocab_size=VOCAB, layers=LAYERS).model.layers[0]
    param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    layout = LayerLayout.of(layer)
    assert param_bytes <= layout.nbytes < param_bytes + 64 * len(layout.slices)
    assert s.pinned_bytes == (LAYERS - 2) * layout.nbytes
    assert s.staging_bytes == 2 * layout.nbytes
    assert len(model.model.layers) == 2  # only the resident layers are the model's own
    assert all(p.device.type == "cpu" for p in model.parameters())
    # each shell owns a view of its slot: shells 0 and 2 share slot 0, shell 1 has slot 1
    w = [sh.mlp.down_proj.weight.untyped_storage().data_ptr() for sh in s.shells]
    assert w[0] == w[2] and w[0] == w[1]  # one staging tensor…
    ptr = [sh.mlp.down_proj.weight.data_ptr() for sh in s.shells]
    assert ptr[0] == ptr[2] != ptr[1]  # …two slots in it


def test_the_planner_predicts_the_streamers_bytes():
    from specmemo_core.planning.memory import ModelShape
    from specmemo_core.planning.offload import layout

    model = _model()
    planned = layout(ModelShape.from_spec(model.spec), "fp32", 2, device_kind="cuda")
    streamer = offload_layers(model, resident_layers=2, device="cpu")
    slices = len(LayerLayout.of(_model().model.layers[0]).slices)
    assert 0 <= streamer.pinned_bytes - planned.pinned_bytes < (LAYERS - 2) * 64 * slices
    assert 0 <= streamer.staging_bytes - planned.staging_bytes < 2 * 64 * slices


def test_an_interrupted_forward_does_not_desynchronise_the_stream():
    torch.set_num_threads(1)
    plain, _ = _tokens(Decoder(_model(), _model().new_cache(300)), n=20)
    model = _model(1)
    hook = model.streamed.shells[1].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        _tokens(Decoder(model, model.new_cache(300)), n=20)
    hook.remove()
    assert _tokens(Decoder(model, model.new_cache(300)), n=20)[0] == plain


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory):
    """A tiny random-weight model of 5 layers saved as a Hugging Face folder, as ``Engine.load`` reads one."""
    from tests.tiny import save_tiny_model_folder

    return save_tiny_model_folder(tmp_path_factory.mktemp("tiny-llama-5"), layers=LAYERS)


@pytest.mark.parametrize("precision", [None, "int8"])
def test_an_engine_loaded_with_streamed_layers_chats_as_the_resident_one(tiny_model_folder, precision):
    """The app's path, Engine.load → new_session → send, over two turns: on CPU the
    resident linears are packed for oneDNN, the streamed ones stay plain."""
    replies = []
    for resident in (None, 1):
        engine = Engine.load(str(tiny_model_folder), heads="random", tree="1-10-16-17+lookup-8",
                             precision=precision, resident_layers=resident)
        assert (engine.model.streamed is not None) == (resident is not None)
        session = engine.new_session(capacity=300)
        replies.append(["".join(p.text for p in session.send(turn, GenerationConfig(max_new_tokens=30)))
                        for turn in ("Hello, how are you?", "Tell me about the quick brown fox.")])
    assert replies[0] == replies[1] and all(replies[0])


def test_what_cannot_be_streamed_is_refused_with_what_to_do():
    with pytest.raises(OffloadError, match="between 0 and 4"):
        offload_layers(_model(), resident_layers=LAYERS, device="cpu")
    with pytest.raises(OffloadError, match="at least 2"):
        offload_layers(_model(), resident_layers=0, device="cpu", buffers=1)
    model = _model()
    if pack_linears(model):  # oneDNN-packed linears keep their weights as buffers
        with pytest.raises(OffloadError, match="unpacked"):
            offload_layers(model, resident_layers=3, device="cpu")


def test_off_cuda_the_link_is_synchronous_and_no_bandwidth_is_measured():
    assert host_to_device_bandwidth("cpu") is None
    assert host_to_device_bandwidth(torch.device("meta")) is None
    assert isinstance(link_for("cpu", 2), SyncLink)
    buf = host_buffer((3, 100), torch.device("cpu"))  # plain host memory: nothing to page-lock for
    assert buf.shape == (3, 100) and buf.dtype == torch.uint8
    assert isinstance(_model(0).streamed, LayerStreamer)


def test_the_probe_measures_a_streamed_model_on_cpu():
    from specmemo_core.tools.offload_probe import probe

    model = _model(2)
    result = probe(model, sizes=(1, 4), repeats=1, precision="fp32")
    assert result.bandwidth_gb_s is None and result.link_fraction is None  # no link to measure on CPU
    assert (result.resident_layers, result.streamed_layers) == (2, LAYERS - 2)
    assert result.streamed_bytes == model.streamed.pinned_bytes
    assert 0 <= result.streamed_bytes - result.predicted_pinned_bytes < 64 * 9 * (LAYERS - 2)
    assert set(result.step_s) == {1, 4} and all(t > 0 for t in result.step_s.values())


def test_the_probe_command_loads_streams_and_prints_json(tiny_model_folder, capsys):
    import json

    from specmemo_core.tools.offload_probe import main

    main(["--model", str(tiny_model_folder), "--dtype", "fp32", "--device", "cpu", "--resident", "1",
          "--sizes", "1,2", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out)
    assert out["resident_layers"] == 1 and out["streamed_layers"] == LAYERS - 1 and out["bandwidth_gb_s"] is None


TINY_SHAPE = ModelShape(VOCAB * 4, 64, 128, LAYERS, 4, 2, 16, False, name="tiny", max_context=512)


def test_a_random_model_built_streamed_equals_the_one_built_resident():
    """plan --verify's random weights for a streamed plan: each streamed layer is made and
    packed at once, from the same random stream, so the model computes the same."""
    from specmemo_core.planning.plan_check import random_model

    torch.set_num_threads(1)
    whole = random_model(TINY_SHAPE, "fp32", "cpu")
    streamed = random_model(TINY_SHAPE, "fp32", "cpu", resident_layers=2)
    assert whole.streamed is None and len(streamed.model.layers) == 2 and len(streamed.streamed.shells) == 3
    plain, _ = _tokens(Decoder(whole, whole.new_cache(300)), n=30)
    assert _tokens(Decoder(streamed, streamed.new_cache(300)), n=30)[0] == plain


def test_verify_runs_a_streamed_plan_and_measures_its_staging_slots():
    from specmemo_core.cli.plan import _stream_check
    from specmemo_core.planning.plan_check import random_model, verify
    from specmemo_core.planning.planner import Plan

    model = random_model(TINY_SHAPE, "fp32", "cpu", resident_layers=1)
    plan = Plan(True, "cpu", "fp32", 0, None, 1, 200, 4, {"weights": 1, "overhead": 1}, 2**40,
                resident_layers=1, streamed_layers=LAYERS - 1, pinned_host_bytes=model.streamed.pinned_bytes)
    check = verify(plan, model, None, None, prompt_tokens=10, reply_tokens=6, turns=3)
    assert check.turns_run == 3 and check.measured_terms["staging"] == model.streamed.staging_bytes
    found = _stream_check(model, "fp32")
    assert found["streamed_layers"] == LAYERS - 1 and found["link_fraction"] is None  # no link on CPU
    assert found["tree64_vs_plain_step"] > 0 and set(found["step_s"]) == {1, 64}


def test_a_plan_before_loading_sees_the_loaded_engines_shapes(tiny_model_folder):
    from specmemo_core.planning.device import cpu_device
    from specmemo_core.planning.entry import inputs_before_load, plan_inputs
    from specmemo_core.storage.sources import load_model

    device = cpu_device()
    before = inputs_before_load(load_model(tiny_model_folder), "random", device, link=None)
    engine = Engine.load(str(tiny_model_folder), heads="random")
    after = plan_inputs(engine, device, None)
    assert before.model == after.model and before.heads == after.heads and before.trees == after.trees


def test_a_plan_that_moves_layers_needs_the_model_loaded_again(tiny_model_folder):
    from dataclasses import replace

    from specmemo_core.planning.device import cpu_device
    from specmemo_core.planning.entry import PlanChoices, PlannedEngine, apply_plan, make_plan, plan_inputs

    engine = Engine.load(str(tiny_model_folder), heads="none", resident_layers=2)
    inputs = plan_inputs(engine, cpu_device(), None)
    resident = make_plan(inputs, PlanChoices(turns=2))  # a CPU plan: every layer resident
    planned = PlannedEngine(engine, cpu_device(), inputs, resident, PlanChoices(turns=2))
    with pytest.raises(OffloadError, match="load the model again"):
        apply_plan(planned, resident)
    applied = apply_plan(planned, replace(resident, resident_layers=2, streamed_layers=3))
    assert applied.engine.model is engine.model  # the same weights: no reload


def test_load_planned_streams_a_model_larger_than_the_gpu_as_planned_before_loading(tiny_model_folder, tmp_path,
                                                                                    monkeypatch):
    """The app's and chat's path on a GPU, played on the CPU: a made-up 'cuda' device whose
    memory holds half the layers. The weights are read into host memory and planned first;
    the engine loads with the plan's resident layers and precision, and the plan made after
    loading (with the timing) keeps them; a device too small is refused before loading."""
    from dataclasses import replace

    from specmemo_core.planning import host
    from specmemo_core.planning.device import DeviceInfo
    from specmemo_core.planning.entry import (PlanChoices, PlanDoesNotFitError, inputs_before_load, load_planned,
                                              resident_layers_of)
    from specmemo_core.planning.offload import HostLink
    from specmemo_core.storage.sources import load_model
    from specmemo_core.tools.bench_offload import half_layers_cap

    big = DeviceInfo("cuda", 0, "Fake GPU", 2**40, 2**40, "", "cpu")  # runs on the CPU, plans as a GPU
    host.store_bandwidth(tmp_path, big.name, 25e9)  # the start-up reading, cached: nothing to measure here
    monkeypatch.setattr(host, "free_host_ram", lambda: 64 * 2**30)
    choices = PlanChoices(turns=2, reply_tokens=32, prompt_tokens=32)
    before = inputs_before_load(load_model(tiny_model_folder), "random", big, link=HostLink(64 * 2**30, 25e9))
    cap = half_layers_cap(before, choices, step=4096)  # a tiny model: layers of ~50 KB
    planned = load_planned(tiny_model_folder, heads="random", choices=choices,
                           device=replace(big, total_bytes=cap, free_bytes=cap), data_folder=tmp_path,
                           wait_for_timing=False)
    assert planned.plan.streamed_layers > 0 and planned.plan.precision == planned.engine.precision == "bf16"
    assert resident_layers_of(planned.engine) == planned.plan.resident_layers <= LAYERS // 2
    session = planned.new_session()
    assert "".join(p.text for p in session.send("Hello, how are you?", GenerationConfig(max_new_tokens=12)))

    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("a refused plan must not load"))
    with pytest.raises(PlanDoesNotFitError, match="smaller model"):
        load_planned(tiny_model_folder, heads="random", choices=choices,
                     device=replace(big, total_bytes=2**20, free_bytes=2**20), data_folder=tmp_path)


def test_a_streamed_engine_is_timed_apart_for_its_resident_layers(tiny_model_folder):
    """Its steps wait on the link: a timing cached for the resident model must not price them."""
    from specmemo_core.planning.timing import engine_timing_key

    whole = Engine.load(str(tiny_model_folder), heads="none")
    streamed = Engine.load(str(tiny_model_folder), heads="none", resident_layers=2)
    assert engine_timing_key(streamed, "GPU", "bf16") == engine_timing_key(whole, "GPU", "bf16") + "|resident-2"
