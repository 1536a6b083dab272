"""Weights straight from a GGUF file, one tensor at a time.

The file is memory-mapped; each tensor is de-quantized on its own (``gguf.quants``),
put in the layout our model expects and handed on (``iter_tensors``): the consumer
converts it to its precision (``CausalLM.from_tensors``: bf16, or int8/int4 at once) and
drops the float32 copy, so the peak is the final weights plus one tensor. The tensor table and
the config are small and are kept in a cache folder: parsing the header of a model
with a 49k-token vocabulary takes seconds in ``GGUFReader``, mapping the file does not.
"""

from __future__ import annotations

import json
import mmap
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Container, Iterator

import numpy as np
import torch

from specmemo_core.errors import ModelFileError
from specmemo_core.storage import dequant

if TYPE_CHECKING:
    import transformers
    from gguf import GGUFReader

Progress = Callable[[str, float], None]
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_FIX = "download it again, or delete it and use 'default' for the built-in model"
_ROTARY_PERMUTED = ("llama", "mistral")  # llama.cpp reorders these families' Q/K rows for its RoPE kernel
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_UNUSED = ("rope_freqs.weight",)  # NOTE: Llama-3.1 long-context factors; transformers ignores them too


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in the file and how to read them."""

    name: str  # GGUF name, e.g. blk.0.attn_q.weight
    kind: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # numpy order (rows first), as the model wants it
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFIndex:
    """The file's tensor table and the head counts that undo llama.cpp's Q/K reordering."""

    architecture: str
    tensors: tuple[TensorEntry, ...]
    num_heads: int
    num_kv_heads: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "GGUFIndex":
        data = json.loads(text)
        tensors = tuple(TensorEntry(t["name"], int(t["kind"]), tuple(t["shape"]), int(t["offset"]), int(t["nbytes"]))
                        for t in data["tensors"])
        return cls(str(data["architecture"]), tensors, int(data["num_heads"]), int(data["num_kv_heads"]))


# NOTE: bits per weight of each GGML tensor type, by the type's number in the file format
# (ggml's enum, fixed by the format), so reading a header never imports gguf
_BITS = {0: 32, 1: 16, 30: 16, 28: 64, 2: 4, 3: 4, 12: 4, 20: 4, 23: 4, 39: 4, 6: 5, 7: 5, 13: 5, 14: 6,
         8: 8, 9: 8, 15: 8, 24: 8, 10: 2, 16: 2, 17: 2, 22: 2, 35: 2, 11: 3, 18: 3, 21: 3, 19: 1, 29: 1, 34: 1}


def stored_bits(index: GGUFIndex) -> int:
    """Bits per weight most of the decoder's matrices are stored in (Q4_0, Q4_1, Q4_K,
    IQ4_XS: 4; Q8_0: 8; F16: 16), by count of matrices; what the planner runs on a CPU."""
    from collections import Counter

    matrices = [t for t in index.tensors if _BLOCK_NAME.fullmatch(t.name) and len(t.shape) == 2]
    counts = Counter(_BITS.get(t.kind, 16) for t in matrices)
    return counts.most_common(1)[0][0] if counts else 16


def hf_name(gguf_name: str) -> str | None:
    """Our state-dict name for a GGUF tensor name; None for one the model does not use."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    found = _BLOCK_NAME.fullmatch(gguf_name)
    if found is None or found[2] not in _BLOCK:
        return None
    return f"model.layers.{found[1]}.{_BLOCK[found[2]]}.{found[3]}"


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return field.contents() if field is not None else default


def read_header(path: Path) -> tuple[GGUFIndex, "transformers.PretrainedConfig"]:
    """Parse the file's header: refuses an unsupported family or tensor type before
    anything is allocated, and names the file when it is truncated or corrupt."""
    from gguf import GGUFReader

    try:  # parses every tensor header and maps its data: a truncated file fails here
        reader = GGUFReader(path)
    except Exception as exc:
        raise ModelFileError(path, f"the file is truncated or corrupt ({exc})", _FIX) from exc
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(path, f"architecture {arch!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})", "use a GGUF of a supported model family")
    tensors = tuple(_entry(path, t) for t in reader.tensors if t.name not in _UNUSED)
    unknown = [t.name for t in tensors if hf_name(t.name) is None]
    if unknown:
        raise ModelFileError(path, f"tensors this {arch} loader does not know: {', '.join(unknown[:5])}",
                             "use a plain (not multimodal or mixture-of-experts) GGUF of a supported family")
    try:  # a missing or nonsensical size key (None, 0 heads) is a bad file, not a bug
        config = build_config(reader, arch, tensors)
    except Exception as exc:
        raise ModelFileError(path, f"its metadata cannot describe a model ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''})", _FIX) from exc
    heads = config.num_attention_heads
    return GGUFIndex(arch, tensors, heads, config.num_key_value_heads or heads), config


