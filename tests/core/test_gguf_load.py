"""Streaming GGUF loading: the same weights as transformers' loader, tensor for tensor,
for quantized files of both supported families; the cache is keyed by the content."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specmemo_core.errors import ModelFileError
from specmemo_core.storage import gguf_load
from specmemo_core.storage.sources import load_model, open_model
from specmemo_core.tools.synthetic_gguf import NO_QUANTIZER
from tests.core.test_sources import write_tiny_gguf


def _transformers_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """What the earlier loader kept: transformers' own de-quantizing GGUF import."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 local_files_only=True)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("arch", "quant"), [("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"),
                                              ("llama", "F16"), ("qwen2", "Q5_1"), ("qwen2", "BF16")])
def test_streamed_weights_equal_transformers(data_dir: Path, tmp_path: Path, arch: str, quant: str) -> None:
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", hidden=32, arch=arch, quant=quant, tied=arch == "llama")
    loaded = load_model(path)
    expected = _transformers_state_dict(path)
    assert loaded.state_dict.keys() == expected.keys()
    unequal = [k for k, v in expected.items() if not torch.equal(loaded.state_dict[k], v)]
    assert unequal == []
    assert loaded.config.model_type == arch
    assert loaded.config.tie_word_embeddings == (arch == "llama")


def test_rotary_rows_are_put_back_for_llama_only() -> None:
    """llama.cpp stores each head's rotary pairs as halves; undoing it is a per-head
    interleave, and its inverse is llama.cpp's own permutation."""
    heads, head_dim, cols = 2, 8, 3
    hf = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)  # [out, in]
    stored = hf.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)  # llama.cpp's order
    assert not np.array_equal(stored, hf)
    assert np.array_equal(gguf_load._unpermute(stored, heads), hf)


