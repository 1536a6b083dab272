"""The native CPU forward (runtime/native): the GGUF's blocks repacked exactly, its forward
against our torch model in float32, and under our one step: a tree's accepted nodes get bit
for bit the hidden states plain decoding gives, so greedy speculative replies equal plain
greedy ones; the cache commits the accepted path and a second turn reuses the prefix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from specmemo_core.runtime.native import weights as packing
from specmemo_core.runtime.native.build import available
from specmemo_core.runtime.tree import load_tree
from tests.core.test_sources import write_tiny_gguf

needs_compiler = pytest.mark.skipif(not available(), reason="no C compiler to build the native forward")


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("lanes", [8, 16])
def test_a_repacked_matrix_holds_exactly_the_weights_gguf_reads_from_the_file(quant, lanes):
    """Rows in groups of the kernel's lanes (the last one padded: 21 rows here)."""
    import gguf
    from gguf.quants import dequantize, quantize

    kind = gguf.GGMLQuantizationType[quant]
    w = np.random.default_rng(0).standard_normal((21, 96)).astype(np.float32)
    raw = quantize(w, kind)
    packed = packing.pack(raw, int(kind), 21, 96, lanes)
    assert packed.nibbles == (quant != "Q8_0") and packed.u.shape[:2] == (-(-21 // lanes), 3)
    np.testing.assert_array_equal(packing.dequantize(packed), dequantize(raw, kind))


@pytest.mark.parametrize("lanes", [8, 16])
def test_a_q4_k_matrix_becomes_4_bit_blocks_of_32_its_scales_rounded_to_half_floats(lanes):
    """Each 32 weights of a Q4_K super-block keep their nibbles; d·sc and dmin·mn become the
    block's half-float scale and least weight, within 2^-11 of each."""
    import gguf
    from gguf.quants import dequantize

    from specmemo_core.tools.synthetic_gguf import random_blocks

    kind = gguf.GGMLQuantizationType.Q4_K
    raw = random_blocks("Q4_K", (21, 512), np.random.default_rng(2))
    packed = packing.pack(raw, int(kind), 21, 512, lanes)
    assert packed.nibbles and packed.u.shape[:3] == (-(-21 // lanes), 16, 4)
    d, m = (np.repeat(a.transpose(0, 2, 1).reshape(-1, 16)[:21].astype(np.float32), 32, axis=1)
            for a in (packed.d, packed.m))
    error = np.abs(packing.dequantize(packed) - dequantize(raw, kind))
    assert np.all(error <= 2.0**-11 * (15 * np.abs(d) + np.abs(m)))
    assert error.max() > 0  # the half floats do round: not the file's weights bit for bit


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "F16"])
@pytest.mark.parametrize("lanes", [8, 16])
def test_packed_bytes_are_what_a_packed_matrix_holds(quant, lanes):
    """What the planner counts (``packed_bytes``) without packing: the arrays' own bytes."""
    import gguf
    from gguf.quants import dequantize

    from specmemo_core.tools.synthetic_gguf import random_blocks

    kind = gguf.GGMLQuantizationType[quant]
    w = np.random.default_rng(3).standard_normal((21, 256)).astype(np.float32)
    raw = random_blocks(quant, (21, 256), np.random.default_rng(3)) if quant.endswith("_K") else (
        w.astype(np.float16) if quant == "F16" else gguf.quants.quantize(w, kind))
    held = (packing.pack(raw, int(kind), 21, 256, lanes) if packing.packable(int(kind), 256)
            else packing.from_float(np.asarray(dequantize(raw, kind), np.float32).reshape(21, 256), lanes))
    assert held.nibbles == (quant in ("Q4_0", "Q4_1", "Q4_K"))
    assert packing.packed_bytes(int(kind), 21, 256, lanes) == held.nbytes


def test_a_float_matrix_becomes_8_bit_blocks_within_half_a_step_of_each_weight():
    """Within half a step and the half floats' own rounding (2^-11 of the weights' size)."""
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    w[0, :32] = 0.5  # a constant block: step 0
    packed = packing.from_float(w, 8)
    step = np.repeat(packed.d.transpose(0, 2, 1).reshape(-1, 2)[:4].astype(np.float32), 32, axis=1)
    assert np.all(np.abs(packing.dequantize(packed) - w) <= step / 2 + 2.0**-11 * np.abs(w).max())
    assert packed.d[0, 0, 0] == 0 and packing.dequantize(packed)[0, 0] == 0.5


def _tiny(tmp_path: Path, quant: str = "Q4_0", hidden: int = 64, **kw) -> Path:
    return write_tiny_gguf(tmp_path / f"tiny-{quant}-{hidden}.gguf", hidden=hidden, layers=2, quant=quant, tied=True,
                           **kw)


def _native(path: Path, march: str = "native"):
    from specmemo_core.runtime.native.lm import load_native
    from specmemo_core.storage.sources import open_model

    return load_native(open_model(path), threads=2, march=march)


MARCHES = ["native", "x86-64-v3", "alderlake", "x86-64"]  # this CPU's; AVX2; AVX2 with VNNI; plain C


@needs_compiler
@pytest.mark.parametrize("march", MARCHES)
def test_the_forward_scores_a_prompt_as_our_float32_model_does(data_dir, tmp_path, march):
    """Weights as the file holds them, activations in int8 blocks of 32 (as llama.cpp's):
    the logits of every row within a few percent of our float32 model's, the same picks,
    on this CPU's kernel and on the AVX2 (with and without VNNI) and plain-C ones."""
    from specmemo_core.runtime.engine import Engine

    _x86_or_native(march)
    path = _tiny(tmp_path)
    lm, ref = _native(path, march), Engine.load(path, heads="none").model
    tokens = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(3))
    cache, ref_cache = lm.new_cache(64), ref.new_cache(64)
    logits = lm.logits(lm(tokens, *cache.prepare(torch.arange(12)), cache))
    with torch.no_grad():
        expected = ref.logits(ref(tokens, *ref_cache.prepare(torch.arange(12)), ref_cache))
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def _x86_or_native(march: str) -> None:
    """Skip another CPU's kernel where this one cannot run it (another architecture, or an
    x86 without AVX-VNNI for alderlake's)."""
    import platform

    if march != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 target")
    if march == "alderlake" and "avx_vnni" not in Path("/proc/cpuinfo").read_text(errors="replace"):
        pytest.skip("this CPU has no AVX-VNNI")


@needs_compiler
@pytest.mark.parametrize("march", MARCHES)
def test_a_trees_nodes_get_the_hidden_states_of_their_paths_decoded_one_by_one(data_dir, tmp_path, march):
    """Each node of a 64-node tree after a context: bit for bit the hidden state of the same
    tokens decoded as a chain (the context, then the node's ancestors, then itself), on this
    CPU's kernel and on the AVX2 (with and without VNNI) and plain-C ones."""
    _x86_or_native(march)
    lm = _native(_tiny(tmp_path), march)
    buffers = load_tree("medusa-64").buffers
    ancestors, depths = buffers.attn_mask, buffers.depths
    g = torch.Generator().manual_seed(4)
    context, nodes = torch.randint(3, 200, (9,), generator=g), torch.randint(3, 200, (64,), generator=g)
    cache = lm.new_cache(128)
    lm(context, *cache.prepare(torch.arange(9)), cache)
    cache.settle(9)
    tree = lm(nodes, *cache.prepare(depths, ancestors), cache).clone()
    for i in (0, 1, 5, 17, 40, 63):
        path = ancestors[i].nonzero().flatten()  # root first: ancestors before descendants
        chain_cache = lm.new_cache(128)
        whole = torch.cat([context, nodes[path]])
        chain = lm(whole, *chain_cache.prepare(torch.arange(whole.shape[0])), chain_cache)
        assert torch.equal(chain[-1], tree[i]), i


@needs_compiler
def test_a_4_bit_llama_file_on_a_cpu_is_planned_onto_the_native_forward(data_dir, tmp_path):
    """The planner's default for a 4-bit GGUF on a CPU; a family it does not run (qwen2, with
    biases) goes to another backend; torch when asked for."""
    from dataclasses import replace

    from specmemo_core.planning.device import cpu_device
    from specmemo_core.planning.entry import PlanChoices, load_planned

    choices = PlanChoices(turns=1, reply_tokens=8, speculate=False)

    def planned(path, **kw):
        return load_planned(path, heads="none", choices=replace(choices, **kw), device=cpu_device(),
                            data_folder=tmp_path, wait_for_timing=False).engine

    auto = planned(_tiny(tmp_path, "Q4_1"))
    assert (auto.backend, auto.precision, type(auto.model).__name__) == ("native", "int4", "NativeLM")
    assert planned(_tiny(tmp_path, "Q4_1", arch="qwen2")).backend in ("llamacpp", "torch")
    assert planned(_tiny(tmp_path, "Q4_1"), backend="torch").backend == "torch"


@needs_compiler
@pytest.mark.parametrize("quant", ["Q5_K", "Q4_K"])
def test_a_k_quant_file_runs_within_half_a_step_of_its_own_weights(data_dir, tmp_path, quant):
    """Formats the forward does not repack (Q5_K here) are read through gguf and held as 8-bit
    blocks of 32, each weight within half a step of the file's (and the half floats' rounding);
    Q4_K as 4-bit blocks of 32 (its scales rounded to half floats); the first row's logits
    (before any attention mixes rows) close to our float32 model's."""
    import gguf
    from gguf.quants import dequantize

    from specmemo_core.runtime.engine import Engine

    path = _tiny(tmp_path, quant, hidden=256)  # K-quants' blocks are 256 wide
    lm, ref = _native(path), Engine.load(path, heads="none").model
    held = lm.weights["blk.0.ffn_up"]
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    own = dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.tensor_type))
    four_bit = quant == "Q4_K"
    assert held.nibbles == four_bit and held.rows == 512 and held.u.shape[1:3] == (8, 4 if four_bit else 8)
    step = 0 if four_bit else np.repeat(held.d.transpose(0, 2, 1).reshape(512, 8).astype(np.float32), 32, axis=1)
    assert np.all(np.abs(packing.dequantize(held) - own) <= step / 2 + 2.0**-10 * np.abs(own).max())
    tokens = torch.randint(3, 200, (6,), generator=torch.Generator().manual_seed(5))
    cache, ref_cache = lm.new_cache(64), ref.new_cache(64)
    logits = lm.logits(lm(tokens, *cache.prepare(torch.arange(6)), cache))
    with torch.no_grad():
        expected = ref.logits(ref(tokens, *ref_cache.prepare(torch.arange(6)), ref_cache))
    assert (logits[0] - expected[0]).abs().max() < 0.03 * expected[0].abs().max()


