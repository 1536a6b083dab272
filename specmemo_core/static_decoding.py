"""Decoding with static shapes: the groundwork for CUDA graphs (issue 6).

On a GPU an eager forward of the default model costs ~17 ms whatever its size (kernel
launches), a CUDA-graph replay 2–3 ms. A graph replays fixed kernels on fixed addresses,
so every step must have the same shapes and read what changes from tensors updated in
place. ``decoding.Decoder`` slices the cache to ``length + T`` and builds masks from
Python ints; this decoder instead

- writes keys/values at slots given by a device tensor (``index_copy_``) and attends over
  the whole capacity, with a mask that hides the slots not (yet) in the conversation;
- keeps the cache length as a device scalar too, and derives slots, positions and masks
  from it with tensor ops of fixed shape (``StaticKVCache.prepare``);

so a verify forward has the same shapes every time. ``Decoder`` asks its cache for
positions and masks, so with a ``StaticKVCache`` it already decodes this way;
``StaticDecoder`` adds the graphed greedy steps.
``VerifyStep`` packs a greedy verify forward (KV writes, hidden states, each node's
argmax) and ``DraftStep`` the heads' drafting of the tree into units that
``torch.cuda.graph`` can capture and replay. NOTE: the
capture path has not run on a GPU yet; on CPU (and in the tests) the same function runs
eagerly, so its logic is checked, not its capture.

Masked slots contribute exact zeros to attention, so its outputs equal the sliced
decoder's (checked in the tests); the cost on CPU is attention over the whole capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .decoding import Decoder, GenerationConfig, _State
from .kv_cache import KVCache
from .tree import load_tree


class StaticKVCache(KVCache):
    """A KV cache written at device-tensor slots and read whole (see the module doc)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, capacity, dtype, device)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)  # set by prepare()
        self.length_t = torch.zeros((), dtype=torch.long, device=device)  # == length, on the device
        self.columns = torch.arange(capacity, device=device)  # [C]

    def prepare(self, offsets: torch.Tensor, ancestors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``KVCache.prepare``, in fixed shapes from ``length_t``: the mask is [T, C] —
        the committed slots, plus each new token's ancestors (itself included) at slots
        length + j (None: the causal chain) — and ``slots`` is set for ``write``."""
        t = offsets.shape[0]
        self.slots = self.length_t + torch.arange(t, device=offsets.device)
        rel = self.columns[None, :] - self.length_t  # [1, C]
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

    def commit(self, node_indices: torch.Tensor) -> None:
        count = int(node_indices.numel())
        self.ensure_room(count)
        src = self.length_t + node_indices.to(self.k.device)
        dst = self.length_t + torch.arange(count, device=self.k.device)
        self.k.index_copy_(2, dst, self.k.index_select(2, src))
        self.v.index_copy_(2, dst, self.v.index_select(2, src))
        self.length += count
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


def capture_graph(run, warmup: int = 2):
    """Capture ``run()`` as a CUDA graph after ``warmup`` runs on a side stream (as capture
    requires); returns the graph and the outputs of the captured run, which every replay
    rewrites in place."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


class VerifyStep:
    """One greedy verify forward over a fixed tree, as a replayable unit.

    Reads only tensors with fixed addresses — its own ``tokens`` buffer, the cache's
    ``length_t``, the tree buffers — and writes the nodes' KV into the cache's scratch
    slots, so ``torch.cuda.graph`` can capture it once (``capture=True``) and replay it
    every step; otherwise it runs the same function eagerly. A 1-node tree is a plain step.
    """

    def __init__(self, model, cache: StaticKVCache, buffers, capture: bool = False, warmup: int = 2) -> None:
        self.model, self.cache, self.buffers = model, cache, buffers
        n = buffers.depths.shape[0]
        self.tokens = torch.zeros(n, dtype=torch.long, device=cache.k.device)
        self.graph = None
        self.hidden = self.picks = None
        if capture:
            self.graph, (self.hidden, self.picks) = capture_graph(self._run, warmup)

    @torch.inference_mode()
    def _run(self) -> tuple[torch.Tensor, torch.Tensor]:
        positions, mask = self.cache.prepare(self.buffers.depths, self.buffers.attn_mask)
        hidden = self.model(self.tokens, positions, mask, self.cache)  # [N, D]
        return hidden, self.model.logits(hidden).argmax(-1)  # [N, D], [N]

    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Nodes' hidden states [N, D] and greedy picks [N] (the graph's own outputs when
        captured: read them before the next call)."""
        self.cache.ensure_room(self.tokens.numel())
        self.tokens.copy_(tokens)
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.hidden, self.picks


class DraftStep:
    """The heads' drafting of a fixed tree as a replayable unit: the tree's tokens [N] from
    the root token and the state the heads read, both copied into fixed buffers first, so
    ``torch.cuda.graph`` can capture it (``capture=True``); otherwise it runs eagerly."""

    def __init__(self, heads, buffers, embed, lm_head, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, capture: bool = False, warmup: int = 2) -> None:
        self.heads, self.buffers, self.embed, self.lm_head = heads, buffers, embed, lm_head
        self.root = torch.zeros((), dtype=torch.long, device=device)
        self.state = torch.zeros(hidden_size, dtype=dtype, device=device)
        self.graph = None
        self.tokens = None
        if capture:
            self.graph, self.tokens = capture_graph(self._run, warmup)

    @torch.inference_mode()
    def _run(self) -> torch.Tensor:
        return self.heads.draft(self.state, self.root, self.buffers, self.embed, self.lm_head)

    def __call__(self, state: torch.Tensor, root: int) -> torch.Tensor:
        self.state.copy_(state)
        self.root.fill_(root)
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.tokens.clone()


def greedy_path(tokens: torch.Tensor, picks: torch.Tensor, retrieve: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The longest path whose every draft equals its parent's pick: (its fixed-size row of
    ``retrieve`` [d+1], how many of its nodes are accepted [] ), both on the device."""
    valid = retrieve >= 0
    nodes = retrieve.clamp(min=0)
    ok = (tokens[nodes[:, 1:]] == picks[nodes[:, :-1]]) & valid[:, 1:]
    lengths = ok.int().cumprod(dim=1).sum(dim=1)  # [L]
    best = lengths.argmax()
    return retrieve[best], lengths[best] + 1


