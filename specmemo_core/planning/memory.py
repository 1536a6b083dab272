"""Memory model: bytes of every term of a chat on a device, from the model's real shapes.

Notation: V vocabulary, D hidden size, I MLP size, L layers, H query heads, Hkv
key/value heads, hd head dim, b bytes per element of the activation dtype (fp32 4,
bf16/fp16 2), N tree nodes, S tokens in the KV cache, K heads.

Two corrections to the SpecMemo paper are built in: the KV cache keeps ``hd`` numbers
per head and token (its Eq. 1 drops head_dim), and a draft head is a few D×D blocks on
the base model's own LM head, not a private 0.6 GB copy of it (its Eq. 4).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from specmemo_core.errors import SpecMemoError

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# LM-head rows scored at once where only the argmax is needed (``model.CausalLM.greedy_picks``);
# here, not in model.py, so that the memory model and the planner stay free of torch
PICK_ROWS = 16384
# a GPU step's attention over a static cache (``runtime.chunked_attention``): slots per chunk,
# and the most query rows (query heads sharing a key/value head × tokens) it runs for
ATTENTION_SPLIT = 128
ATTENTION_MAX_ROWS = 256
PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4")
QUANT_SCALE_BYTES = 2  # int4 scales / zero points are stored in 16 bits
INT8_ROW_BYTES = 5  # torchao's int8 rows: a float32 scale and an int8 zero point each
INT4_GROUP_SIZE = 32  # inputs per int4 scale/zero point (GGUF Q4's block size; quantize.py)
INT4_CUDA_IN_MULTIPLE = 1024  # tinygemm pads each Linear's input width to this
INT4_CUDA_OUT_MULTIPLE = 8  # ... and its output width to this


@dataclass(frozen=True)
class ModelDimensions:
    """The sizes of a Llama-family decoder: the one field list of ``ModelShape`` (here, for
    planning without torch) and ``runtime.model.ModelSpec`` (for running the model)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool


@dataclass(frozen=True, kw_only=True)
class ModelShape(ModelDimensions):
    """The numbers memory depends on (a ``ModelSpec`` without the behaviour flags)."""

    name: str
    max_context: int
    stored_bits: int | None = None  # bits per decoder weight in the model's file (a Q4_1 GGUF: 4); None: unknown
    # the bytes a CPU's 4-bit run holds its weights in, counted from its file where our native
    # forward runs it (``runtime/native/lm.held_bytes``: the file's blocks as it packs them, and
    # the float embedding and LM head beside them); None: as torch's int4 holds them
    native_bytes: int | None = None

    @classmethod
    def from_spec(cls, spec: Any, name: str = "", *, stored_bits: int | None = None,
                  native_bytes: int | None = None) -> "ModelShape":
        """The shape of a ``runtime.model.ModelSpec``, named ``name`` (default: its model type)."""
        dims = {f.name: vars(spec)[f.name] for f in fields(ModelDimensions)}
        return cls(**dims, name=name or spec.model_type, max_context=spec.max_position_embeddings,
                   stored_bits=stored_bits, native_bytes=native_bytes)

    def layer_linear_params(self) -> list[tuple[int, int]]:
        """(out, in) of every Linear in one decoder layer: q, k, v, o, gate, up, down."""
        d, hd = self.hidden_size, self.head_dim
        return [(self.num_heads * hd, d), (self.num_kv_heads * hd, d), (self.num_kv_heads * hd, d),
                (d, self.num_heads * hd), (self.intermediate_size, d), (self.intermediate_size, d),
                (d, self.intermediate_size)]

    @property
    def params(self) -> int:
        linear = sum(o * i for o, i in self.layer_linear_params()) * self.num_layers
        norms = (2 * self.num_layers + 1) * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return linear + norms + embed


# Well-known shapes, so plans can be tried at scale without the weights.
KNOWN_SHAPES = {
    "smollm2-135m": ModelShape(49152, 576, 1536, 30, 9, 3, 64, True, name="smollm2-135m", max_context=8192),
    "vicuna-7b": ModelShape(32000, 4096, 11008, 32, 32, 32, 128, False, name="vicuna-7b", max_context=2048),
    "llama-2-7b": ModelShape(32000, 4096, 11008, 32, 32, 32, 128, False, name="llama-2-7b", max_context=4096),
    "llama-3-8b": ModelShape(128256, 4096, 14336, 32, 32, 8, 128, False, name="llama-3-8b", max_context=8192),
    "mistral-7b": ModelShape(32000, 4096, 14336, 32, 32, 8, 128, False, name="mistral-7b", max_context=32768),
    "qwen2-7b": ModelShape(152064, 3584, 18944, 28, 28, 4, 128, False, name="qwen2-7b", max_context=32768),
    "vicuna-13b": ModelShape(32000, 5120, 13824, 40, 40, 40, 128, False, name="vicuna-13b", max_context=2048),
}


