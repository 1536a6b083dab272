"""The base model's forward through llama.cpp (ggml's kernels over the GGUF's own blocks),
under our one decoding step (``step.py``): our heads, lookup chain, tree and acceptance stay
ours; only the transformer forward and its KV cache are llama.cpp's.

Why: on a 2-core AVX2 CPU llama.cpp's step over the default model's Q4_1 blocks takes
11.6 ms, ours in torch 28.5 ms even in int4 (``quantize.Int4CpuLinear``): its kernels
alone (int4 8.7 ms, LM head 2.9, attention 2.3) take longer than llama.cpp's whole step.
It needs ``llama-cpp-python`` (the optional ``llamacpp`` extra); ``available`` says.

How a tree is verified: llama.cpp attends by *sequence*. Each leaf of the tree gets its own
sequence id; every node belongs to the sequences of the leaves below it, and the committed
context to all of them, so a node (whose query takes the first of its sequences) sees the
context and exactly its ancestors (``tree_sequences``). After the step the accepted path
becomes sequence 0 again and every other node's cells are freed (``LlamaCppCache.commit_row``).

What the step reads: ``LlamaCppLM.forward`` returns the final (normed) hidden states, which
the heads take, and keeps llama.cpp's logits of the same rows (``host_forward.py``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.host_forward import HostCache, HostForwardLM

MAX_SEQUENCES = 64  # llama.cpp's own limit (LLAMA_MAX_SEQ): sequence 0 and one per leaf of a tree
BATCH = 512  # tokens per llama_decode: a prefill chunk (decoding.PREFILL_CHUNK) or a tree
SPLIT_PREFILL = 8  # prompt chunks of this many tokens or more run their last token apart (``LlamaCppLM.forward``)


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _llama():
    try:
        import llama_cpp
    except ImportError as e:
        raise SpecMemoError("the llama.cpp backend needs llama-cpp-python: pip install -e '.[llamacpp]' "
                            "(it builds llama.cpp from source, about 5-30 min), or use the torch backend") from e
    llama_cpp.llama_log_set(_quiet_log(llama_cpp), ctypes.c_void_p(0))
    return llama_cpp


@functools.cache
def _quiet_log(llama_cpp: Any) -> Any:
    """A log callback that drops llama.cpp's load chatter (its errors reach us as return
    codes); cached, so the callback outlives every context that may call it."""
    return llama_cpp.llama_log_callback(lambda level, text, data: None)


@functools.cache
def _float_array(n: int) -> type:
    return ctypes.c_float * n


def _floats(pointer: Any, n: int) -> np.ndarray:
    """The ``n`` floats at a llama.cpp ``float *`` as a numpy view (no copy; faster than
    ``np.ctypeslib.as_array``, which makes an array type each call)."""
    if not pointer:
        raise SpecMemoError("llama.cpp gave no output for a row it was asked for; start a new chat")
    return np.frombuffer(_float_array(n).from_address(ctypes.addressof(pointer.contents)), dtype=np.float32)


def tree_sequences(ancestors: torch.Tensor) -> list[list[int]]:
    """Each tree node's llama.cpp sequence ids, from the ancestor mask [N, N] (``ancestors[i, j]``:
    node j is node i or an ancestor of it): one sequence (1, 2, …) per leaf, and a node in
    those of the leaves below it; a 1-node tree runs in sequence 0 itself."""
    n = ancestors.shape[0]
    if n == 1:
        return [[0]]
    below = ancestors.T  # below[i, j]: node j is node i or under it
    leaves = [j for j in range(n) if int(below[j].sum()) == 1]
    if len(leaves) >= MAX_SEQUENCES:
        raise SpecMemoError(f"a tree of {len(leaves)} leaves is more than llama.cpp's {MAX_SEQUENCES - 1} sequences; "
                            "choose a smaller tree for the llama.cpp backend")
    seq = {leaf: s + 1 for s, leaf in enumerate(leaves)}
    return [[seq[leaf] for leaf in leaves if bool(below[i, leaf])] for i in range(n)]


class LlamaCppCache(HostCache):
    """A KV cache held by one llama.cpp context: our cache's host bookkeeping (length, the
    token ids the lookup chain reads) over llama.cpp's cells. Tree nodes are written at
    positions ``length + depth``; ``commit_row`` keeps the accepted path's cells in
    sequence 0 and frees the rest."""

    def __init__(self, lm: "LlamaCppLM", capacity: int) -> None:
        super().__init__(capacity)  # the cells are llama.cpp's; the context reaches every sequence (share_context)
        ll = lm.ll
        params = ll.llama_context_default_params()
        params.n_ctx = capacity + BATCH  # room for a tree's scratch cells beside a full context
        params.n_batch = params.n_ubatch = BATCH
        params.n_seq_max = MAX_SEQUENCES
        params.kv_unified = True  # one set of cells that the tree's sequences share
        params.n_threads = params.n_threads_batch = lm.threads
        params.embeddings = True  # the final hidden states, for the heads
        params.pooling_type = ll.LLAMA_POOLING_TYPE_NONE
        params.no_perf = True
        # NOTE: llama.cpp's CPU flash attention (its "auto" default here) gave some trees' nodes
        # other logits than the same tokens decoded one by one (a 64-node tree of 9 leaves: off by
        # 0.51; 55 or 71 nodes: exact or 0.015); without it every tree tried was exact, bit for bit
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ll, self.ctx = ll, ll.llama_init_from_model(lm.handle, params)
        if not self.ctx:
            raise SpecMemoError(f"llama.cpp could not make a context of {capacity} tokens; plan a shorter context")
        self.memory = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(BATCH, 0, MAX_SEQUENCES)
        self.sequences: list[list[int]] = [[0]]  # of the last forward's nodes (``tree_sequences``)

    def __del__(self) -> None:
        if getattr(self, "ctx", None):
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ctx = None

    @property
    def nbytes(self) -> int:
        return int(self.ll.llama_state_get_size(self.ctx))

    def commit_row(self, nodes: torch.Tensor | None, count: torch.Tensor | int) -> None:
        """The accepted path (``nodes`` [W], root first, ``count`` of them) stays, in
        sequence 0; every other scratch cell goes."""
        if nodes is None or nodes.shape[0] == 1:  # a prefill chunk, or a plain step's root: every cell stays
            return
        src = nodes + self.length  # [W] the token ids move as the cells do (no tensors of KV here)
        self.ids[self.length:self.length + nodes.shape[0]] = self.ids.index_select(0, src)
        sequences = self.sequences
        mem, ll = self.memory, self.ll
        if all(seq == [0] for seq in sequences):  # a chain in sequence 0: its cells past the accepted ones go
            ll.llama_memory_seq_rm(mem, 0, self.length + int(count), -1)
            return
        last = int(nodes[int(count) - 1])
        keep = sequences[last][0]  # a leaf's sequence through the last accepted node
        ll.llama_memory_seq_rm(mem, keep, self.length + int(count), -1)  # its nodes past the accepted ones
        ll.llama_memory_seq_keep(mem, keep)  # frees every cell not on that path
        ll.llama_memory_seq_cp(mem, keep, 0, -1, -1)
        ll.llama_memory_seq_rm(mem, keep, -1, -1)
        self.sequences = [[0]]

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.ll.llama_memory_seq_rm(self.memory, 0, length, -1)

    def share_context(self, sequences: list[list[int]]) -> None:
        """Make the committed context visible to every sequence of the coming forward's
        nodes (``tree_sequences``; a chain or prefill chunk: sequence 0 alone)."""
        for s in sorted({s for seq in sequences for s in seq} - {0}):
            self.ll.llama_memory_seq_cp(self.memory, 0, s, -1, -1)
        self.sequences = sequences


class LlamaCppLM(HostForwardLM):
    """The base model as llama.cpp runs it (``host_forward.HostForwardLM``'s surface)."""

    engine_name = "llama.cpp"

    def __init__(self, path: Path, config: Any, embedding: torch.Tensor, head: torch.Tensor, *, threads: int) -> None:
        super().__init__(config, embedding, head)
        self.ll = _llama()
        self.ll.llama_backend_init()
        params = self.ll.llama_model_default_params()
        params.n_gpu_layers = 0
        self.handle = self.ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.handle:
            raise SpecMemoError(f"llama.cpp could not load {path}; check the file, or use the torch backend")
        self.path, self.threads = path, threads
        self.vocab = int(self.ll.llama_vocab_n_tokens(self.ll.llama_model_get_vocab(self.handle)))

    def new_cache(self, capacity: int) -> LlamaCppCache:
        return LlamaCppCache(self, capacity)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: LlamaCppCache, last_only: bool = False) -> torch.Tensor:
        """The final hidden states [T, D] of ``tokens`` [T] at ``positions`` (``cache.prepare``'s:
        its mask's last T columns are a tree's ancestors, or a causal chunk's). ``last_only``
        (a prefill chunk whose other rows nobody reads): the last row alone, the others zero.

        A context that gives hidden states gives every row of a forward (llama.cpp makes each
        token an output then), and scores each with its LM head: 0.7 ms a row here. So a
        ``last_only`` chunk of ``SPLIT_PREFILL`` tokens or more runs as two forwards: all but
        the last token with no output at all, then the last one (a 128-token prompt: 498 ms
        instead of 571; at 4 tokens the two cost the same)."""
        t = tokens.shape[-1]
        if tokens.dim() != 1:
            raise SpecMemoError("the llama.cpp backend decodes one conversation at a time; batch on the torch backend")
        if t > BATCH:
            raise SpecMemoError(f"llama.cpp runs at most {BATCH} tokens a forward, not {t}")
        ancestors = mask[:, -t:]  # a lone token is its own chain; a longer run is a tree unless causal
        causal = t == 1 or bool(torch.equal(ancestors, torch.ones(t, t, dtype=torch.bool).tril()))
        sequences = [[0]] * t if causal else tree_sequences(ancestors)
        cache.share_context(sequences)
        ids, at = tokens.tolist(), positions.tolist()
        if not last_only:
            return self._decode(cache, ids, at, sequences, range(t))
        if t >= SPLIT_PREFILL:
            self._decode(cache, ids[:-1], at[:-1], sequences[:-1], ())
            last = self._decode(cache, ids[-1:], at[-1:], sequences[-1:], (0,))
        else:
            last = self._decode(cache, ids, at, sequences, (t - 1,))
        hidden = torch.zeros(t, self.spec.hidden_size)
        hidden[-1] = last[0]
        return hidden

    def _decode(self, cache: LlamaCppCache, ids: list[int], at: list[int], sequences: list[list[int]],
                rows: Sequence[int]) -> torch.Tensor | None:
        """One ``llama_decode`` of ``ids`` at positions ``at`` in their ``sequences``: the
        hidden states [len(rows), D] of ``rows`` (``_read_rows``); with no rows, none (and no
        hidden states asked of llama.cpp, so it scores no row)."""
        b, ll = cache.batch, self.ll
        b.n_tokens = len(ids)
        for i, (tok, pos, seqs) in enumerate(zip(ids, at, sequences)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, len(seqs), 0
            for j, s in enumerate(seqs):
                b.seq_id[i][j] = s
        for i in rows:
            b.logits[i] = 1
        if not rows:
            ll.llama_set_embeddings(cache.ctx, False)
        try:
            code = ll.llama_decode(cache.ctx, b)
        finally:
            if not rows:
                ll.llama_set_embeddings(cache.ctx, True)
        if code != 0:
            raise SpecMemoError(f"llama.cpp could not decode {len(ids)} tokens (code {code}); start a new chat")
        return self._read_rows(cache.ctx, list(rows)) if rows else None

    def _read_rows(self, ctx: Any, rows: list[int]) -> torch.Tensor:
        """The hidden states [n, D] of the batch's ``rows`` (by batch index, ``_ith``: llama.cpp
        may keep its outputs in another order), and their greedy picks. The logits stay in
        llama.cpp's buffer, read in place (valid until the next decode, by when ``last.rows``
        names the next forward's rows). The picks come from numpy's argmax (the first
        maximum, as torch's): over the default model's 49,152 logits ~15 µs, torch's ~60.
        Each op here runs with the caches cold after the forward (~30-50 µs apiece on a
        2-core EPYC), so the step does as few as it can."""
        ll = self.ll
        out = torch.from_numpy(np.stack([_floats(ll.llama_get_embeddings_ith(ctx, i), self.spec.hidden_size)
                                         for i in rows]))
        logits = [_floats(ll.llama_get_logits_ith(ctx, i), self.vocab) for i in rows]
        picks = torch.from_numpy(np.fromiter((row.argmax() for row in logits), np.int64, len(rows)))
        return self.last.keep(out, logits, picks)


def load_llamacpp(opened: Any, *, threads: int, progress: Callable[[str, float], None] | None = None) -> LlamaCppLM:
    """``opened`` (a ``storage.sources.OpenedModel`` of a GGUF) for llama.cpp: the file itself,
    and its embedding read once (float32) for the heads."""
    if Path(opened.source).suffix.lower() != ".gguf":
        raise SpecMemoError("the llama.cpp backend runs GGUF files; convert the model or use the torch backend")
    if progress is not None:
        progress("loading the model into llama.cpp", 0.0)
    wanted = {"model.embed_tokens.weight", "lm_head.weight"} & set(opened.shapes)
    read = {n: t.float() for n, t in opened.tensors(progress, skip=set(opened.shapes) - wanted)}
    embedding = read["model.embed_tokens.weight"]
    return LlamaCppLM(Path(opened.source), opened.config, embedding, read.get("lm_head.weight", embedding),
                      threads=threads)