@dataclass
class StaticDecoder(Decoder):
    """``Decoder`` over a ``StaticKVCache`` whose greedy steps run through replayable
    units — ``DraftStep`` and one ``VerifyStep`` per tree size — captured as CUDA graphs
    on a CUDA device (``graphs``); other steps run as in ``Decoder``."""

    graphs: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.cache, StaticKVCache):
            raise TypeError("StaticDecoder needs a StaticKVCache")
        super().__post_init__()
        self._steps: dict[int, VerifyStep] = {}
        self._drafter: DraftStep | None = None
        self._single = load_tree("single").buffers.to(self.model.device)
        if self._context is not None:  # the heads' context layer gets a static cache too
            m = self._context.mspec
            self._context_cache = StaticKVCache(1, m.num_kv_heads, m.head_dim, self.cache.capacity,
                                                self.model.dtype, self.model.device)

    def _verify_step(self, buffers) -> VerifyStep:
        n = buffers.depths.shape[0]
        if n not in self._steps:
            self._steps[n] = VerifyStep(self.model, self.cache, buffers, capture=self.model.device.type == "cuda")
        return self._steps[n]

    def _draft_step(self, buffers) -> DraftStep:
        if self._drafter is None:
            m = self.model
            self._drafter = DraftStep(self.heads, buffers, m.model.embed_tokens, m.lm_head, m.spec.hidden_size,
                                      m.dtype, m.device, capture=m.device.type == "cuda")
        return self._drafter

    @torch.inference_mode()
    def _plain_step(self, state: _State, config: GenerationConfig, gen: torch.Generator) -> tuple[list[int], _State]:
        if not (self.graphs and config.temperature == 0.0):
            return super()._plain_step(state, config, gen)
        root = torch.tensor([state.root], device=self.model.device)
        return self._graph_step(root, self._single)

    @torch.inference_mode()
    def _step(self, state: _State, config: GenerationConfig, gen: torch.Generator) -> tuple[list[int], _State]:
        if not (self.graphs and config.temperature == 0.0 and self.speculative
                and self.cache.free_slots() >= self.tree.num_nodes):
            return super()._step(state, config, gen)
        return self._graph_step(self._draft_step(self._buffers)(state.hidden, state.root), self._buffers)

    def _graph_step(self, tokens: torch.Tensor, buf) -> tuple[list[int], _State]:
        """Verify ``tokens`` on tree ``buf`` through its VerifyStep, accept greedily, commit."""
        past = self.cache.length
        hidden, picks = self._verify_step(buf)(tokens)
        row, count_t = greedy_path(tokens, picks, buf.retrieve_indices)
        path = row[: int(count_t)]  # the one host read of the step
        self.cache.commit(path)
        path_list = path.tolist()
        token_list = tokens.tolist()
        self.history.extend(token_list[i] for i in path_list)
        bonus = int(picks[path_list[-1]])
        self._nodes_used = buf.depths.shape[0]
        draft = self._contextualize(hidden[path].clone(), past)  # clone: the graph's outputs are reused
        return [token_list[i] for i in path_list[1:]] + [bonus], _State(root=bonus, hidden=draft[-1])


def new_static_cache(model, capacity: int) -> StaticKVCache:
    s = model.spec
    return StaticKVCache(s.num_layers, s.num_kv_heads, s.head_dim, capacity, model.dtype, model.device)
