"""The base model's forward in our own C (``forward.c``) over a GGUF's own 4- and 8-bit blocks,
under our one decoding step (``step.py``): the CPU backend "native".

Why: a speculative step verifies several tokens at once, so what counts on a CPU is the cost
of one token and of T tokens against it. llama.cpp's forward (``ggml_step.py``) over the
default model takes 6-10 ms a token on 2 cores and 8 tokens 3.3-4.3× one; ``forward.c``
takes 3-4 ms, and reads each weight block once for up to 8 tokens (8 tokens ~2.7× one).

The cache (``NativeCache``) holds every layer's keys (transposed) and values in two float32
tensors that the C code writes: token i of a forward goes to slot ``length + i``, and
``commit_row`` moves the accepted path's slots down to follow the context.
A tree's node attends to the context and to the nodes its mask row names, in slot order, so
an accepted node's hidden state is bit for bit the one plain decoding gives it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.host_forward import HostCache, HostForwardLM
from specmemo_core.runtime.native.build import library
from specmemo_core.runtime.native.weights import PackedMatrix, from_float, pack, packable, packed_bytes

MAX_TOKENS = 512  # tokens per forward: a prefill chunk (decoding.PREFILL_CHUNK) or a tree
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # forward.c's 0..6
ARCHITECTURES = ("llama", "mistral")  # GGUF stores their Q/K rows in rotary pairs, as forward.c reads them

_P = ctypes.c_void_p
_I = ctypes.c_int


class NativeUnsupported(SpecMemoError):
    """The native forward does not run this model (its architecture or tensors)."""


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.sm_model_new.restype = _P
    lib.sm_model_new.argtypes = [_I] * 7 + [ctypes.c_float, ctypes.c_float, _P, _P, _I, _I]
    lib.sm_set_matrix.argtypes = [_P, _I, _I, _I, _I, _I, _P, _P, _P]
    lib.sm_set_norms.argtypes = [_P, _I, _P, _P]
    lib.sm_forward.restype = _I
    lib.sm_forward.argtypes = [_P, _P, _P, _P, _I, _I, _I, _P, _P, _P, _P, _I, _P, _P, _P]
    lib.sm_work_new.restype = _P
    lib.sm_work_new.argtypes = [_P, _I]
    lib.sm_work_free.argtypes = [_P]
    lib.sm_commit.argtypes = [_P, _P, _P, _I, _I, _I, _P]
    lib.sm_model_free.argtypes = [_P]
    lib.sm_lanes.restype = _I
    lib.sm_kernel.restype = ctypes.c_char_p
    return lib


def _ptr(a: np.ndarray | torch.Tensor) -> int:
    return a.data_ptr() if isinstance(a, torch.Tensor) else a.ctypes.data


class NativeCache(HostCache):
    """Keys and values for ``forward.c``, float32: keys [layers, kv_heads * head_dim, capacity]
    (transposed, so a query scores 16 slots per vector operation), values [layers, capacity,
    kv_heads * head_dim]: a forward's tokens must fit, as on our torch forward (the decoder
    speculates only where a tree's nodes do), so it holds the planner's KV bytes and no more.
    With our cache's host bookkeeping (length, the token ids the lookup chain reads), and the
    forward's workspace and logits: a cache is one conversation's,
    decoded on one thread at a time, while another cache's forward may run beside it (the app's
    step timing runs while a chat replies)."""

    def __init__(self, lm: NativeLM, capacity: int) -> None:
        super().__init__(capacity)
        spec = lm.spec
        self.slots = capacity
        kvd = spec.num_kv_heads * spec.head_dim
        self.k = torch.zeros(spec.num_layers, kvd, self.slots)  # keys transposed: a head's dimension, then slots
        self.v = torch.zeros(spec.num_layers, self.slots, kvd)
        self.lm = lm
        self.work = lm.lib.sm_work_new(lm.handle, self.slots)
        self.logits = np.zeros((1, lm.vocab), np.float32)  # grows to the most rows a forward scores

    def __del__(self) -> None:
        if getattr(self, "work", None):
            self.lm.lib.sm_work_free(self.work)
            self.work = None

    def commit_row(self, nodes: torch.Tensor | None, count: torch.Tensor | int) -> None:
        """The accepted path (``nodes`` [W], root first, ``count`` of them) moves to the slots
        after the context; a prefill chunk (None) or a 1-node step is in place already."""
        if nodes is None or nodes.shape[0] == 1:
            return
        n = int(count)
        picked = nodes[:n].to(torch.int64).contiguous()
        self.ids[self.length:self.length + n] = self.ids.index_select(0, picked + self.length)
        self.lm.lib.sm_commit(self.lm.handle, _ptr(self.k), _ptr(self.v), self.slots, self.length, n, _ptr(picked))


class NativeLM(HostForwardLM):
    """The base model as ``forward.c`` runs it (``host_forward.HostForwardLM``'s surface)."""

    engine_name = "the native forward"

    def __init__(self, path: Path, config: Any, embedding: torch.Tensor, head: torch.Tensor, *,
                 weights: dict[str, Any], threads: int, march: str = "native") -> None:
        super().__init__(config, embedding, head)
        self.path = path
        self.lib = _declare(library(march))
        self.build = Path(self.lib._name).stem  # forward-<hash of its source, flags and CPU>
        self.weights = weights  # every array forward.c reads: kept alive here
        self.threads = threads
        self.frequencies = self.inv_freq.float().contiguous()  # forward.c's rotary table, kept alive here
        spec = self.spec
        self.vocab = int(head.shape[0])
        self.handle = self.lib.sm_model_new(
            spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            spec.intermediate_size, self.vocab, float(spec.rms_norm_eps), float(self.rope_scale),
            _ptr(self.frequencies), _ptr(weights["output_norm"]), threads, MAX_TOKENS)
        for layer in range(spec.num_layers):
            for which, name in enumerate(MATRICES):
                self._set(layer, which, weights[f"blk.{layer}.{name}"])
            self.lib.sm_set_norms(self.handle, layer, _ptr(weights[f"blk.{layer}.attn_norm"]),
                                  _ptr(weights[f"blk.{layer}.ffn_norm"]))
        self._set(0, -1, weights["token_embd"])
        self._set(0, -2, weights["output"])

    def _set(self, layer: int, which: int, p: PackedMatrix) -> None:
        self.lib.sm_set_matrix(self.handle, layer, which, p.rows, p.cols, int(p.nibbles), _ptr(p.u), _ptr(p.d),
                               _ptr(p.m))

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self.lib.sm_model_free(self.handle)
            self.handle = None

    def new_cache(self, capacity: int) -> NativeCache:
        return NativeCache(self, capacity)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: NativeCache, last_only: bool = False) -> torch.Tensor:
        """The final hidden states [T, D] of ``tokens`` [T] at ``positions`` (``cache.prepare``'s:
        its mask's last T columns are a tree's ancestors, or a causal chunk's). ``last_only``
        (a prefill chunk whose other rows nobody reads): only the last row is scored by the
        LM head; every row's hidden state is given."""
        t = tokens.shape[-1]
        if tokens.dim() != 1:
            raise SpecMemoError("the native backend decodes one conversation at a time; batch on the torch backend")
        if t > MAX_TOKENS:
            raise SpecMemoError(f"the native forward runs at most {MAX_TOKENS} tokens at once, not {t}")
        cache.ensure_room(t)  # the context-full error our torch forward gives
        ancestors = mask[:, -t:]
        causal = t == 1 or bool(torch.equal(ancestors, torch.ones(t, t, dtype=torch.bool).tril()))
        allowed = None if causal else ancestors.to(torch.uint8).contiguous()
        if t and not 0 <= int(tokens.min()) <= int(tokens.max()) < self.vocab:  # forward.c reads the embedding row
            raise SpecMemoError(f"a token id outside the model's {self.vocab} tokens; start a new chat")
        ids = tokens.to(torch.int32).contiguous()
        at = positions.to(torch.int32).contiguous()
        rows = torch.tensor([t - 1], dtype=torch.int32) if last_only else torch.arange(t, dtype=torch.int32)
        n = rows.shape[0]
        if cache.logits.shape[0] < n:
            cache.logits = np.zeros((n, self.vocab), np.float32)
        hidden = torch.empty(t, self.spec.hidden_size)
        picks = torch.empty(n, dtype=torch.int64)
        code = self.lib.sm_forward(self.handle, cache.work, _ptr(cache.k), _ptr(cache.v), cache.slots, cache.length,
                                   t, _ptr(ids), _ptr(at), None if allowed is None else _ptr(allowed), _ptr(hidden),
                                   n, _ptr(rows), _ptr(cache.logits), _ptr(picks))
        if code != 0:
            raise SpecMemoError(f"the native forward could not run {t} tokens after {cache.length}; start a new chat")
        kept = hidden[-1:] if last_only else hidden
        self.last.keep(kept, list(cache.logits[:n]), picks)
        return hidden


