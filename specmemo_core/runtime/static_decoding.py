"""Decoding with static shapes: the groundwork for CUDA graphs (issue 6).

On a GPU an eager forward of the default model costs ~17 ms whatever its size (kernel
launches), a CUDA-graph replay 2–3 ms. A graph replays fixed kernels on fixed addresses,
so every step must have the same shapes and read what changes from tensors updated in
place. ``decoding.Decoder`` slices the cache to ``length + T`` and builds masks from
Python ints; this decoder instead

- writes keys/values at slots given by a device tensor (``index_copy_``) and attends over
  a fixed span of slots (the whole capacity, or in a step unit the smallest power of two
  that holds the conversation: ``StaticKVCache.spans``), with a mask that hides the slots
  not (yet) in the conversation;
- keeps the cache length as a device scalar too, and derives slots, positions and masks
  from it with tensor ops of fixed shape (``StaticKVCache.prepare``);

so a verify forward has the same shapes every time. ``Decoder`` asks its cache for
positions and masks, so with a ``StaticKVCache`` it already decodes this way;
``StaticDecoder`` keeps its greedy steps as ``step.StepUnit``s (the one step: draft,
verify, accept, commit, context layer) that ``torch.cuda.graph`` captures and replays,
one unit per tree size and span. On CPU (and in the CPU tests) the same units run
eagerly; the CUDA tests capture them.

Masked slots contribute exact zeros to attention, so its outputs equal the sliced
decoder's (checked in the tests); the cost on CPU is attention over whole spans.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Callable

import torch

from specmemo_core.runtime import step_kernels
from specmemo_core.runtime.decoding import PREFILL_CHUNK, Decoder
from specmemo_core.runtime.kv_cache import KVCache, span_ladder
from specmemo_core.runtime.split_cache import SplitCache
from specmemo_core.runtime.heads import ContextLayer
from specmemo_core.runtime.staged_prefill import prefill_buckets
from specmemo_core.runtime.step import (Acceptance, GreedyAcceptance, StepUnit, capture_graph, chunk_as_is,
                                        padded_prefill, prefill, reads_next)
from specmemo_core.runtime.tree import TreeBuffers



class StaticKVCache(KVCache):
    """A KV cache written at device-tensor slots and read over fixed spans (see the module
    doc). Its length lives twice: ``length`` on the host (what Python checks room and
    spans with) and ``length_t`` on the device (what a captured step reads and advances).
    Only the cache's own methods move them: ``commit_row`` the device one (inside a
    step), ``settle`` the host one (after the step's host read), the others both."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, capacity, dtype, device)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)  # set by prepare()
        self.length_t = torch.zeros((), dtype=torch.long, device=device)  # == length, on the device
        self.columns = torch.arange(capacity, device=device)  # [C]
        self._spans = span_ladder(capacity)

    @property
    def live_length(self) -> torch.Tensor:
        return self.length_t

    def prepare(self, offsets: torch.Tensor, ancestors: torch.Tensor | None = None,
                span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``KVCache.prepare``, in fixed shapes from ``length_t``: the mask is [T, span]
        (default: every slot) — the committed slots, plus each new token's ancestors
        (itself included) at slots length + j (None: the causal chain) — and ``slots`` is
        set for ``write``. The forward attends over the mask's ``span`` slots only."""
        t = offsets.shape[0]
        # counting from 0 by ``columns`` (a view): in a GPU step each arange would be a kernel
        self.slots = self.length_t + self.columns[:t]
        rel = self.columns[None, : span or self.capacity] - self.length_t  # [1, span]
        if ancestors is None:
            mask = rel <= self.columns[:t, None]
        else:
            in_new = (rel >= 0) & (rel < t)
            mask = (rel < 0) | (in_new & ancestors[:, rel[0].clamp(0, t - 1)])
        return self.length_t + offsets, mask

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [kvh, T, hd] stored at ``self.slots`` [T]; returns every slot [kvh, C, hd]."""
        self.k[layer].index_copy_(1, self.slots, k)
        self.v[layer].index_copy_(1, self.slots, v)
        return self.k[layer], self.v[layer]

    def slot_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer], self.slots

    def write_ids(self, tokens: torch.Tensor) -> None:
        self.ids.index_copy_(0, self.slots, tokens)

    def spans(self) -> list[int]:
        """The spans step units attend over: powers of two from ``kv_cache.MIN_SPAN``, then the
        capacity. A decoding step attends over the smallest that holds the conversation
        and the tree (``span_for``), not over the whole cache: with one query row per
        head, attention's cost grows with the slots it reads (on an H200, 4,096 slots
        took 61% of a plain step's kernel time, 1,364 slots 39%)."""
        return list(self._spans)

    def span_for(self, new_tokens: int) -> int:
        return next(s for s in self._spans if s >= min(self.length + new_tokens, self.capacity))

    def commit_row(self, nodes: torch.Tensor | None, count: torch.Tensor | int) -> None:
        """``KVCache.commit_row`` in fixed shapes, on the device only: the entries move by
        device-tensor slots and ``length_t`` grows by ``count`` (a tensor inside a step);
        ``settle`` then tells the host."""
        if nodes is not None and step_kernels.applies(self.k):  # one kernel for the three
            step_kernels.move_entries(self.k, self.v, self.ids, nodes, self.length_t)
        elif nodes is not None:
            dst = self.length_t + self.columns[: nodes.shape[0]]  # [W]
            src = self.length_t + nodes.to(self.k.device)  # [W]
            self.k.index_copy_(2, dst, self.k.index_select(2, src))
            self.v.index_copy_(2, dst, self.v.index_select(2, src))
            self.ids.index_copy_(0, dst, self.ids.index_select(0, src))
        self.length_t += count

    def rewind(self) -> None:
        """Put the device length back to the host's (undo steps run only to warm up a capture)."""
        self.length_t.fill_(self.length)

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.length_t.fill_(length)


@dataclass
class StaticDecoder(Decoder):
    """``Decoder`` over a ``StaticKVCache`` whose greedy steps run as step units kept one
    per tree size and span (the tree's and the plain 1-node one), captured as CUDA graphs
    on a CUDA device (``graphs``); other steps (sampling) run eagerly as in ``Decoder``.
    With graphs its prompt chunks replay graphs too, padded to bucket lengths
    (``_prefill_chunks``), whatever the acceptance rule."""

    _: KW_ONLY
    graphs: bool = False
    # the side stream its graphs are captured on (None: its own); sessions of one engine
    # share one, as cuBLAS keeps a workspace per stream for the life of the process
    capture_stream: torch.cuda.Stream | None = None
    # prompt chunks padded to bucket lengths and replayed as CUDA graphs (``_prefill_chunks``);
    # None: where steps replay graphs (CUDA, one device); True on a CPU runs the same code eagerly
    bucketed_prefill: bool | None = None
    # each greedy step starts before the last one is read (``Decoder.generate``): the GPU runs
    # it while the host reads, streams and checks the last; a step started for a reply that
    # ended is undone. None: where steps replay graphs; True on a CPU runs the same code eagerly
    overlap: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(home_cache(self.cache), StaticKVCache):
            raise TypeError("StaticDecoder needs a StaticKVCache (or a split model's SplitCache of them)")
        super().__post_init__()
        self.units: dict[tuple[int, int], StepUnit] = {}  # greedy units by (tree nodes, span)
        # one memory pool for every unit's graph: they never run at once, and nothing a
        # graph allocates outlives its replay (roots, states and caches live outside);
        # one side stream to capture them all (see step.capture_graph)
        cuda = self.model.device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if cuda else None
        self._capture_stream = self.capture_stream or (torch.cuda.Stream(self.model.device) if cuda else None)
        self._graphed = self.graphs and cuda and self.model.one_device  # steps replay CUDA graphs
        self._bucketed = self._graphed if self.bucketed_prefill is None else self.bucketed_prefill
        self._graph_prefill = self._graphed and self._bucketed
        self._prefill_buckets = prefill_buckets(PREFILL_CHUNK)
        device = self.model.device
        self._prefill_ids = torch.zeros(PREFILL_CHUNK, dtype=torch.long, device=device)  # the padded chunk
        self._prefill_next = torch.zeros(PREFILL_CHUNK, dtype=torch.long, device=device)  # each one's next token
        self._prefill_count = torch.ones((), dtype=torch.long, device=device)  # the chunk's prompt tokens
        self._prefill_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _new_context_cache(self, context: ContextLayer) -> StaticKVCache:
        """The heads' context layer gets a static cache too."""
        m = context.mspec
        return StaticKVCache(1, m.num_kv_heads, m.head_dim, self.cache.capacity, self.model.dtype, self.model.device)

    def _prefill_chunks(self, new_ids: list[int]) -> torch.Tensor:
        """With ``bucketed_prefill``: ``step.prefill`` with each chunk padded to the smallest
        bucket (16, 32, … ``PREFILL_CHUNK`` tokens), run in fixed shapes as a CUDA graph kept
        per bucket and span (``_padded_chunk``). Why: an eager prefill of the default model
        costs ~20 ms of kernel launches on an H200 whatever the prompt's length, several
        decoding steps' worth, in every turn."""
        if not self._bucketed:
            return super()._prefill_chunks(new_ids)
        return prefill(self.parts, new_ids, chunk=PREFILL_CHUNK, run_chunk=self._padded_chunk)

    def _padded_chunk(self, ids: list[int], following: list[int] | None) -> torch.Tensor:
        """One chunk (``step.prefill``'s ``run_chunk``) padded to its bucket in the decoder's
        buffers and run through ``step.padded_prefill``: replayed from the graph kept for its
        bucket and span (captured on first use; its warm-ups commit nothing), or eagerly. A
        chunk whose padding would run past the cache runs as it is (``step.chunk_as_is``)."""
        bucket = next(b for b in self._prefill_buckets if b >= len(ids))
        if self.cache.length + bucket > self.cache.capacity:
            return chunk_as_is(self.parts, ids, following)
        self._prefill_ids[: len(ids)] = torch.tensor(ids)
        if following:
            self._prefill_next[: len(following)] = torch.tensor(following)
        self._prefill_count.fill_(len(ids))
        span = self.cache.span_for(bucket)
        if not self._graph_prefill:
            return self._padded_run(bucket, span)()
        graph, out = self._prefill_graph(bucket, span)
        graph.replay()
        return out

    def _padded_run(self, bucket: int, span: int) -> Callable[[], torch.Tensor]:
        """``step.padded_prefill`` over the decoder's buffers cut to ``bucket``, attending over
        ``span`` (with each position's next token where the context layer reads it: ``prefill``
        passes them exactly then)."""
        following = self._prefill_next[:bucket] if reads_next(self.parts) else None
        return lambda: padded_prefill(self.parts, self._prefill_ids[:bucket], following, self._prefill_count, span)

    def _prefill_graph(self, bucket: int, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of a padded chunk of ``bucket`` over ``span``, captured on first use (its
        trial runs write scratch slots and the draft state only, as a chunk does before
        ``prefill`` commits it)."""
        if (bucket, span) not in self._prefill_graphs:
            self._prefill_graphs[bucket, span] = capture_graph(self._padded_run(bucket, span), pool=self._pool,
                                                               stream=self._capture_stream)
        return self._prefill_graphs[bucket, span]

    def capture(self, *, prefill: bool = False) -> None:
        """Make the step units greedy decoding will use (capturing their CUDA graphs) now,
        one per span, on an empty cache, so no step of a conversation pays for it; with
        ``prefill`` the padded prompt chunks' graphs too, every bucket over every span that
        holds it (a benchmark's turns then time no capture: each costs a few prefills)."""
        if not self.graphs or self.cache.length:
            return
        buffers = self._buffers if self.speculative else self._single
        for span in self.cache.spans():
            self._greedy_unit(buffers, span)
            for bucket in self._prefill_buckets if prefill and self._graph_prefill else ():
                if bucket <= span:
                    self._prefill_graph(bucket, span)

    def _greedy_unit(self, buffers: TreeBuffers, span: int) -> StepUnit:
        n = buffers.depths.shape[0]
        if (n, span) not in self.units:
            unit = StepUnit(self.parts, buffers, GreedyAcceptance(), span=span)
            if self.model.device.type == "cuda" and self.model.one_device:  # split over two: eager
                unit.capture(pool=self._pool, stream=self._capture_stream)
            self.units[n, span] = unit
        return self.units[n, span]

    def _overlaps(self, acceptance: Acceptance) -> bool:
        """Greedy steps over the static cache, whose length lives on the device: where steps
        replay graphs (``overlap`` None) or as ``overlap`` says."""
        return acceptance.graph_safe and (self._graphed if self.overlap is None else self.overlap)

    def _unit(self, acceptance: Acceptance, *, ahead: int = 0) -> StepUnit | None:
        """Greedy with ``graphs``: the kept unit for the next tree over the smallest span
        that holds the step (``ahead`` tokens later, as in ``_launch``); otherwise an eager
        unit, as in ``Decoder``. None ahead of a step in flight where the unit is not made
        yet: a capture's trial runs rewind the caches to their host lengths, which the step
        in flight has not settled."""
        if not (self.graphs and acceptance.graph_safe):
            return super()._unit(acceptance, ahead=ahead)
        buffers = self._next_buffers(ahead)
        key = buffers.depths.shape[0], self.cache.span_for(ahead + buffers.depths.shape[0])
        if ahead and key not in self.units:
            return None
        return self._greedy_unit(buffers, key[1])


def new_static_cache(model, capacity: int) -> StaticKVCache:
    """A static cache of every layer of ``model`` (one per segment of a split model, ``CausalLM.layer_cache``)."""
    s = model.spec
    return model.layer_cache(lambda layers, device: StaticKVCache(layers, s.num_kv_heads, s.head_dim, capacity,
                                                                  model.dtype, device))


def home_cache(cache):
    """The cache whose kind a decoder checks: a split model's home segment's, else the cache itself."""
    return cache.home if isinstance(cache, SplitCache) else cache
