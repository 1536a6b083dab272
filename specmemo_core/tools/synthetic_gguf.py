"""GGUF files of random weights, in any of the block formats our loader reads.

For tests (each quantization type, checked against ``gguf``'s de-quantization) and for
``scripts/make_synthetic_gguf.py`` (a Llama-3-8B-shaped file to measure a large load on).

Two ways to make a tensor's bytes:

- ``gguf.quants.quantize`` of random floats, where ``gguf`` has a quantizer (F16, BF16,
  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0);
- ``random_blocks``: random bytes for every field of each block, with the fp16 fields
  (scales, minimums) overwritten by finite positive values. Any bytes are a valid block
  of these formats once those fields are finite: the other fields are integer codes
  (quants, 6-bit sub-block scales) whose every value is legal. ``gguf`` 0.17 has no
  quantizer for the K-quants (``NO_QUANTIZER``), so this is the only way to make them
  here; it is also ~20x faster than quantizing, which matters for 8 billion weights.

A file is written a tensor at a time (``GGUFWriter.add_tensor_info`` for the header, then
``write_tensor_data`` in the same order), so an 8B model never sits in memory whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

# byte offsets of the fp16 fields in one block, per format (llama.cpp's block layouts)
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
NO_QUANTIZER = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # gguf has no quantize() for these
# per format: the fp16 scale that gives weights of standard deviation about 1 from random codes
# (uniform 4-bit codes around 8: sd 4.6; uniform int8: sd 74; 5-bit around 16: sd 9.2)
UNIT_SCALE = {"Q4_0": 1 / 4.6, "Q4_1": 1 / 4.6, "Q5_0": 1 / 9.2, "Q5_1": 1 / 9.2, "Q8_0": 1 / 74}


def random_blocks(kind: str, shape: tuple[int, int], rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """The raw bytes (uint8, gguf's byte shape [rows, bytes]) of a ``kind`` tensor of
    ``shape`` [rows, cols]: random codes, fp16 fields uniform in [scale/2, 3·scale/2)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rows, cols = shape
    if cols % block:
        raise ValueError(f"{kind} needs rows of a multiple of {block} weights, not {cols}")
    blocks = np.frombuffer(rng.bytes(rows * cols // block * size), dtype=np.uint8).reshape(-1, size).copy()
    for at in FP16_FIELDS[kind]:
        values = (scale * (0.5 + rng.random(blocks.shape[0], dtype=np.float32))).astype(np.float16)
        blocks[:, at:at + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


def quantized(kind: str, values: np.ndarray) -> np.ndarray:
    """``values`` (float32 [rows, cols]) stored as ``kind`` by ``gguf``'s own quantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if kind in NO_QUANTIZER:
        raise ValueError(f"gguf has no quantizer for {kind}: use random_blocks")
    return quantize(values, GGMLQuantizationType[kind])


@dataclass(frozen=True)
class LlamaShape:
    """The sizes a llama-architecture GGUF declares (Llama-3-8B: ``LLAMA3_8B``)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 10000.0
    context: int = 8192
    tied: bool = False

    def tensor_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(GGUF name, [rows, cols] or [n]) in llama.cpp's order: embedding, blocks, norm, head."""
        head_dim = self.hidden // self.heads
        kv = self.kv_heads * head_dim
        yield "token_embd.weight", (self.vocab, self.hidden)
        for i in range(self.layers):
            yield f"blk.{i}.attn_norm.weight", (self.hidden,)
            yield f"blk.{i}.attn_q.weight", (self.hidden, self.hidden)
            yield f"blk.{i}.attn_k.weight", (kv, self.hidden)
            yield f"blk.{i}.attn_v.weight", (kv, self.hidden)
            yield f"blk.{i}.attn_output.weight", (self.hidden, self.hidden)
            yield f"blk.{i}.ffn_norm.weight", (self.hidden,)
            yield f"blk.{i}.ffn_gate.weight", (self.intermediate, self.hidden)
            yield f"blk.{i}.ffn_up.weight", (self.intermediate, self.hidden)
            yield f"blk.{i}.ffn_down.weight", (self.hidden, self.intermediate)
        yield "output_norm.weight", (self.hidden,)
        if not self.tied:
            yield "output.weight", (self.vocab, self.hidden)


LLAMA3_8B = LlamaShape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256,
                       rope_theta=500000.0, context=8192)


@dataclass(frozen=True)
class TokenizerFields:
    """A GGUF's ``tokenizer.*`` metadata: a gpt2-style BPE vocabulary and its chat template."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos: int
    eos: int
    chat_template: str

    @classmethod
    def from_gguf(cls, path: Path) -> "TokenizerFields":
        from gguf import GGUFReader

        fields = GGUFReader(path).fields

        def value(key: str):
            return fields[key].contents()

        return cls(list(value("tokenizer.ggml.tokens")), [int(t) for t in value("tokenizer.ggml.token_type")],
                   list(value("tokenizer.ggml.merges")), str(value("tokenizer.ggml.pre")),
                   int(value("tokenizer.ggml.bos_token_id")), int(value("tokenizer.ggml.eos_token_id")),
                   str(value("tokenizer.chat_template")))

    def padded(self, vocab: int) -> "TokenizerFields":
        """The same tokenizer with control tokens ``<|reserved_N|>`` added up to ``vocab``
        ids (as Llama 3 reserves its unused ids): the text still encodes as before."""
        extra = vocab - len(self.tokens)
        if extra < 0:
            raise ValueError(f"the tokenizer has {len(self.tokens)} tokens, more than {vocab}")
        control = 3  # gguf's TokenType.CONTROL
        return TokenizerFields(self.tokens + [f"<|reserved_{i}|>" for i in range(extra)],
                               self.token_types + [control] * extra, self.merges, self.pre, self.bos, self.eos,
                               self.chat_template)


TensorBytes = Callable[[str, tuple[int, ...]], np.ndarray]


def write_llama_gguf(path: Path, shape: LlamaShape, tokenizer: TokenizerFields, matrix: TensorBytes, *,
                     kind: str, progress: Callable[[int, int], None] | None = None) -> Path:
    """A llama GGUF of ``shape``: every matrix is ``matrix(name, [rows, cols])``'s bytes of
    GGML type ``kind``, every norm ones (float32). Written a tensor at a time."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_rope_dimension_count(shape.hidden // shape.heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{kind}"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer.pre)
    w.add_token_list(tokenizer.tokens)
    w.add_token_types(tokenizer.token_types)
    w.add_token_merges(tokenizer.merges)
    w.add_bos_token_id(tokenizer.bos)
    w.add_eos_token_id(tokenizer.eos)
    w.add_chat_template(tokenizer.chat_template)
    shapes = list(shape.tensor_shapes())
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    for name, dims in shapes:
        if len(dims) == 1:
            w.add_tensor_info(name, dims, np.dtype(np.float32), dims[0] * 4)
        else:
            rows, cols = dims
            w.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), rows * cols // block * size,
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, dims) in enumerate(shapes):
        w.write_tensor_data(np.ones(dims, dtype=np.float32) if len(dims) == 1 else matrix(name, dims))
        if progress is not None:
            progress(i + 1, len(shapes))
    w.close()
    return path