def _role(entry: Any) -> tuple[str, str | None]:
    """A GGUF tensor's name less ``.weight`` and what ``forward.c`` holds it as: "norm" (a
    vector, float32), "matrix" (packed) or None (not read)."""
    name = entry.name.removesuffix(".weight")
    if len(entry.shape) == 1:
        return name, "norm"
    return name, "matrix" if name in ("token_embd", "output") or name.split(".")[-1] in MATRICES else None


def _matrix(raw: np.ndarray, entry: Any, lanes: int, dequantized: Callable[[], np.ndarray]) -> PackedMatrix:
    rows, cols = entry.shape
    if packable(entry.kind, cols):
        return pack(raw, entry.kind, rows, cols, lanes)
    if cols % 32:
        raise NativeUnsupported(f"{entry.name} has {cols} columns, not a multiple of 32")
    return from_float(dequantized(), lanes)  # K-quants, F16, …: as 8-bit blocks of 32 (close, not the file's own)


def native_weights(path: Path, index: Any, *, lanes: int,
                   progress: Callable[[str, float], None] | None = None) -> dict[str, Any]:
    """Every tensor ``forward.c`` reads from the GGUF at ``path`` (its tensor table ``index``,
    a ``gguf_load.GGUFIndex``), repacked for a kernel of ``lanes`` rows a group (``weights.pack``):
    matrices by GGUF name less ``.weight`` (``output``: the LM head, the embedding where
    tied), norms as float32."""
    from specmemo_core.storage import dequant, gguf_load

    if index.architecture not in ARCHITECTURES:
        raise NativeUnsupported(f"the native forward runs {', '.join(ARCHITECTURES)} models, not "
                                f"{index.architecture}")
    if any(t.name.endswith(".bias") for t in index.tensors):
        raise NativeUnsupported("the native forward runs models without biases")
    _mapped, data = gguf_load.map_file(path)
    out: dict[str, Any] = {}
    for i, entry in enumerate(index.tensors):
        raw = data[entry.offset:entry.offset + entry.nbytes].view(np.ndarray)
        name, role = _role(entry)
        if role == "norm":
            out[name] = dequant.dequantize_blocks(raw, entry.kind, entry.shape).astype(np.float32)  # a copy
        elif role == "matrix":
            out[name] = _matrix(raw, entry, lanes, lambda: _file_layout(raw, entry))
        if progress is not None:
            progress("packing weights for the native forward", (i + 1) / len(index.tensors))
    out.setdefault("output", out["token_embd"])
    return out