def test_bfloat16_is_converted_tensor_by_tensor_with_a_dtype_free_fingerprint(data_dir: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=32, quant="Q8_0")
    full, half = load_model(path), load_model(path, dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in half.state_dict.values())
    assert torch.equal(half.state_dict["model.layers.0.mlp.up_proj.weight"],
                       full.state_dict["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16))
    assert half.identity == full.identity


def test_unsupported_architecture_is_refused_before_loading(data_dir: Path, tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="architecture 'gpt2' is not supported") as info:
        load_model(path)
    assert str(path) in str(info.value)
    assert not (data_dir / "cache").exists()


def test_file_is_hashed_once_and_the_cache_is_reused(data_dir: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=32, quant="Q8_0")
    stages: list[str] = []
    first = load_model(path, progress=lambda stage, fraction: stages.append(stage))
    assert "checking file" in stages and not first.from_cache
    stages.clear()
    second = load_model(path, progress=lambda stage, fraction: stages.append(stage))
    assert "checking file" not in stages and second.from_cache
    assert all(torch.equal(v, first.state_dict[k]) for k, v in second.state_dict.items())
    assert not list((data_dir / "cache").glob("*/model.safetensors"))  # no float copy of the weights is kept


def test_damaged_cache_is_rebuilt(data_dir: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=32)
    first = load_model(path)
    (cache,) = (data_dir / "cache").iterdir()
    (cache / "gguf_index.json").write_text("{not json")
    again = load_model(path)
    assert not again.from_cache and again.identity == first.identity
    assert load_model(path).from_cache


QUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16")


def test_the_k_quants_have_no_quantizer_in_gguf() -> None:
    """Why write_tiny_gguf makes K-quant blocks from random fields: if gguf gains
    quantizers for them, quantize real values instead."""
    import gguf
    from gguf.quants import quantize

    for name in NO_QUANTIZER:
        with pytest.raises(NotImplementedError):
            quantize(np.zeros((1, 256), dtype=np.float32), gguf.GGMLQuantizationType[name])


@pytest.mark.parametrize("quant", QUANT_TYPES)
def test_each_quantization_type_reads_as_gguf_dequantizes_it(data_dir: Path, tmp_path: Path, quant: str) -> None:
    """Every tensor, through the loader's path (open_model → tensors), is gguf's own
    de-quantization bit for bit in float32 (q and k: with llama.cpp's row order undone)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = write_tiny_gguf(tmp_path / f"{quant}.gguf", hidden=256, quant=quant, tied=False)
    reader = GGUFReader(path)
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    expected = {}
    for t in reader.tensors:
        reference = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if ".attn_q." in t.name or ".attn_k." in t.name:
            reference = gguf_load._unpermute(reference, heads if ".attn_q." in t.name else kv_heads)
        expected[gguf_load.hf_name(t.name)] = reference
    assert all(t.tensor_type.name == quant for t in reader.tensors if len(t.shape) == 2)  # every matrix
    seen = set()
    for name, tensor in open_model(path).tensors():
        assert tensor.dtype == torch.float32 and torch.isfinite(tensor).all()
        want = np.ascontiguousarray(expected[name], dtype=np.float32)
        assert tensor.shape == want.shape
        assert np.array_equal(tensor.numpy().view(np.uint32), want.view(np.uint32)), name
        seen.add(name)
    assert seen == set(expected)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_streamed_load_quantizes_as_the_whole_model_would(data_dir: Path, tmp_path: Path, precision: str) -> None:
    """Engine.load of a file quantizes each decoder weight as it arrives; the result is the
    same, bit for bit, as quantizing the whole float model after loading it."""
    from specmemo_core.runtime.decoding import Decoder, GenerationConfig
    from specmemo_core.runtime.engine import Engine
    from specmemo_core.runtime.model import CausalLM, causal_mask
    from specmemo_core.runtime.quantize import QuantSpec, held_bytes, quantize_model

    path = write_tiny_gguf(tmp_path / "q4k.gguf", hidden=256, quant="Q4_K", tied=False)
    streamed = Engine.load(path, heads="none", precision=precision).model
    loaded = load_model(path)
    whole = quantize_model(CausalLM.from_state_dict(loaded.config, loaded.state_dict), QuantSpec(precision))
    tokens = torch.tensor([5, 9, 40, 7])
    hidden = [m(tokens, torch.arange(4), causal_mask(0, 4), m.new_cache(8)) for m in (streamed, whole)]
    assert torch.equal(hidden[0], hidden[1])  # the engine's LM head is then packed for oneDNN (cpu_linear.py)
    assert held_bytes(streamed.model.layers) == held_bytes(whole.model.layers)
    decoder = Decoder(streamed, streamed.new_cache(16))
    assert len([t for s in decoder.generate([5, 9], GenerationConfig(max_new_tokens=1)) for t in s.token_ids]) == 1


def test_unsupported_architecture_is_refused_by_the_engine_before_loading(data_dir: Path, tmp_path: Path) -> None:
    import gguf

    from specmemo_core.runtime.engine import Engine

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="architecture 'phi3' is not supported") as info:
        Engine.load(path, heads="none", precision="int4")
    assert "use a GGUF of a supported model family" in str(info.value)
    assert not (data_dir / "cache").exists()


_LOAD_INT4 = """
import sys, torch
from specmemo_core.runtime.engine import Engine
from specmemo_core.runtime.model import causal_mask
stages = []
model = Engine.load(sys.argv[1], heads="none", precision="int4", progress=lambda s, f: stages.append(s)).model
tokens = torch.tensor([5, 9, 40, 7])
torch.save(model(tokens, torch.arange(4), causal_mask(0, 4), model.new_cache(8)), sys.argv[2])
print("|".join(stages))
"""


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_weights_are_kept_at_their_precision_and_read_back(data_dir: Path, tmp_path: Path,
                                                                     arch: str) -> None:
    """The first int4 load keeps the quantized decoder weights beside the file's cache; the
    next start (a fresh process, as a user's) reads them from there instead of quantizing
    again, with the same result; a damaged copy is quantized again and replaced."""
    import subprocess
    import sys

    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=256, quant="Q4_0", tied=False, arch=arch)

    def start(n: int) -> tuple[torch.Tensor, str]:
        out = tmp_path / f"hidden-{n}.pt"
        done = subprocess.run([sys.executable, "-c", _LOAD_INT4, str(path), str(out)], capture_output=True,
                              text=True, check=True)
        return torch.load(out), done.stdout

    first, stages = start(1)
    assert "loading and quantizing to int4" in stages
    kept = list((data_dir / "cache").glob("*/weights-int4-g32-cpu-*.pt"))
    assert len(kept) == 1
    second, stages = start(2)
    assert "loading int4 weights from the cache" in stages and torch.equal(first, second)
    kept[0].write_bytes(b"cut")
    third, stages = start(3)
    assert "loading and quantizing to int4" in stages and torch.equal(first, third)
    assert kept[0].stat().st_size > 1000


def test_the_plan_picks_the_precision_before_the_weights_are_read(data_dir: Path, tmp_path: Path) -> None:
    """On a CPU whose memory holds the model in int8 or int4 but not in fp32, load_planned
    (the user chose no precision) loads it at the plan's quantized precision directly."""
    from dataclasses import replace

    from specmemo_core.planning.device import cpu_device
    from specmemo_core.planning.entry import PlanChoices, inputs_before_load, load_planned, make_plan
    from specmemo_core.storage.sources import open_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=256, layers=4, quant="Q8_0", tied=False)
    choices = PlanChoices(turns=1, prompt_tokens=8, reply_tokens=8, speculate=False)
    opened = open_model(path)

    def plan_with(free: int, precision: str | None):
        device = replace(cpu_device(), total_bytes=free, free_bytes=free)
        return make_plan(inputs_before_load(opened, "none", device, link=None), replace(choices, precision=precision))

    low, high = 1, 2**36  # the least memory the int8 plan fits in (the planner is a pure function)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if plan_with(middle, "int8").fits else (middle, high)
    assert not plan_with(high, "fp32").fits and plan_with(high, None).precision in ("int8", "int4")
    device = replace(cpu_device(), total_bytes=high, free_bytes=high)
    planned = load_planned(path, heads="none", choices=choices, device=device, data_folder=tmp_path,
                           wait_for_timing=False)
    assert planned.engine.precision == planned.plan.precision == plan_with(high, None).precision


def test_int4_weights_are_cached_apart_for_fp32_and_bf16_activations(data_dir: Path, tmp_path: Path) -> None:
    """int4 weights are packed for their activations' dtype: a bf16 model after an fp32 one
    on the same file quantizes its own instead of taking the fp32 ones (which failed with
    "expected scalar type BFloat16 but found Float" in the first forward)."""
    from specmemo_core.runtime.decoding import Decoder, GenerationConfig
    from specmemo_core.runtime.model_build import build_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=64, quant="Q4_1")
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        model = build_model(open_model(path), precision="int4", dtype=dtype, device=torch.device("cpu"))
        assert model.dtype == dtype
        steps = Decoder(model, model.new_cache(32)).generate([1, 2, 3], GenerationConfig(max_new_tokens=4))
        assert sum(len(s.token_ids) for s in steps) == 4
    keys = {p.name for p in (data_dir / "cache").rglob("*") if "int4" in p.name}
    assert any("float32" in k for k in keys) and any("bfloat16" in k for k in keys), keys


@pytest.mark.parametrize(("quant", "bits"), [("Q4_0", 4), ("Q4_1", 4), ("Q4_K", 4), ("Q8_0", 8), ("F16", 16),
                                             ("F32", 32)])
def test_the_files_bits_per_weight_are_read_from_its_header(data_dir: Path, tmp_path: Path, quant: str,
                                                            bits: int) -> None:
    """What the planner runs on a CPU follows the file: most decoder matrices' bits."""
    path = write_tiny_gguf(tmp_path / f"{quant}.gguf", hidden=256, quant=quant, tied=False)
    assert open_model(path).stored_bits == bits
    assert load_model(path).stored_bits == bits


def test_a_4_bit_file_is_planned_and_loaded_as_int4_on_a_cpu(data_dir: Path, tmp_path: Path) -> None:
    from specmemo_core.planning.device import cpu_device
    from specmemo_core.planning.entry import PlanChoices, load_planned
    from specmemo_core.runtime.quantize import Int4CpuLinear

    path = write_tiny_gguf(tmp_path / "q4.gguf", hidden=256, quant="Q4_1", tied=True)
    choices = PlanChoices(turns=1, reply_tokens=8, speculate=False, backend="torch")  # llama.cpp's: test_ggml_step
    planned = load_planned(path, heads="none", choices=choices, device=cpu_device(), data_folder=tmp_path,
                           wait_for_timing=False)
    assert planned.plan.precision == planned.engine.precision == "int4"
    model = planned.engine.model
    assert type(model.model.layers[0].mlp.down_proj) is Int4CpuLinear
    assert type(model.lm_head).__name__ == "Int8RowLinear" and model.model.embed_tokens.weight.dtype == torch.float32
