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
``StaticDecoder`` adds ``GreedyStep``: a whole greedy step (draft, verify, accept,
commit, context layer) as one unit that ``torch.cuda.graph`` captures and replays, one
unit per tree size and span. On
CPU (and in the CPU tests) the same function runs eagerly; the CUDA tests capture it.

Masked slots contribute exact zeros to attention, so its outputs equal the sliced
decoder's (checked in the tests); the cost on CPU is attention over whole spans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmemo_core.runtime.decoding import Decoder, GenerationConfig, _State, draft_tokens, longest_accepted
from specmemo_core.runtime.kv_cache import KVCache
from specmemo_core.runtime.tree import load_tree

MIN_SPAN = 256  # the smallest span a step unit attends over (``StaticKVCache.spans``)


def _spans(capacity: int) -> tuple[int, ...]:
    """Powers of two from ``MIN_SPAN`` below ``capacity``, then ``capacity``."""
    spans, span = [], MIN_SPAN
    while span < capacity:
        spans.append(span)
        span *= 2
    return (*spans, capacity)


class StaticKVCache(KVCache):
    """A KV cache written at device-tensor slots and read over fixed spans (see the module doc)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, capacity, dtype, device)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)  # set by prepare()
        self.length_t = torch.zeros((), dtype=torch.long, device=device)  # == length, on the device
        self.columns = torch.arange(capacity, device=device)  # [C]
        self._spans = _spans(capacity)

    def prepare(self, offsets: torch.Tensor, ancestors: torch.Tensor | None = None,
                span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``KVCache.prepare``, in fixed shapes from ``length_t``: the mask is [T, span]
        (default: every slot) — the committed slots, plus each new token's ancestors
        (itself included) at slots length + j (None: the causal chain) — and ``slots`` is
        set for ``write``. The forward attends over the mask's ``span`` slots only."""
        t = offsets.shape[0]
        self.slots = self.length_t + torch.arange(t, device=offsets.device)
        rel = self.columns[None, : span or self.capacity] - self.length_t  # [1, span]
        if ancestors is None:
            mask = rel <= torch.arange(t, device=offsets.device)[:, None]
        else:
            in_new = (rel >= 0) & (rel < t)
            mask = (rel < 0) | (in_new & ancestors[:, rel[0].clamp(0, t - 1)])
        return self.length_t + offsets, mask

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [kvh, T, hd] stored at ``self.slots`` [T]; returns every slot [kvh, C, hd]."""
        self.k[layer].index_copy_(1, self.slots, k)
        self.v[layer].index_copy_(1, self.slots, v)
        return self.k[layer], self.v[layer]

    def write_ids(self, tokens: torch.Tensor) -> None:
        self.ids.index_copy_(0, self.slots, tokens)

    def spans(self) -> list[int]:
        """The spans step units attend over: powers of two from ``MIN_SPAN``, then the
        capacity. A decoding step attends over the smallest that holds the conversation
        and the tree (``span_for``), not over the whole cache: with one query row per
        head, attention's cost grows with the slots it reads (on an H200, 4,096 slots
        took 61% of a plain step's kernel time, 1,364 slots 39%)."""
        return list(self._spans)

    def span_for(self, new_tokens: int) -> int:
        return next(s for s in self._spans if s >= min(self.length + new_tokens, self.capacity))

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the keys, values and ids of slots ``src`` to slots ``dst``."""
        self.k.index_copy_(2, dst, self.k.index_select(2, src))
        self.v.index_copy_(2, dst, self.v.index_select(2, src))
        self.ids.index_copy_(0, dst, self.ids.index_select(0, src))

    def commit(self, node_indices: torch.Tensor) -> None:
        count = int(node_indices.numel())
        self.ensure_room(count)
        src = self.length_t + node_indices.to(self.k.device)
        dst = self.length_t + torch.arange(count, device=self.k.device)
        self._move(src, dst)
        self.length += count
        self.length_t += count

    def commit_row(self, nodes: torch.Tensor, count: torch.Tensor) -> None:
        """``commit`` in fixed shapes, on the device only: the entries of ``nodes`` [W]
        (a path, root first) move to slots length…length+W-1 and ``length_t`` grows by
        ``count`` (≤ W); the host's ``length`` is the caller's to move. Entries past
        ``count`` land in scratch slots, which the next forward overwrites."""
        dst = self.length_t + torch.arange(nodes.shape[0], device=nodes.device)
        self._move(self.length_t + nodes, dst)
        self.length_t += count

    def commit_prefix(self, count: int) -> None:
        super().commit_prefix(count)
        self.length_t += count

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.length_t.fill_(length)

    def reset(self) -> None:
        super().reset()
        self.length_t.zero_()


def capture_graph(run, warmup: int = 2, pool=None, stream: torch.cuda.Stream | None = None):
    """Capture ``run()`` as a CUDA graph after ``warmup`` runs on a side stream (as capture
    requires); returns the graph and the outputs of the captured run, which every replay
    rewrites in place. ``pool``: a memory pool shared with other graphs. ``stream``: the
    side stream (None: a new one). Share one between captures: cuBLAS keeps a workspace
    for every stream it has run on (32 MiB each on an H200), for the life of the process."""
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


class GreedyStep:
    """One whole greedy step over a fixed tree as a replayable unit: draft the tree from
    the root token and draft state, verify it, find the longest accepted path, commit its
    keys/values (and the context layer's), and leave the next root and draft state in
    its own buffers. On a GPU a step is then one graph replay and one host read (the
    emitted tokens), not a replay plus a dozen eagerly launched kernels and syncs.

    Every shape is fixed: the path is committed as a whole row of ``retrieve_indices``
    ([d+1] slots, of which only the accepted ``count`` stay: the rest lie past the new
    length, in scratch slots the next step overwrites), and the count moves the caches'
    device lengths. The host mirrors of those lengths are moved by ``__call__``.
    A 1-node tree (no heads) is a plain greedy step; a lookup chain is drafted on the
    device too (``lookup.py``).
    """

    def __init__(self, model, cache: StaticKVCache, buffers, heads=None, context=None,
                 context_cache: StaticKVCache | None = None, capture: bool = False, warmup: int = 2,
                 span: int | None = None, pool=None, stream: torch.cuda.Stream | None = None) -> None:
        self.model, self.cache, self.buffers, self.heads = model, cache, buffers, heads
        self.context, self.context_cache = context, context_cache
        device = cache.k.device
        self.width = buffers.retrieve_indices.shape[1]  # d + 1
        self.span = span or cache.capacity  # slots attended: [0, span)
        self.root = torch.zeros((), dtype=torch.long, device=device)
        self.state = torch.zeros(model.spec.hidden_size, dtype=model.dtype, device=device)
        self.graph = None
        self.out = None
        if capture:
            caches = [c for c in (cache, context_cache) if c is not None]
            lengths = [c.length_t.clone() for c in caches]
            self.graph, self.out = capture_graph(self._run, warmup, pool, stream)
            for c, length in zip(caches, lengths):  # the warm-up runs committed: undo that
                c.length_t.copy_(length)

    @torch.inference_mode()
    def _run(self) -> torch.Tensor:
        buf, m = self.buffers, self.model
        tokens = draft_tokens(m, self.heads, self.cache, buf, self.state, self.root, self.cache.length_t)  # [N]
        positions, mask = self.cache.prepare(buf.depths, buf.attn_mask, self.span)
        self.cache.write_ids(tokens)
        hidden = m(tokens, positions, mask, self.cache)  # [N, D]
        picks = m.greedy_picks(hidden)  # [N], without [N, V] logits
        row, count = greedy_path(tokens, picks, buf.retrieve_indices)  # [d+1], []
        nodes = row.clamp(min=0)
        self.cache.commit_row(nodes, count)
        path_hidden = hidden[nodes]  # [d+1, D]
        if self.context is not None:
            c = self.context_cache
            positions, mask = c.prepare(torch.arange(self.width, device=hidden.device), span=self.span)
            path_hidden = self.context(path_hidden, *m.rope(positions), mask, c)
            c.length_t += count
        # index_select, not x[t]: indexing by a 0-dim tensor reads it on the host (a sync,
        # which graph capture forbids)
        last = (count - 1).view(1)
        bonus = picks.index_select(0, nodes.index_select(0, last))  # [1]
        j = torch.arange(self.width, device=hidden.device)
        drafted = tokens[nodes[(j + 1).clamp(max=self.width - 1)]]
        emitted = torch.where(j < last, drafted, bonus)  # the accepted drafts, then the bonus
        self.root.copy_(bonus[0])
        self.state.copy_(path_hidden.index_select(0, last)[0])
        return torch.cat((count.view(1), emitted))  # [1 + d + 1]

    def __call__(self, root: int, state: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """The tokens this step emits (accepted drafts, then the bonus) and the next draft
        state (this unit's own buffer: rewritten by the next call)."""
        self.cache.ensure_room(self.buffers.depths.shape[0])
        if self.cache.length + self.buffers.depths.shape[0] > self.span:
            raise ValueError(f"this step unit attends over {self.span} slots; the cache needs a larger span")
        self.root.fill_(root)
        if state is not self.state:
            self.state.copy_(state)
        if self.graph is None:
            out = self._run()
        else:
            self.graph.replay()
            out = self.out
        values = out.tolist()  # the one host read of the step
        count = values[0]
        self.cache.length += count
        if self.context_cache is not None:
            self.context_cache.length += count
        return values[1:1 + count], self.state


def greedy_path(tokens: torch.Tensor, picks: torch.Tensor, retrieve: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The longest path whose every draft equals its parent's pick: (its fixed-size row of
    ``retrieve`` [d+1], how many of its nodes are accepted [] ), both on the device."""
    nodes = retrieve.clamp(min=0)
    return longest_accepted(tokens[nodes[:, 1:]] == picks[nodes[:, :-1]], retrieve)


@dataclass
class StaticDecoder(Decoder):
    """``Decoder`` over a ``StaticKVCache`` whose greedy steps run as ``GreedyStep`` units
    (one per tree size: the tree's and the plain 1-node one), captured as CUDA graphs on
    a CUDA device (``graphs``); other steps run as in ``Decoder``."""

    graphs: bool = False
    # the side stream its graphs are captured on (None: its own); sessions of one engine
    # share one, as cuBLAS keeps a workspace per stream for the life of the process
    capture_stream: torch.cuda.Stream | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cache, StaticKVCache):
            raise TypeError("StaticDecoder needs a StaticKVCache")
        super().__post_init__()
        self._steps: dict[tuple[int, int], GreedyStep] = {}  # by (tree nodes, span)
        self._single = load_tree("single").buffers.to(self.model.device)
        # one memory pool for every unit's graph: they never run at once, and nothing a
        # graph allocates outlives its replay (roots, states and caches live outside);
        # one side stream to capture them all (see capture_graph)
        cuda = self.model.device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if cuda else None
        self._capture_stream = self.capture_stream or (torch.cuda.Stream(self.model.device) if cuda else None)

    def _new_context_cache(self) -> StaticKVCache:
        """The heads' context layer gets a static cache too."""
        m = self._context.mspec
        return StaticKVCache(1, m.num_kv_heads, m.head_dim, self.cache.capacity, self.model.dtype, self.model.device)

    def capture(self) -> None:
        """Make the step units greedy decoding will use (capturing their CUDA graphs) now,
        one per span, on an empty cache, so no step of a conversation pays for it."""
        if not self.graphs or self.cache.length:
            return
        buffers, heads = (self._buffers, self.heads) if self.speculative else (self._single, None)
        for span in self.cache.spans():
            self._greedy_step(buffers, heads, span)

    def _greedy_step(self, buffers, heads, span: int | None = None) -> GreedyStep:
        """The unit for this tree over the smallest span that holds the next step."""
        n = buffers.depths.shape[0]
        span = span or self.cache.span_for(n)
        if (n, span) not in self._steps:
            self._steps[n, span] = GreedyStep(self.model, self.cache, buffers, heads, self._context,
                                              self._context_cache, capture=self.model.device.type == "cuda",
                                              span=span, pool=self._pool, stream=self._capture_stream)
        return self._steps[n, span]

    @torch.inference_mode()
    def _plain_step(self, state: _State, config: GenerationConfig, gen: torch.Generator) -> tuple[list[int], _State]:
        if not (self.graphs and config.temperature == 0.0):
            return super()._plain_step(state, config, gen)
        return self._run_step(self._greedy_step(self._single, None), state)

    @torch.inference_mode()
    def _step(self, state: _State, config: GenerationConfig, gen: torch.Generator) -> tuple[list[int], _State]:
        if not (self.graphs and config.temperature == 0.0 and self.speculative
                and self.cache.free_slots() >= self.tree.num_nodes):
            return super()._step(state, config, gen)
        return self._run_step(self._greedy_step(self._buffers, self.heads), state)

    def _run_step(self, step: GreedyStep, state: _State) -> tuple[list[int], _State]:
        emitted, draft = step(state.root, state.hidden)
        self.history.append(state.root)
        self.history.extend(emitted[:-1])
        self._nodes_used = step.buffers.depths.shape[0]
        return emitted, _State(root=emitted[-1], hidden=draft)


def new_static_cache(model, capacity: int) -> StaticKVCache:
    s = model.spec
    return StaticKVCache(s.num_layers, s.num_kv_heads, s.head_dim, capacity, model.dtype, model.device)