def test_without_a_working_compiler_the_native_forward_is_unavailable_and_says_what_to_do(monkeypatch, caplog):
    """A compiler that fails (here ``false``, as Apple's clang fails on ``-fopenmp``): no
    native backend, so the planner falls back and says why in the log; asked for directly,
    the error names the other backends."""
    from specmemo_core.runtime.native import build

    monkeypatch.setenv("CC", "false")
    build.library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=build.__name__):
            assert not build.available()
        assert "building the native CPU forward failed" in caplog.text and "slower" in caplog.text
        with pytest.raises(build.NativeBuildError, match="--backend llamacpp or --backend torch"):
            build.library()
    finally:
        build.library.cache_clear()


@needs_compiler
def test_forwards_on_two_caches_from_two_threads_give_what_each_gives_alone(data_dir, tmp_path):
    """The app times steps in the background while a chat replies: each cache has its own
    workspace, and each thread its own last rows, so neither forward disturbs the other."""
    import threading

    lm = _native(_tiny(tmp_path))
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 200, (30,), generator=g) for _ in range(2)]

    def run(tokens):
        cache = lm.new_cache(128)
        out = []
        for i in range(tokens.shape[0]):
            hidden = lm(tokens[i:i + 1], *cache.prepare(torch.arange(1)), cache)
            out.append(int(lm.greedy_picks(hidden)[0]))
            cache.settle(1)
        return out

    alone = [run(p) for p in prompts]
    together: list[list[int] | None] = [None, None]
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, run(prompts[i]))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