def _entry(path: Path, tensor: Any) -> TensorEntry:
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # NOTE: gguf exposes no public "can de-quantize" check

    kind = GGMLQuantizationType(tensor.tensor_type)
    if kind not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) and kind not in _type_traits:
        raise ModelFileError(path, f"tensor {tensor.name} is stored as {kind.name}, which cannot be de-quantized here",
                             "use a GGUF quantized as Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, a K-quant, F16, BF16 or F32")
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return TensorEntry(tensor.name, int(kind), shape, int(tensor.data_offset), int(tensor.n_bytes))


def build_config(reader: GGUFReader, arch: str, tensors: tuple[TensorEntry, ...]) -> "transformers.PretrainedConfig":
    """The transformers config of the model, from the GGUF metadata keys."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    names = {t.name: t for t in tensors}
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = key("attention.key_length") or (key("rope.dimension_count") if arch in _ROTARY_PERMUTED else None)
    fields = dict(
        vocab_size=names["token_embd.weight"].shape[0], hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")), num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(head_dim or hidden // heads), rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")), rope_theta=float(key("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    kind = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    return kind(**fields)


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion, which stores each head's rotary pairs as two halves
    interleaved: rows (h, pair, i) back to (h, i, pair). Works for weights and biases."""
    rows = weight.shape[0]  # [out, in] or [out]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def read_tensor(data: np.ndarray, entry: TensorEntry, index: GGUFIndex) -> np.ndarray:
    """One tensor de-quantized to float32 in our layout; ``data`` is the file, memory-mapped."""
    raw = data[entry.offset: entry.offset + entry.nbytes].view(np.ndarray)  # a plain view of the mapped file
    if dequant.supported(entry.kind):  # F32 and the simple block formats, whole-tensor in torch
        weight = dequant.dequantize_blocks(raw, entry.kind, tuple(entry.shape))
    else:  # every other format (K-quants, Q5, I-quants) through gguf
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quant_shape_to_byte_shape

        kind = GGMLQuantizationType(entry.kind)
        raw = raw.reshape(quant_shape_to_byte_shape(entry.shape, kind))  # subclass costs per operation
        weight = dequantize(raw, kind)  # float32 [rows, cols]
    if index.architecture in _ROTARY_PERMUTED and (".attn_q." in entry.name or ".attn_k." in entry.name):
        weight = _unpermute(weight, index.num_heads if ".attn_q." in entry.name else index.num_kv_heads)
    return weight


def check_complete(path: Path, index: GGUFIndex) -> None:
    """Refuse a file that ends before its last tensor (a cut download), before any is read."""
    if path.stat().st_size < max((t.offset + t.nbytes for t in index.tensors), default=0):
        raise ModelFileError(path, "the file is truncated or corrupt (it ends before its last tensor)", _FIX)


def map_file(path: Path) -> tuple[mmap.mmap, np.ndarray]:
    """The file mapped read-only, and the same bytes as a uint8 array (views, no copy)."""
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return mapped, np.frombuffer(mapped, dtype=np.uint8)


def _release(mapped: mmap.mmap, entry: TensorEntry) -> None:
    """Unmap the pages a tensor was read from: they stay in the OS's file cache (a later
    start reads them from there) but leave this process, whose memory would otherwise
    grow by the whole file as it is read."""
    if not hasattr(mapped, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):  # NOTE: Windows keeps them mapped
        return
    start = entry.offset - entry.offset % mmap.PAGESIZE
    mapped.madvise(mmap.MADV_DONTNEED, start, min(entry.offset + entry.nbytes, len(mapped)) - start)


def _read_released(mapped: mmap.mmap, data: np.ndarray, entry: TensorEntry, index: GGUFIndex) -> torch.Tensor:
    weight = read_tensor(data, entry, index)
    tensor = torch.from_numpy(weight if weight.flags.writeable else weight.copy())  # [rows, cols] float32
    _release(mapped, entry)
    return tensor


def iter_tensors(path: Path, index: GGUFIndex, progress: Progress, *,
                 skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a file ``check_complete`` passed, by our state-dict name, de-quantized
    to float32 one at a time: the caller converts each to its precision and drops it before
    asking for the next (this generator keeps no reference to what it yielded). ``skip``:
    names not to read (the caller has them already, e.g. quantized from a cache)."""
    mapped, data = map_file(path)
    entries = [t for t in index.tensors if hf_name(t.name) not in skip]
    for i, entry in enumerate(entries):
        yield str(hf_name(entry.name)), _read_released(mapped, data, entry, index)
        progress("loading weights", (i + 1) / len(entries))