def _file_layout(raw: np.ndarray, entry: Any) -> np.ndarray:
    """A tensor de-quantized to float32 in the file's own row order (Q/K rows still in
    rotary pairs, which is what ``forward.c`` reads): the simple formats in torch
    (``storage/dequant.py``), the others through gguf."""
    from specmemo_core.storage import dequant

    if dequant.supported(entry.kind):
        return np.asarray(dequant.dequantize_blocks(raw, entry.kind, tuple(entry.shape)), dtype=np.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    kind = GGMLQuantizationType(entry.kind)
    return dequantize(raw.reshape(quant_shape_to_byte_shape(entry.shape, kind)), kind).astype(np.float32)


def load_native(opened: Any, *, threads: int, progress: Callable[[str, float], None] | None = None,
                march: str = "native") -> NativeLM:
    """``opened`` (a ``storage.sources.OpenedModel`` of a GGUF) for the native forward: its
    blocks repacked, and the embedding read once (float32) for the heads; ``march``: the CPU
    the forward is built for (``build.library``)."""
    if Path(opened.source).suffix.lower() != ".gguf":
        raise NativeUnsupported("the native backend runs GGUF files; convert the model or use the torch backend")
    if opened.gguf_index is None:
        raise NativeUnsupported("the native backend runs GGUF files; convert the model or use the torch backend")
    weights = native_weights(Path(opened.source), opened.gguf_index, lanes=_declare(library(march)).sm_lanes(),
                             progress=progress)
    wanted = {"model.embed_tokens.weight", "lm_head.weight"} & set(opened.shapes)
    read = {n: t.float() for n, t in opened.tensors(progress, skip=set(opened.shapes) - wanted)}
    embedding = read["model.embed_tokens.weight"]
    return NativeLM(Path(opened.source), opened.config, embedding, read.get("lm_head.weight", embedding),
                    weights=weights, threads=threads, march=march)


def held_bytes(index: Any, *, lanes: int) -> int:
    """The bytes ``load_native`` holds a GGUF's weights in, from its tensor table ``index``
    (``gguf_load.GGUFIndex``) alone: every matrix ``native_weights`` packs (``packed_bytes``),
    the norms as float32, and beside them what the heads read (``host_forward.HostForwardLM``):
    the embedding and the LM head as float32 (one tensor where tied) and the head's int8 rows
    with a bf16 scale each. The planner counts it (``memory.ModelShape.native_bytes``)."""
    total, vocab, hidden, tied = 0, 0, 0, True
    for entry in index.tensors:
        name, role = _role(entry)
        if role == "norm":
            total += 4 * entry.shape[0]
        elif role == "matrix":
            rows, cols = entry.shape
            total += packed_bytes(entry.kind, rows, cols, lanes)
            if name == "token_embd":
                vocab, hidden = rows, cols
            tied = tied and name != "output"
    floats = vocab * hidden * 4 * (1 if tied else 2)
    return total + floats + vocab * (hidden + 2)


def planned_bytes(source: Any) -> int | None:
    """``held_bytes`` of ``source`` (an opened model) where the native forward runs it, for
    the kernel this CPU builds; None where it does not."""
    if getattr(source, "gguf_index", None) is None or not supports(source):
        return None
    return held_bytes(source.gguf_index, lanes=_declare(library("native")).sm_lanes())


def supports(source: Any) -> bool:
    """The native forward runs ``source`` (an opened model) here: a GGUF of a family it knows,
    without biases, where a C compiler can build it."""
    from specmemo_core.runtime.native.build import available

    config = getattr(source, "config", None)
    return (Path(str(getattr(source, "source", ""))).suffix.lower() == ".gguf" and available()
            and getattr(config, "model_type", None) in ARCHITECTURES
            and not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False))