@needs_compiler
def test_the_cache_holds_its_capacity_and_a_forward_past_it_is_refused_as_on_torch(data_dir, tmp_path):
    """The native cache holds exactly the planner's KV bytes (no scratch slots beyond its
    capacity); a forward that would pass it raises the context-full error our torch forward
    raises."""
    from specmemo_core.errors import ContextFullError

    lm = _native(_tiny(tmp_path))
    cache = lm.new_cache(16)
    spec = lm.spec
    assert cache.nbytes == 2 * spec.num_layers * 16 * spec.num_kv_heads * spec.head_dim * 4
    tokens = torch.arange(3, 15)
    lm(tokens, *cache.prepare(torch.arange(12)), cache)
    cache.settle(12)
    with pytest.raises(ContextFullError):
        lm(tokens[:5], *cache.prepare(torch.arange(5)), cache)


def _held(lm) -> int:
    """The bytes a loaded NativeLM holds its weights in: the packed arrays and norms, the float
    embedding and head (one tensor where tied) and the head's int8 rows."""
    arrays = {id(a): a for a in lm.weights.values()}
    tensors = {t.data_ptr(): t for t in (lm.embed_tokens.weight, lm.head_weight, lm.lm_head.rows, lm.lm_head.scale)}
    return sum(a.nbytes for a in arrays.values()) + sum(t.numel() * t.element_size() for t in tensors.values())