def known_shape(name: str) -> ModelShape:
    try:
        return KNOWN_SHAPES[name.lower()]
    except KeyError:
        raise SpecMemoError(f"unknown model shape {name!r}; known: {', '.join(KNOWN_SHAPES)}") from None


def activation_bytes(precision: str) -> int:
    """Bytes of activations, KV cache and unquantized weights: int8/int4 keep bf16 there."""
    if precision not in PRECISIONS:
        raise SpecMemoError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return ACTIVATION_BYTES.get(precision, 2)


def around_precision(precision: str, device_kind: str) -> str:
    """The precision of what surrounds the weights (KV cache, activations, heads, tree
    buffers): int8/int4 on a CPU run with fp32 there (``entry.torch_dtype``), elsewhere as
    ``activation_bytes`` says."""
    return "fp32" if device_kind == "cpu" and precision in ("int8", "int4") else precision


def weight_bytes(shape: ModelShape, precision: str, group_size: int = INT4_GROUP_SIZE,
                 device_kind: str = "cuda") -> int:
    """Weights.

    16/32-bit: params × b.
    int8 weight-only: each decoder Linear keeps 1 byte per weight plus, per output row,
      a float32 scale and an int8 zero point (5 bytes, as torchao 0.18 stores them);
      embeddings, LM head and norms stay 16-bit.
    int4 weight-only: ½ byte per weight plus a 16-bit scale and zero point per group of
      ``group_size`` inputs of each output row; the rest as for int8. On CUDA the
      tinygemm kernel pads each Linear to in' = ⌈in/1024⌉·1024, out' = ⌈out/8⌉·8 first
      (a 576-wide model stores 1024 columns), so there the sizes are the padded ones.
    CPU, int8/int4: the model around the quantized layers is fp32 (``entry.torch_dtype``),
      so embeddings, LM head and norms take 4 bytes; int4's scales and zero points are
      bf16 (the CPU kernel's fast path, ``quantize.py``).
    CPU, fp32 and int8: the fp32 linear layers are packed for oneDNN (``cpu_linear.py``); a
      packed LM head tied to the embedding is a copy of it: + vocab × hidden × 4.
    CPU, int4: the LM head is held as int8 rows with a bf16 scale each (``cpu_linear.
      Int8RowLinear``): vocab × (hidden + 2), beside the embedding when tied to it, in
      place of the fp32 head when not. A model our native forward runs (``shape.native_bytes``:
      its file's 4- and 8-bit blocks as packed, their float embedding and LM head beside them)
      takes what it holds, never less than the above (every other CPU 4-bit path holds less).
    """
    if device_kind == "cpu" and precision == "int4" and shape.native_bytes is not None:
        return max(shape.native_bytes, weight_bytes(replace(shape, native_bytes=None), precision, group_size,
                                                    device_kind))
    around = around_precision(precision, device_kind)  # the layers that are not quantized
    b = activation_bytes(around)
    head = shape.vocab_size * shape.hidden_size
    if precision in ACTIVATION_BYTES:
        packed_copy = head * b if device_kind == "cpu" and precision == "fp32" and shape.tie_word_embeddings else 0
        return shape.params * b + packed_copy
    cpu_head = 0  # what the CPU's LM head adds to (or, untied, saves on) the fp32 head
    if device_kind == "cpu" and precision == "int8":
        cpu_head = head * b if shape.tie_word_embeddings else 0
    elif device_kind == "cpu":
        cpu_head = shape.vocab_size * (shape.hidden_size + 2) - (0 if shape.tie_word_embeddings else head * b)
    linears = shape.layer_linear_params()
    if precision == "int8":
        per_layer = sum(o * i + o * INT8_ROW_BYTES for o, i in linears)
    else:
        if device_kind == "cuda":
            linears = [(-(-o // INT4_CUDA_OUT_MULTIPLE) * INT4_CUDA_OUT_MULTIPLE,
                        -(-i // INT4_CUDA_IN_MULTIPLE) * INT4_CUDA_IN_MULTIPLE) for o, i in linears]
        per_layer = sum(o * i // 2 + o * -(-i // group_size) * 2 * QUANT_SCALE_BYTES for o, i in linears)
    unquantized = shape.params - sum(o * i for o, i in shape.layer_linear_params()) * shape.num_layers
    return per_layer * shape.num_layers + unquantized * b + cpu_head


@dataclass(frozen=True)
class HeadsShape:
    kind: str  # "medusa" | "hydra"
    num_heads: int
    num_layers: int
    own_lm_heads: bool = False
    context_mlp: int = 0  # width of the heads' context layer's MLP (0: no context layer)
    draft_vocab: int = 0  # rows of the LM head copied for drafting (0: drafts use the LM head itself)
    context_next: bool = False  # the context layer reads the next token too (a D × D projection and a norm)

    @classmethod
    def from_spec(cls, spec: Any) -> "HeadsShape":
        return cls(spec.kind, spec.num_heads, spec.num_layers, spec.own_lm_heads,
                   spec.context_mlp, spec.draft_vocab, spec.context_next)


def heads_bytes(heads: HeadsShape | None, shape: ModelShape, precision: str, tokens: int = 0) -> int:
    """Draft heads, from their real shapes (kept in the activation dtype).

    medusa: K × layers × (D² + D) [+ K × V × D with private LM heads]
    hydra:  K × ((2D² + D) + (layers − 1)(D² + D))
    context layer (optional): the base model's attention shape, q and o (2 × D × H × hd),
      k and v (2 × D × Hkv × hd), an MLP of width M (3 × D × M) and two norms (2D), plus
      its own one-layer KV cache for ``tokens`` tokens (2 × Hkv × hd × tokens); reading the
      next token adds a projection and a norm (D² + D).
    drafting vocabulary (optional): a copy of W LM-head rows (W × D) and their ids (W × 8 bytes).
    """
    if heads is None:
        return 0
    d, b = shape.hidden_size, activation_bytes(precision)
    if heads.kind == "hydra":
        per_head = 2 * d * d + d + (heads.num_layers - 1) * (d * d + d)
    else:
        per_head = heads.num_layers * (d * d + d)
    if heads.own_lm_heads:
        per_head += shape.vocab_size * d
    total = heads.num_heads * per_head
    if heads.context_mlp:
        hd = shape.head_dim
        total += (2 * d * shape.num_heads * hd + 2 * d * shape.num_kv_heads * hd + 3 * d * heads.context_mlp + 2 * d
                  + 2 * shape.num_kv_heads * hd * tokens + (d * d + d if heads.context_next else 0))
    total += heads.draft_vocab * d
    return total * b + heads.draft_vocab * 8


def kv_bytes(shape: ModelShape, tokens: int, precision: str) -> int:
    """KV cache = 2 (K and V) × L × Hkv × hd × S × b."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * tokens * activation_bytes(precision)


@dataclass(frozen=True)
class TreeShape:
    """What the memory model needs of a speculation tree: its ``nodes`` (root and any
    lookup chain included), the ``depth`` its heads draft (0: none), and its widest
    drafting level (``Tree.widest_drafting_level``; None: as many as its nodes)."""

    nodes: int = 1
    depth: int = 0
    widest: int | None = None

    @classmethod
    def of(cls, tree: Any | None) -> "TreeShape":
        """The shape of a ``runtime.tree.Tree`` (None: plain decoding)."""
        return cls(tree.num_nodes, tree.depth, tree.widest_drafting_level) if tree is not None else cls()


PLAIN = TreeShape()  # plain decoding: one node, nothing drafted


def tree_buffer_bytes(shape: ModelShape, tree: TreeShape, context: int, precision: str, *,
                      heads: HeadsShape | None = None, sampling: bool = False, whole_head: bool = False,
                      batch: int = 1) -> int:
    """What one verify step keeps besides the KV cache and the forward's activations.

    The base model's scores: greedy keeps one block of the LM head's, N × R × b with
    R = min(V, ``PICK_ROWS``) (``CausalLM.greedy_picks``), or R = V where the head is
    scored whole (``whole_head``: packed for oneDNN on CPU, or quantized); typical
    acceptance (``sampling``) keeps every node's distribution: the logits N × V × b and
    three fp32 N × V temporaries (probabilities, their log, the product summed for the
    entropy). The ``heads``' draft logits: rows × V' × b (``draft_rows``; V' their drafting
    vocabulary, or V), none without heads. Candidates and picks
    2 × N × 8, retrieval indices N × (depth + 1) × 8, the ancestor mask N × N and the
    attention mask N × (S + N) (1 byte each), and the final hidden states N × D × b.
    The cache's token ids (8 bytes a slot) are left out: kilobytes.
    A ``batch`` of B sequences (``runtime/batch.py``) holds all of it B times but the
    retrieval indices and ancestor mask, which the trees share (sampled rows accept one at
    a time: their distributions are held once).
    """
    b = activation_bytes(precision)
    v = shape.vocab_size
    rows = v if (sampling or whole_head) else min(v, PICK_ROWS)
    nodes, depth = tree.nodes, tree.depth
    scores = batch * nodes * rows * b + (nodes * rows * 12 if sampling else 0)
    if nodes <= 1:
        return scores + batch * (shape.hidden_size * b + context + 1)
    vocab = heads.draft_vocab if heads is not None and heads.kind == "hydra" and heads.draft_vocab else v
    drafts = batch * draft_rows(heads, tree) * vocab * b
    per_tree = 2 * nodes * 8 + nodes * (context + nodes) + nodes * shape.hidden_size * b
    return scores + drafts + batch * per_tree + nodes * (depth + 1) * 8 + nodes * nodes


def draft_rows(heads: HeadsShape | None, tree: TreeShape) -> int:
    """Rows of draft logits a step holds at once: Medusa heads score all K heads on one
    state (K rows), chained (Hydra) heads one level's states at a time (the ``widest``
    drafting level, ``Tree.widest_drafting_level``; None: as many as the nodes); none
    without heads or for a tree they do not draft (a lookup chain alone)."""
    if heads is None or tree.depth == 0 or tree.nodes <= 1:
        return 0
    return heads.num_heads if heads.kind == "medusa" else (tree.nodes if tree.widest is None else tree.widest)


def activation_peak_bytes(shape: ModelShape, tokens: int, context: int, precision: str,
                          device_kind: str = "cuda") -> int:
    """Peak temporaries of one forward over ``tokens`` (T) new tokens seeing ``context``
    (S) slots, all × b unless said otherwise.

    Every device: the residual stream and its normed copy (2 × T × D) and q/k/v
    (T × (H + 2 Hkv) × hd). CUDA (``model.py``'s forward): the boolean mask (T × S, one
    byte each) becomes one additive bias per forward, repeated for the g = H / Hkv query
    heads that share a key/value head ((g + 1) × T × S while the repeat is made); SDPA
    runs a fused kernel that never holds the H × T × S scores, and the keys and values
    are read in place (queries, not keys, are regrouped), with 2 × Hkv × S × hd allowed
    for a backend that copies a span of them contiguous; the MLP holds gate and up, SiLU
    (gate) and their product (4 × T × I); int8 weight-only matmuls dequantize one weight
    at a time (the largest, out × in). Measured on an H200 (torch 2.11) before queries
    were regrouped, when the keys and values were repeated to H heads instead
    (``docs/results/plan_verify``). Elsewhere (CPU, MPS) the unfused bound: scores and
    their softmax (2 × H × T × S) and the MLP's 3 × T × I.
    """
    b = activation_bytes(precision)
    t, s, d = tokens, context, shape.hidden_size
    common = 2 * t * d + t * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    if device_kind != "cuda":
        return b * (common + 2 * shape.num_heads * t * s + 3 * t * shape.intermediate_size)
    groups = shape.num_heads // shape.num_kv_heads
    bias = (groups + 1) * t * s
    kv_copies = 2 * shape.num_kv_heads * s * shape.head_dim
    dequant = max(o * i for o, i in shape.layer_linear_params()) if precision == "int8" else 0
    chunks = chunked_attention_bytes(shape, t, s) if groups * t <= ATTENTION_MAX_ROWS else 0
    return t * s + chunks + b * (common + bias + kv_copies + 4 * t * shape.intermediate_size + dequant)


def chunked_attention_bytes(shape: ModelShape, tokens: int, span: int) -> int:
    """The partial softmaxes a GPU step's chunked attention holds (``runtime.chunked_attention``):
    for every query head and token, each chunk of ``ATTENTION_SPLIT`` slots' maximum, sum and
    unnormalised output, fp32."""
    return shape.num_heads * tokens * -(-span // ATTENTION_SPLIT) * (shape.head_dim + 2) * 4


OVERHEAD_FRACTION = 0.03  # allocator slack, as a share of the bytes we plan


def overhead_bytes(device_kind: str, planned_bytes: int) -> int:
    """What the runtime holds besides our tensors: the CUDA/ROCm context and allocator
    slack (~500 MiB + ``OVERHEAD_FRACTION`` of what we plan), or the CPU process (~300 MiB
    + the same share)."""
    base = 500 * 2**20 if device_kind in ("cuda", "rocm") else 300 * 2**20
    return base + int(OVERHEAD_FRACTION * planned_bytes)