@needs_compiler
@pytest.mark.parametrize("quant,tied", [("Q4_1", True), ("Q4_K", False), ("Q4_0", True)])
def test_the_planner_counts_the_bytes_the_native_forward_holds(data_dir, tmp_path, quant, tied):
    """A 4-bit GGUF planned for a CPU is counted as the native forward holds it (its blocks as
    packed, 8-bit ones for formats it does not repack, the float embedding and an untied head
    beside them): to the byte, more than torch's int4 count, which it replaces."""
    from specmemo_core.planning.device import cpu_device
    from specmemo_core.planning.entry import inputs_before_load
    from specmemo_core.planning.memory import weight_bytes
    from specmemo_core.runtime.native.lm import held_bytes
    from specmemo_core.storage.sources import open_model

    path = write_tiny_gguf(tmp_path / f"t-{quant}.gguf", hidden=256, layers=2, quant=quant, tied=tied)
    opened = open_model(path)
    lm = _native(path)
    held = _held(lm)
    assert held_bytes(opened.gguf_index, lanes=lm.lib.sm_lanes()) == held
    shape = inputs_before_load(opened, "none", cpu_device(), link=None).model
    assert shape.native_bytes == held
    assert weight_bytes(shape, "int4", device_kind="cpu") == held
    assert weight_bytes(dataclasses.replace(shape, native_bytes=None), "int4", device_kind="cpu") < held


@needs_compiler
def test_the_default_models_plan_on_a_cpu_counts_what_its_native_forward_holds(shared_data_dir):
    """The default model (Q4_1 matrices, a Q8_0 embedding, tied): the planner's weight bytes on a
    CPU are the loaded native forward's, to the byte (torch's int4 count was 13% short: it had
    no packed embedding)."""
    from specmemo_core.planning.device import cpu_device
    from specmemo_core.planning.entry import inputs_before_load
    from specmemo_core.planning.memory import weight_bytes
    from specmemo_core.runtime.native.lm import load_native
    from specmemo_core.storage.sources import open_model

    opened = open_model("default")
    held = _held(load_native(opened, threads=2))
    shape = inputs_before_load(opened, "none", cpu_device(), link=None).model
    assert weight_bytes(shape, "int4", device_kind="cpu") == held
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8").split())
    assert f"For the default model that is {held / 1e6:.1f} MB" in readme
